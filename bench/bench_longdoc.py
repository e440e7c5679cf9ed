#!/usr/bin/env python3
"""`make bench-serving`, the long-document scenario: questions one after another over long
documents, as a user who keeps asking about one report asks them. Each document joins whole
SQuAD 2.0 articles (dev, CC BY-SA 4.0): two that its questions ask about and others around them,
until it holds at least --tokens tokens (16K-25K); its questions are SQuAD questions whose
answers it holds, spread over both articles. diffragd serves the default model with
a prompt budget that holds a whole document (--budget) and otherwise its defaults (no top_k):
documents that fit the budget go in whole, whatever the question matched.

- inline: the document is sent with every question (`docs`). Target: every question after the
  first gets its first token in at most 0.05 of the first's time.
- stored: one more document is ingested into a collection and asked about by collection
  (--stored-questions). A stored document that fits the budget goes in whole too, so the same
  target holds.
- window: a collection that holds --window-docs such documents, each larger than the budget
  (--window-budget, 16K), asked --window-questions questions about each, one document's after
  the other's, with relevance_floor 0 so that the retrieved context fills the budget. Each
  question is asked twice, one after the other, on one daemon that keeps 1 GiB of prefixes:
  as a query that names no order (the window layout: the best document's opening in order,
  then the best chunks outside it; docs/retriever.md) and with `order: rank` (the best chunks
  first, the exact path without a window, whose prompt no earlier question shares). Target:
  later questions over a document get their first token in at most 0.3 of the rank layout's
  time for the same question (the median), with at least as many answers right.

Times are the daemon's own (timings.ttft_ms: from receipt to the first token); answers are
greedy, 32 tokens at most, right when they contain a gold answer (SQuAD's normalisation).

    python3 bench/bench_longdoc.py [--docs 3] [--questions 10] [--stored-questions 3]
                                   [--window-docs 5] [--window-questions 10]
"""
import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = ROOT / os.environ.get("BUILD", "build")
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tools"))

import daemon_util  # noqa: E402
from bench_serving import chars_per_token  # noqa: E402
from eval_common import contains, load_squad  # noqa: E402

MODEL = ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"


