#!/usr/bin/env python3
"""Answer accuracy against the context budget, through diffragd, on SQuAD 2.0 (dev, CC BY-SA 4.0).

For each of the first --articles articles (in the order questions.jsonl first names them;
after the first --skip-articles of them, for another sample of questions), a
collection holds the article's own paragraphs and, as distractors, paragraphs of other
articles (the paragraphs of split "test", which no question uses, in file order) until the
collection holds about --corpus-tokens tokens (an article longer than that keeps only the
paragraphs that answer the questions asked past it). Each of the article's first --per-article
answerable questions is asked over its collection, greedy, with max_context_tokens set to each
budget, once in each of --orders: chunks best first ("rank"), in document order ("document"),
or best last, next to the question ("nearest"). When
every document the search found fits the budget, the daemon places them whole (in document
order). The oracle asks each question with its gold paragraph alone, as an inline document.

  contains  the normalised answer holds a normalised gold answer as whole words (SQuAD's
            normalisation: lower case, no punctuation, no articles, single spaces)
  F1        SQuAD's token F1 against the best gold answer
  answer's chunk  how many answers had the chunk of the gold paragraph that holds a gold
            answer ranked best by retrieval, among the best two, or placed at all

With --each-chunk every answer at a budget is followed by each of its placed chunks asked
alone, as an inline document (with the daemon's calibration on), and the rows "each chunk,
by SIGNAL" choose among those answers (and the refusals aside) the one whose grounding signal
says it is best supported: reading the chunks one at a time instead of together.

With --kv-reuse SHARE the daemon blends each prompt's documents from stored chunk KV
(kv_reuse = 1, kv_reuse_recompute = SHARE; docs/kv-reuse.md; --kv-reuse-full N sets
kv_reuse_full_chunks); run once with and once without it to compare. --kv-type q8 runs the
daemon with the int8 KV cache (kv_type), the exact path's own perturbation to compare against.
With --relevance-floor 0 every budget is filled with chunks however weakly they match (the
daemon's default floor, 0.5, stops at chunks under half the best one's score).

  tools/eval-rag.py                                   Qwen2.5-Coder-0.5B-Instruct, 2K..32K
  tools/eval-rag.py --budgets 2048,4096 --articles 2 --per-article 3 --show
  tools/eval-rag.py --budgets 16384 --orders rank --relevance-floor 0 --kv-reuse 0.15
  tools/eval-rag.py --budgets 16384 --orders nearest --relevance-floor 0 --skip-articles 4
"""
import argparse
import collections
import json
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import eval_common as ec  # noqa: E402

MAX_TOKENS = 32      # generated tokens per answer: SQuAD answers are a few words
CHARS_PER_TOKEN = 4  # to size the corpus before the daemon counts it


def token_f1(answer, golds):
    """SQuAD's F1 of the answer against the best of the gold answers."""
    a = ec.normalise(answer).split()
    best = 0.0
    for g in golds:
        g = ec.normalise(g).split()
        common = sum((collections.Counter(a) & collections.Counter(g)).values())
        if not a or not g or common == 0:
            continue
        p, r = common / len(a), common / len(g)
        best = max(best, 2 * p * r / (p + r))
    return best


def pick(passages, questions, n_articles, per_article, skip=0):
    """[(title, [questions])] for the first n_articles articles with answerable questions after
    the first skip of them."""
    n_articles += skip
    chosen = collections.OrderedDict()
    for q in questions:
        if q["is_impossible"]:
            continue
        title = passages[q["gold_passage_id"]]["title"]
        if title not in chosen:
            if len(chosen) == n_articles:
                continue
            chosen[title] = []
        if len(chosen[title]) < per_article:
            chosen[title].append(q)
    return list(chosen.items())[skip:]


def corpus(passages, title, qs, target_tokens):
    """The article's paragraphs (those that answer qs always), then distractors of other
    articles, as documents, until about target_tokens."""
    gold = {q["gold_passage_id"] for q in qs}
    own = [p for p in passages.values() if p["title"] == title]
    others = [p for p in passages.values() if p["title"] != title and p.get("split") == "test"]
    docs, chars = [], 0
    for p in own + others:
        if chars >= target_tokens * CHARS_PER_TOKEN and p["id"] not in gold:
            continue
        docs.append({"id": p["id"], "title": p["title"].replace("_", " "), "text": p["text"]})
        chars += len(p["text"])
    return docs


def chunk_text(docs, cite):
    """The text of a placed chunk: its document's bytes in the citation's offsets."""
    text = docs[cite["doc_id"]]["text"].encode()[cite["offsets"][0]:cite["offsets"][1]]
    return text.decode(errors="replace")


def answer_rank(q, reply, docs):
    """The retrieval rank (1: best score) among the placed chunks of the first chunk of the
    gold paragraph that holds a gold answer, or None when no placed chunk holds one."""
    cites = reply["citations"]
    for c in cites:
        if c["doc_id"] == q["gold_passage_id"] and ec.contains(chunk_text(docs, c),
                                                               q["answers"]):
            return 1 + sum(o["score"] > c["score"] for o in cites)
    return None


