#!/usr/bin/env python3
"""Answer quality through diffragd on SQuAD 2.0 (dev, CC BY-SA 4.0): the first N answerable
questions of questions.jsonl (file order), each asked with its gold paragraph as the request's
one inline document, greedy, with the daemon's own prompt; and the first N unanswerable ones
(SQuAD 2.0's is_impossible: the paragraph does not hold the answer) the same way.

  answered  the normalised answer contains a normalised gold answer as whole words (SQuAD's
            normalisation: lower case, no punctuation, no articles a/an/the, single spaces)
  declined  the normalised answer contains the normalised refusal the daemon's system turn
            prescribes ("I cannot find the answer in the provided documents.",
            retriever/prompt.h); `abstained` (the daemon's grounding.abstained: the answer
            begins with it) is reported beside it

  tools/eval-answers.py                          50 + 50, Qwen2.5-Coder-0.5B-Instruct
  tools/eval-answers.py -n 10 --model models/SmolLM2-135M-Instruct.Q4_1.gguf --show
"""
import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import eval_common as ec  # noqa: E402

MAX_TOKENS = 64  # generated tokens per answer (SQuAD answers are a few words; a sentence fits)


def pick(questions, n):
    """(first n answerable, first n unanswerable) in file order."""
    answerable = [q for q in questions if not q["is_impossible"]][:n]
    unanswerable = [q for q in questions if q["is_impossible"]][:n]
    return answerable, unanswerable


def query_message(q, passages, max_tokens=MAX_TOKENS):
    p = passages[q["gold_passage_id"]]
    return {"v": 1, "op": "query", "id": q["id"], "question": q["question"],
            "docs": [{"id": p["id"], "title": p["title"], "text": p["text"]}],
            "max_tokens": max_tokens, "temperature": 0}


def judge(q, reply):
    """One result record of a reply (raises on an error reply: nothing to judge)."""
    if not reply.get("ok"):
        raise ec.EvalError("%s: %s" % (q["id"], reply.get("error")))
    a = reply["answer"]
    return {"id": q["id"], "question": q["question"], "is_impossible": q["is_impossible"],
            "gold": q["answers"], "answer": a, "answered": ec.contains(a, q["answers"]),
            "plausible": ec.contains(a, q.get("plausible_answers") or []),
            "declined": ec.declined(a), "abstained": bool(reply["grounding"]["abstained"]),
            "placed": len(reply["citations"]), "finish": reply["finish_reason"],
            "prompt_tokens": reply["usage"]["prompt_tokens"],
            "completion_tokens": reply["usage"]["completion_tokens"],
            "total_ms": reply["timings"]["total_ms"]}


def ask_all(asker, qs, passages, timeout, log=lambda s: None):
    out = []
    for q in qs:
        r = judge(q, asker.ask(query_message(q, passages), timeout))
        out.append(r)
        log(json.dumps(r))
    return out


def summary(results):
    """{answerable_n, answered, answerable_declined, unanswerable_n, declined, abstained,
    gave_plausible (an unanswerable question answered with SQuAD's tempting wrong span)}."""
    a = [r for r in results if not r["is_impossible"]]
    u = [r for r in results if r["is_impossible"]]

    def share(rs, key):
        return sum(r[key] for r in rs) / len(rs) if rs else None
    return {"answerable_n": len(a), "answered": share(a, "answered"),
            "answerable_declined": share(a, "declined"), "unanswerable_n": len(u),
            "declined": share(u, "declined"), "abstained": share(u, "abstained"),
            "gave_plausible": share(u, "plausible")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ec.QWEN_MODEL))
    ap.add_argument("-n", type=int, default=50, help="questions of each kind (default 50)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--squad", default=str(ec.DEFAULT_SQUAD))
    ap.add_argument("--timeout", type=float, default=600, help="seconds per question")
    ap.add_argument("--json", help="write every result here (JSON lines)")
    ap.add_argument("--show", action="store_true", help="print each result as it comes")
    args = ap.parse_args()
    passages, questions = ec.load_squad(args.squad)
    answerable, unanswerable = pick(questions, args.n)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.show else (lambda s: None)
    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="eval-answers-") as work, \
                ec.LocalDaemon(work, args.model, threads=args.threads,
                               grounding_calibration="none") as d, \
                ec.Asker(d.endpoint, d.proc) as asker:
            results = ask_all(asker, answerable + unanswerable, passages, args.timeout, log)
    except ec.EvalError as e:
        print("eval-answers: %s" % e, file=sys.stderr)
        return 2
    wall = time.time() - t0
    if args.json:
        with open(args.json, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    s = summary(results)
    print("model %s; %.0f s in all (%.1f s a question)" % (
        pathlib.Path(args.model).name, wall, wall / len(results)))
    print("| questions | n | contains a gold answer | declined | abstained | gave the plausible "
          "wrong span |")
    print("|---|---|---|---|---|---|")
    print("| answerable | %d | %.2f | %.2f | - | - |" % (s["answerable_n"], s["answered"],
                                                     s["answerable_declined"]))
    print("| unanswerable | %d | - | %.2f | %.2f | %.2f |" % (
        s["unanswerable_n"], s["declined"], s["abstained"], s["gave_plausible"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