def documents(n_docs, tokens, n_questions):
    """[(title, text, [(question, answers)])]: each document two whole articles that questions
    ask about and, around them, whole articles no question asks about until it holds about
    `tokens` tokens (in a fixed shuffled order); each article used once."""
    passages, questions = load_squad()
    arts = {}
    for p in passages.values():
        arts.setdefault(p["title"], []).append(p)
    asked_ids = {q["gold_passage_id"] for q in questions if not q["is_impossible"]}
    asked = [(t, ps) for t, ps in arts.items() if any(p["id"] in asked_ids for p in ps)]
    filler = iter([(t, ps) for t, ps in arts.items() if not any(p["id"] in asked_ids for p in ps)])
    if len(asked) < 2 * n_docs:
        raise SystemExit("the SQuAD data has questions over %d articles: at most %d documents"
                         % (len(asked), len(asked) // 2))
    cpt = chars_per_token("\n\n".join(p["text"] for p in list(passages.values())[:300]), MODEL,
                          BUILD / "diffrag-run")

    def article(t, ps):
        return "# %s\n\n%s" % (t.replace("_", " "), "\n\n".join(p["text"] for p in ps))
    out = []
    for k in range(n_docs):
        mine = asked[2 * k:2 * k + 2]
        parts = [article(t, ps) for t, ps in mine]
        while sum(map(len, parts)) / cpt < tokens:
            parts.append(article(*next(filler)))
        random.Random(k).shuffle(parts)
        ids = {p["id"] for _, ps in mine for p in ps}
        qs = [(q["question"], q["answers"]) for q in questions
              if q["gold_passage_id"] in ids and not q["is_impossible"]]
        step = max(1, len(qs) // n_questions)
        title = " / ".join(t.replace("_", " ") for t, _ in mine)
        out.append((title, "\n\n".join(parts), qs[::step][:n_questions]))
    return out


def ask(c, rid, q, budget, **where):
    m = {"v": 1, "op": "query", "id": rid, "question": q, "max_context_tokens": budget,
         "max_tokens": 32}
    m.update(where)
    _, r = c.call(m, timeout=1800)
    if not r.get("ok"):
        raise SystemExit("query failed: %s" % r.get("error"))
    return r


def run(label, c, doc_qs, budget, where_of, rows):
    rid = len(rows)
    for k, (title, text, qs) in enumerate(doc_qs):
        for i, (q, gold) in enumerate(qs):
            rid += 1
            r = ask(c, rid, q, budget, **where_of(k, title, text))
            row = {"layout": label, "doc": k, "n": i, "ttft_s": r["timings"]["ttft_ms"] / 1e3,
                   "prompt": r["usage"]["prompt_tokens"], "cached": r["usage"]["cached_tokens"],
                   "whole": r["context"]["whole"], "right": contains(r["answer"], gold)}
            rows.append(row)
            print("  %-16s doc %d q%-2d TTFT %6.2f s  prompt %5d, cached %5d%s  %s"
                  % (label, k, i + 1, row["ttft_s"], row["prompt"], row["cached"],
                     ", whole" if row["whole"] else "", "right" if row["right"] else "wrong"),
                  flush=True)


def run_window(c, doc_qs, budget, rows):
    """Each question in the window layout (no order named), then in rank order."""
    rid = 100000
    for k, (title, text, qs) in enumerate(doc_qs):
        for i, (q, gold) in enumerate(qs):
            for label, extra in (("window", {}), ("rank", {"order": "rank"})):
                rid += 1
                r = ask(c, rid, q, budget, collection="window", relevance_floor=0, **extra)
                cx = r["context"]
                row = {"layout": label, "doc": k, "n": i, "ttft_s": r["timings"]["ttft_ms"] / 1e3,
                       "prompt": r["usage"]["prompt_tokens"],
                       "cached": r["usage"]["cached_tokens"], "window": cx.get("window") is True,
                       "placed": cx["placed_tokens"], "right": contains(r["answer"], gold)}
                rows.append(row)
                print("  %-7s doc %d q%-2d TTFT %6.2f s  prompt %5d, cached %5d, placed %5d%s  %s"
                      % (label, k, i + 1, row["ttft_s"], row["prompt"], row["cached"],
                         row["placed"], ", window" if row["window"] else "",
                         "right" if row["right"] else "wrong"), flush=True)


def summarise_window(rows):
    """The window layout's first token against the rank layout's for the same question, over
    the questions that used the window (one whose best document's matching chunks do not fill
    its opening gets the same prompt either way, from the prefix cache the second time), the
    first such question of each document apart; answers right over all."""
    win = {(r["doc"], r["n"]): r for r in rows if r["layout"] == "window"}
    rank = {(r["doc"], r["n"]): r for r in rows if r["layout"] == "rank"}
    keys = sorted(k for k in win if k in rank)
    if not keys:
        return None
    used = [k for k in keys if win[k]["window"]]
    first = {}
    for k in used:
        first.setdefault(k[0], k)
    firsts = [first[d] for d in sorted(first)]
    later = [k for k in used if first[k[0]] != k]
    ratios = [win[k]["ttft_s"] / rank[k]["ttft_s"] for k in later]
    print("\n| layout | first window question of a document: median TTFT | later ones: median "
          "TTFT | later: median cached tokens | right (all %d questions) |" % len(keys))
    print("|---|---|---|---|---|")
    for label, d in (("window (no order named)", win), ("rank (exact, no window)", rank)):
        print("| %s | %.1f s | %.2f s | %d | %d / %d |" % (
            label, statistics.median(d[k]["ttft_s"] for k in firsts),
            statistics.median(d[k]["ttft_s"] for k in later) if later else float("nan"),
            statistics.median(d[k]["cached"] for k in later) if later else 0,
            sum(d[k]["right"] for k in keys), len(keys)))
    print("window layout used for %d of %d questions (for the others the best document's "
          "matching chunks did not fill its opening: the same prompt both ways)"
          % (len(used), len(keys)))
    if ratios:
        print("window / rank TTFT: first questions median %.3f; later questions median %.3f, "
              "worst %.3f, %d of %d at most 0.3"
              % (statistics.median(win[k]["ttft_s"] / rank[k]["ttft_s"] for k in firsts),
                 statistics.median(ratios), max(ratios), sum(x <= 0.3 for x in ratios),
                 len(ratios)))
    right_w = sum(win[k]["right"] for k in keys)
    right_r = sum(rank[k]["right"] for k in keys)
    both = sum(win[k]["right"] and rank[k]["right"] for k in keys)
    print("answers right: window %d, rank %d (both %d, only window %d, only rank %d); where the "
          "window was used: window %d, rank %d of %d"
          % (right_w, right_r, both, right_w - both, right_r - both,
             sum(win[k]["right"] for k in used), sum(rank[k]["right"] for k in used), len(used)))
    return (statistics.median(ratios) if ratios else float("inf")), right_w >= right_r


def summarise(rows, label):
    rs = [r for r in rows if r["layout"] == label]
    if not rs:
        return None
    ratios = []
    for k in sorted({r["doc"] for r in rs}):
        d = [r for r in rs if r["doc"] == k]
        ratios += [r["ttft_s"] / d[0]["ttft_s"] for r in d[1:]]
    first = [r["ttft_s"] for r in rs if r["n"] == 0]
    later = [r["ttft_s"] for r in rs if r["n"] > 0]
    print("| %s | %d | %d | %.1f s | %s | %s | %d / %d |" % (
        label, len(first), len(later), statistics.median(first),
        "%.2f s" % statistics.median(later) if later else "-",
        "%.3f (max %.3f)" % (statistics.median(ratios), max(ratios)) if ratios else "-",
        sum(r["right"] for r in rs), len(rs)))
    return max(ratios) if ratios else None


def write_json(path, rows):
    """One line per answer into path (None: nowhere)."""
    if path:
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16000, help="tokens of each document, about")
    ap.add_argument("--questions", type=int, default=10, help="inline questions per document")
    ap.add_argument("--stored-questions", type=int, default=3,
                    help="questions over a stored document (0: none)")
    ap.add_argument("--budget", type=int, default=32704)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window-docs", type=int, default=5,
                    help="documents of the window scenario (0: none; at most 5, two SQuAD "
                         "articles each)")
    ap.add_argument("--window-questions", type=int, default=10)
    ap.add_argument("--window-budget", type=int, default=16384)
    ap.add_argument("--window-tokens", type=int, default=18000,
                    help="tokens of each window document, about (more than the budget)")
    ap.add_argument("--only-window", action="store_true", help="run the window scenario alone")
    ap.add_argument("--json", help="one line per answer here")
    a = ap.parse_args()
    rows = []
    if a.window_docs:
        win_qs = documents(a.window_docs, a.window_tokens, a.window_questions)
        print("bench-longdoc window: %s, %d threads, %d cores; %d stored documents of ~%d "
              "tokens, %d questions each, budget %d, relevance_floor 0"
              % (MODEL.name, a.threads, os.cpu_count(), a.window_docs, a.window_tokens,
                 a.window_questions, a.window_budget), flush=True)
        with tempfile.TemporaryDirectory(prefix="bench-longdoc-") as tmp:
            with daemon_util.Daemon(pathlib.Path(tmp), MODEL, workers=1, threads=a.threads,
                                    max_context_tokens=a.window_budget, max_tokens=32,
                                    prefix_cache_bytes=1 << 30) as d:
                c = d.client()
                _, r = c.call({"v": 1, "op": "ingest", "id": "w", "collection": "window",
                               "docs": [{"id": "doc-%d" % k, "title": title, "text": text}
                                        for k, (title, text, _) in enumerate(win_qs)]},
                              timeout=600)
                if not r.get("ok"):
                    raise SystemExit("ingest failed: %s" % r.get("error"))
                run_window(c, win_qs, a.window_budget, rows)
                assert d.stop() == 0
        got = summarise_window(rows)
        if got:
            print("window target (later questions <= 0.3 of the rank layout's first token, "
                  "median; at least as many right): %s"
                  % ("met" if got[0] <= 0.3 and got[1] else "NOT met"), flush=True)
    if a.only_window:
        write_json(a.json, rows)
        return
    doc_qs = documents(a.docs + (1 if a.stored_questions else 0), a.tokens, a.questions)
    stored_doc = doc_qs.pop() if a.stored_questions else None
    print("bench-longdoc: %s, %d threads, %d cores; %d documents of ~%d tokens, budget %d"
          % (MODEL.name, a.threads, os.cpu_count(), a.docs, a.tokens, a.budget), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-longdoc-") as tmp:
        with daemon_util.Daemon(pathlib.Path(tmp), MODEL, workers=1, threads=a.threads,
                                max_context_tokens=a.budget, max_tokens=32) as d:
            c = d.client()
            run("inline", c, doc_qs, a.budget,
                lambda k, title, text: {"docs": [{"id": "long-%d" % k, "title": title,
                                                  "text": text}]}, rows)
            if stored_doc:
                title, text, qs = stored_doc
                _, r = c.call({"v": 1, "op": "ingest", "id": "i", "collection": "long",
                               "docs": [{"id": "stored", "title": title, "text": text}]},
                              timeout=600)
                if not r.get("ok"):
                    raise SystemExit("ingest failed: %s" % r.get("error"))
                run("stored", c, [(title, text, qs[:a.stored_questions])], a.budget,
                    lambda k, t, x: {"collection": "long"}, rows)
            assert d.stop() == 0
    write_json(a.json, rows)
    print("\n| layout | first questions | later questions | median first TTFT | median later "
          "TTFT | later / first of its document | right |")
    print("|---|---|---|---|---|---|---|")
    worst = summarise(rows, "inline")
    worst_stored = summarise(rows, "stored")
    for label, w in (("inline", worst), ("stored", worst_stored)):
        if w is not None:
            print("%s target (every later question <= 0.05 of its document's first): %s"
                  % (label, "met" if w <= 0.05 else "NOT met"))


if __name__ == "__main__":
    main()