def judge(q, reply, budget, order, docs):
    if not reply.get("ok"):
        raise ec.EvalError("%s: %s" % (q["id"], reply.get("error")))
    a = reply["answer"]
    cx = reply.get("context") or {}
    gold = q["gold_passage_id"]
    return {"id": q["id"], "budget": budget, "order": order, "answer": a,
            "contains": ec.contains(a, q["answers"]), "f1": token_f1(a, q["answers"]),
            "gold_placed": any(c["doc_id"] == gold for c in reply["citations"]),
            "answer_rank": answer_rank(q, reply, docs),
            "whole": bool(cx.get("whole")), "placed_tokens": cx.get("placed_tokens"),
            "prompt_tokens": reply["usage"]["prompt_tokens"],
            "cached_tokens": reply["usage"].get("cached_tokens", 0),
            "reused_tokens": reply["usage"].get("reused_tokens", 0),
            "ttft_ms": reply["timings"]["ttft_ms"]}


# what "--each-chunk" chooses by: the grounding figure, and whether lower is better
EACH_SIGNALS = (("hidden_probe", 1), ("score", 1), ("self_check", -1), ("mean_logprob", -1))


def each_chunk(asker, q, reply, docs, timeout):
    """Each chunk the reply placed, asked alone as an inline document: [(answer, grounding)]."""
    out = []
    for k, c in enumerate(reply["citations"]):
        d = docs[c["doc_id"]]
        text = chunk_text(docs, c)
        msg = {"v": 1, "op": "query", "id": "%s-each%d" % (reply["id"], k),
               "question": q["question"], "max_tokens": MAX_TOKENS, "temperature": 0,
               "docs": [{"id": d["id"], "title": d["title"], "text": text}]}
        r = asker.ask(msg, timeout)
        if not r.get("ok"):
            raise ec.EvalError("%s: %s" % (msg["id"], r.get("error")))
        out.append((r["answer"], r.get("grounding") or {}))
    return out


