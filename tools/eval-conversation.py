#!/usr/bin/env python3
"""Conversations over one inline document: for each of the first N SQuAD articles (--split:
both halves by default; nothing here is fitted), its first paragraphs as one document of at most --chars characters, and --turns of its
answerable questions (--turns) asked in turn, each later one with the earlier questions and answers as
`history`. Prints, per turn, how often the answer contains a gold answer, the median time to
the first token and the prompt tokens taken from the prefix cache. Compare two builds (the
layout of the earlier turns is the prompt's) by running it with each --diffragd.

    python3 tools/eval-conversation.py [--diffragd build/diffragd] [--articles 24] [--json F]
"""
import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tools"))

import daemon_util  # noqa: E402
from eval_common import article_split, contains, load_squad  # noqa: E402


def conversations(n, chars, split, turns):
    """(document text, [(question, gold answers)] * turns) for the first n articles."""
    passages, questions = load_squad()
    by_title = {}
    for p in passages.values():
        by_title.setdefault(p["title"], []).append(p)
    out = []
    for title, ps in by_title.items():
        if split != "all" and article_split(title) != split:
            continue
        text, ids = "", set()
        for p in ps:
            if len(text) + len(p["text"]) + 2 > chars:
                break
            text = text + "\n\n" + p["text"] if text else p["text"]
            ids.add(p["id"])
        qs = [(q["question"], q["answers"]) for q in questions
              if q["gold_passage_id"] in ids and not q["is_impossible"]]
        if len(qs) >= turns:
            step = len(qs) // turns  # spread over the document, not its first paragraph only
            out.append((text, [qs[i * step] for i in range(turns)]))
        if len(out) == n:
            break
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--diffragd", default=str(ROOT / "build" / "diffragd"))
    ap.add_argument("--model", default=str(ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"))
    ap.add_argument("--articles", type=int, default=24)
    ap.add_argument("--chars", type=int, default=10000)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--budget", type=int, default=4096,
                    help="max_context_tokens: the default holds each document whole")
    ap.add_argument("--split", choices=("all", "fit", "test"), default="all")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/diffrag-eval-conversation")
    ap.add_argument("--json", help="one line per answer here")
    a = ap.parse_args()
    daemon_util.DIFFRAGD = pathlib.Path(a.diffragd)
    tmp = pathlib.Path(a.dir)
    tmp.mkdir(parents=True, exist_ok=True)
    rows = []
    with daemon_util.Daemon(tmp, a.model, workers=1, threads=a.threads,
                            max_context_tokens=max(a.budget, 4096),
                            max_tokens=32, relevance_floor=0) as d:
        c = d.client()
        rid = 0
        for k, (text, qs) in enumerate(conversations(a.articles, a.chars, a.split, a.turns)):
            history = []
            for turn, (q, gold) in enumerate(qs):
                rid += 1
                m = {"v": 1, "op": "query", "id": rid, "question": q, "docs": [{"text": text}],
                     "max_tokens": 32, "max_context_tokens": a.budget}
                if history:
                    m["history"] = list(history)
                _, r = c.call(m, timeout=600)
                if not r.get("ok"):
                    raise SystemExit("query failed: %s" % r)
                row = {"article": k, "turn": turn, "question": q, "answer": r["answer"],
                       "right": contains(r["answer"], gold), "ttft_ms": r["timings"]["ttft_ms"],
                       "prompt_tokens": r["usage"]["prompt_tokens"],
                       "cached_tokens": r["usage"]["cached_tokens"]}
                rows.append(row)
                print("[%d.%d] %s %.1f s cached %d/%d: %s" % (
                    k, turn, "right" if row["right"] else "wrong", row["ttft_ms"] / 1000,
                    row["cached_tokens"], row["prompt_tokens"], r["answer"][:80]), flush=True)
                history += [{"role": "user", "content": q},
                            {"role": "assistant", "content": r["answer"]}]
        assert d.stop() == 0
    if a.json:
        with open(a.json, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    print("\n| turn | answers | contain gold | median TTFT | median cached / prompt tokens |")
    print("|---|---|---|---|---|")
    for turn in range(a.turns):
        rs = [r for r in rows if r["turn"] == turn]
        print("| %d | %d | %d | %.2f s | %d / %d |" % (
            turn + 1, len(rs), sum(r["right"] for r in rs),
            statistics.median(r["ttft_ms"] for r in rs) / 1000,
            statistics.median(r["cached_tokens"] for r in rs),
            statistics.median(r["prompt_tokens"] for r in rs)))


if __name__ == "__main__":
    main()