def choose(answers, signal, sign):
    """The answer whose signal is best among those that did not abstain (or the first)."""
    kept = [(a, g) for a, g in answers if not g.get("abstained") and g.get(signal) is not None]
    if not kept:
        return answers[0][0] if answers else ""
    return min(kept, key=lambda ag: sign * ag[1][signal])[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ec.QWEN_MODEL))
    ap.add_argument("--budgets", default="2048,4096,8192,16384,32704",
                    help="max_context_tokens values (32704: the Qwen model's 32,768 less the "
                    "answer's 64)")
    ap.add_argument("--orders", default="rank,document")
    ap.add_argument("--articles", type=int, default=4)
    ap.add_argument("--per-article", type=int, default=6)
    ap.add_argument("--skip-articles", type=int, default=0, metavar="K",
                    help="start after the first K articles (another sample of questions)")
    ap.add_argument("--corpus-tokens", type=int, default=26000,
                    help="about this many tokens of paragraphs per collection")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--squad", default=str(ec.DEFAULT_SQUAD))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per question")
    ap.add_argument("--json", help="write every result here (JSON lines)")
    ap.add_argument("--show", action="store_true", help="print each result as it comes")
    ap.add_argument("--relevance-floor", type=float, metavar="SHARE",
                    help="the daemon's relevance_floor (0: the budget is filled with chunks "
                    "however weak their match)")
    ap.add_argument("--chunk-tokens", type=int, metavar="N",
                    help="the daemon's chunk_tokens (default: the daemon's, 256)")
    ap.add_argument("--each-chunk", action="store_true",
                    help="also ask each placed chunk alone and choose among the answers")
    ap.add_argument("--kv-reuse", type=float, metavar="SHARE",
                    help="blend documents from stored chunk KV, recomputing this share")
    ap.add_argument("--kv-reuse-full", type=int, metavar="N",
                    help="with --kv-reuse, the best-ranked chunks computed in full (the "
                    "daemon's kv_reuse_full_chunks; default: the daemon's)")
    ap.add_argument("--kv-type", choices=("f16", "f32", "q8"),
                    help="the daemon's KV cache type (kv_type; default: the daemon's, f16)")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    orders = args.orders.split(",")
    passages, questions = ec.load_squad(args.squad)
    sets = pick(passages, questions, args.articles, args.per_article, args.skip_articles)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.show else (lambda s: None)
    results = []
    keys = {} if args.kv_reuse is None else {"kv_reuse": 1,
                                             "kv_reuse_recompute": args.kv_reuse}
    if args.kv_reuse is not None and args.kv_reuse_full is not None:
        keys["kv_reuse_full_chunks"] = args.kv_reuse_full
    if args.relevance_floor is not None:
        keys["relevance_floor"] = args.relevance_floor
    if args.chunk_tokens is not None:
        keys["chunk_tokens"] = args.chunk_tokens
    if args.kv_type is not None:
        keys["kv_type"] = args.kv_type
    if not args.each_chunk:
        keys["grounding_calibration"] = "none"
    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="eval-rag-") as work, \
                ec.LocalDaemon(work, args.model, threads=args.threads, max_tokens=64,
                               **keys) as d, \
                ec.Asker(d.endpoint, d.proc) as asker:
            for i, (title, qs) in enumerate(sets):
                docs = corpus(passages, title, qs, args.corpus_tokens)
                doc_by_id = {d["id"]: d for d in docs}
                coll = "rag%d" % i
                for j in range(0, len(docs), 64):
                    r = asker.ask({"v": 1, "op": "ingest", "id": "ing%d-%d" % (i, j),
                                   "collection": coll, "docs": docs[j:j + 64]}, 600)
                    if not r.get("ok"):
                        raise ec.EvalError("ingest: %s" % r.get("error"))
                log("# %s: %d documents, %d questions" % (title, len(docs), len(qs)))
                for q in qs:
                    p = passages[q["gold_passage_id"]]
                    msg = {"v": 1, "op": "query", "id": q["id"] + "-oracle",
                           "question": q["question"], "max_tokens": MAX_TOKENS, "temperature": 0,
                           "docs": [{"id": p["id"], "title": p["title"].replace("_", " "),
                                     "text": p["text"]}]}
                    results.append(judge(q, asker.ask(msg, args.timeout), 0, "oracle",
                                         doc_by_id))
                    log(json.dumps(results[-1]))
                for b in budgets:
                    for o in orders:
                        for q in qs:
                            msg = {"v": 1, "op": "query", "id": "%s-%d-%s" % (q["id"], b, o),
                                   "question": q["question"], "collection": coll,
                                   "max_context_tokens": b, "order": o,
                                   "max_tokens": MAX_TOKENS, "temperature": 0}
                            reply = asker.ask(msg, args.timeout)
                            results.append(judge(q, reply, b, o, doc_by_id))
                            log(json.dumps(results[-1]))
                            if not args.each_chunk:
                                continue
                            each = each_chunk(asker, q, reply, doc_by_id, args.timeout)
                            for signal, sign in EACH_SIGNALS:
                                a = choose(each, signal, sign)
                                results.append(dict(results[-1], order="%s, each chunk by %s"
                                                    % (o, signal), answer=a,
                                                    contains=ec.contains(a, q["answers"]),
                                                    f1=token_f1(a, q["answers"])))
                            a = " ".join(a for a, _ in each)
                            results.append(dict(results[-1], order="%s, any chunk's answer" % o,
                                                answer=a, contains=ec.contains(a, q["answers"]),
                                                f1=None))
    except ec.EvalError as e:
        print("eval-rag: %s" % e, file=sys.stderr)
        return 2
    wall = time.time() - t0
    if args.json:
        with open(args.json, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    n = sum(len(qs) for _, qs in sets)
    print("model %s; %d articles%s, %d questions; collections of ~%d tokens; %s; %s; %.0f s "
          "in all" % (
        pathlib.Path(args.model).name, len(sets),
        " after the first %d" % args.skip_articles if args.skip_articles else "", n,
        args.corpus_tokens,
        "chunk KV reuse at share %g%s" % (
            args.kv_reuse, "" if args.kv_reuse_full is None
            else ", the best %d chunks in full" % args.kv_reuse_full)
        if args.kv_reuse is not None else "no chunk KV reuse",
        "%s KV" % (args.kv_type or "f16"), wall))
    print("| budget | order | contains | F1 | gold paragraph placed | answer's chunk best / "
          "best two / placed | placed whole | median prompt tokens | median reused tokens | "
          "median TTFT ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [(0, "oracle")] + list(dict.fromkeys((r["budget"], r["order"])
                                                for r in results if r["budget"]))
    for b, o in rows:
        rs = [r for r in results if r["budget"] == b and r["order"] == o]
        if not rs:
            continue
        f1 = [r["f1"] for r in rs if r["f1"] is not None]
        ranks = [r["answer_rank"] for r in rs]
        print("| %s | %s | %.2f | %s | %.2f | %d / %d / %d | %.2f | %d | %d | %.0f |" % (
            b or "gold paragraph", o, sum(r["contains"] for r in rs) / len(rs),
            "%.2f" % (sum(f1) / len(f1)) if f1 else "-",
            sum(r["gold_placed"] for r in rs) / len(rs),
            sum(k == 1 for k in ranks), sum(k is not None and k <= 2 for k in ranks),
            sum(k is not None for k in ranks),
            sum(r["whole"] for r in rs) / len(rs),
            statistics.median(r["prompt_tokens"] for r in rs),
            statistics.median(r["reused_tokens"] for r in rs),
            statistics.median(r["ttft_ms"] for r in rs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
