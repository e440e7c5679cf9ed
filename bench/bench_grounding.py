#!/usr/bin/env python3
"""`make bench-grounding`: what the groundedness signals cost.

1. Attention masses: decodes the small model after prompts of real text (SQuAD passages) with
   the attention-mass measurement off and on (the daemon's default watch set: every head of
   two layers, `--watch auto`), the two variants interleaved run by run so both see the same
   machine state, and prints the median decode tokens/s of each and their ratio. Target: at
   most 5% of decode time.
2. The signals measured after the answer: diffragd serving the default model with none, with
   the self-check (`grounding_self_check`), with context reliance (`grounding_reliance`) and
   with the calibration's hidden-state probe (the residual stream kept and shipped with the
   result; the others run without a calibration),
   asked the same queries over about 4K tokens of SQuAD paragraphs (each repetition new
   paragraphs, so no prefix cache helps any of them) in a rotating order; prints the median
   request time of each and each signal's share. Target: at most 10% of a request's time at
   4K tokens.
3. Quote decoding (`answer_mode = quote`): two daemons, free text and quoting, the same
   queries at about 4K tokens; the prefill (the documents' index included), the time of an
   answer token, and a quoted request priced at the free answer's length. Target: at most 10%
   of a request at 4K tokens.

Writes nothing."""
import argparse
import contextlib
import pathlib
import statistics
import subprocess
import sys
import json
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from bench_engine import MODEL, RUN, SQUAD, logfmt, tokens  # noqa: E402

QWEN = ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
QUESTIONS = SQUAD.parent / "questions.jsonl"


def decode_rate(ids_file, n_prompt, n_gen, threads, watch):
    cmd = [str(RUN), "-m", str(MODEL), "--tokens-file", str(ids_file), "-n", str(n_gen),
           "--threads", str(threads), "--temp", "0", "--ctx", str(n_prompt + n_gen + 1)]
    if watch:
        cmd += ["--watch", "auto", "--doc", f"0-{n_prompt}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    t = logfmt(r.stderr, "timings")
    if t["generated"] < n_gen:
        raise RuntimeError(f"the model stopped after {t['generated']:.0f} tokens; need {n_gen}")
    return t["decode_tok_s"]


def squad_sets(reps, chars):
    """reps sets of consecutive SQuAD paragraphs of about `chars` characters each, none shared,
    with an answerable question about the set's first paragraph."""
    paras = [json.loads(line) for line in open(SQUAD, encoding="utf-8") if line.strip()]
    qs = {}
    for line in open(QUESTIONS, encoding="utf-8"):
        q = json.loads(line)
        if q.get("answers"):
            qs.setdefault(q["gold_passage_id"], q["question"])
    sets, i = [], 0
    while len(sets) < reps and i < len(paras):
        docs, n = [], 0
        while n < chars and i < len(paras):
            p = paras[i]
            docs.append({"id": "p%d" % i, "title": p.get("title", ""), "text": p["text"]})
            n += len(p["text"])
            i += 1
        pid = paras[i - len(docs)].get("id")
        q = qs.get(pid) or "What is the first paragraph about?"
        sets.append((docs, q))
    if len(sets) < reps:
        raise RuntimeError("not enough SQuAD paragraphs for %d sets" % reps)
    return sets


# the per-answer signals after the answer, each timed against a daemon with none
# each signal: the daemon settings that turn it on, and its key in the reply's grounding
AFTER_ANSWER = {"self-check": ({"grounding_self_check": 1, "grounding_calibration": "none"},
                               "self_check"),
                "context reliance": ({"grounding_reliance": 1, "grounding_calibration": "none"},
                                     "context_reliance"),
                "hidden-state probe": ({"grounding_calibration": "auto"}, "hidden_probe")}


def after_answer_cost(reps, threads, depth, max_tokens):
    """Request time of a daemon with each after-answer signal on, against one with none, the
    same queries sent to each in a rotating order."""
    from daemon_util import Daemon, query
    sets = squad_sets(reps, 4 * depth)   # about 4 characters a token in these paragraphs
    common = dict(workers=1, threads=threads, log_level="warn", max_context_tokens=2 * depth)
    names = ["off"] + list(AFTER_ANSWER)
    t = {n: [] for n in names}
    prompt_tokens = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        daemons = {}
        for i, n in enumerate(names):
            d = pathlib.Path(tmp) / ("d%d" % i)
            d.mkdir()
            keys = AFTER_ANSWER[n][0] if n != "off" else {"grounding_calibration": "none"}
            daemons[n] = stack.enter_context(Daemon(d, QWEN, **keys, **common))
        for k, (docs, q) in enumerate(sets):
            order = names[k % len(names):] + names[:k % len(names)]
            answers = {}
            for n in order:
                msg = query(q, docs=docs, max_tokens=max_tokens, temperature=0,
                            max_context_tokens=depth)
                t0 = time.time()
                _, r = daemons[n].client().call(msg, timeout=900)
                if not r.get("ok"):
                    raise RuntimeError("query failed: %s" % r)
                t[n].append(1000 * (time.time() - t0))
                answers[n] = r
            for n in AFTER_ANSWER:
                if answers[n]["answer"] != answers["off"]["answer"]:
                    raise RuntimeError("the %s changed an answer" % n)
                if answers[n]["grounding"][AFTER_ANSWER[n][1]] is None:
                    raise RuntimeError("the %s did not run" % n)
            prompt_tokens.append(answers["off"]["usage"]["prompt_tokens"])
    print(f"after-answer signals: request ms, each on vs none, median of {reps} rounds in "
          f"rotating order, {threads} threads, prompts of {min(prompt_tokens)}-"
          f"{max(prompt_tokens)} tokens, at most {max_tokens} answer tokens, the default model")
    mo = statistics.median(t["off"])
    worst = 0.0
    for n in AFTER_ANSWER:
        mn = statistics.median(t[n])
        cost = mn / mo - 1
        worst = max(worst, cost)
        print(f"{AFTER_ANSWER[n][1]} off_ms={mo:.0f} on_ms={mn:.0f} extra_ms={mn - mo:.0f} "
              f"cost_pct={100 * cost:.1f}")
    print(f"target: each costs <= 10% of a request at {depth} tokens: worst {100 * worst:.1f}% "
          f"-> {'met' if worst <= 0.10 else 'NOT met'}")


def quote_cost(reps, threads, depth, max_tokens):
    """What quote decoding adds to a request: two daemons, one answering in free text and one
    quoting (answer_mode = quote), asked the same queries in a rotating order. A quoted
    answer is other text of another length, so besides the request times this compares what
    the mechanism adds: the prefill (which includes building the documents' index) and the
    time of each answer token (the constraint's pass over the vocabulary), and prices a
    quoted request at the free answer's length."""
    from daemon_util import Daemon, query
    sets = squad_sets(reps, 4 * depth)
    common = dict(workers=1, threads=threads, log_level="warn", max_context_tokens=2 * depth,
                  grounding_calibration="none")
    fig = {m: {"req": [], "prefill": [], "tok": [], "n": []} for m in ("free", "quote")}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        daemons = {}
        for m in fig:
            d = pathlib.Path(tmp) / m
            d.mkdir()
            daemons[m] = stack.enter_context(Daemon(d, QWEN, answer_mode=m, **common))
        for k, (docs, q) in enumerate(sets):
            for m in (("free", "quote") if k % 2 == 0 else ("quote", "free")):
                msg = query(q, docs=docs, max_tokens=max_tokens, temperature=0,
                            max_context_tokens=depth)
                t0 = time.time()
                _, r = daemons[m].client().call(msg, timeout=900)
                if not r.get("ok") or r["answer_mode"] != m:
                    raise RuntimeError("query failed: %s" % r)
                n = r["usage"]["completion_tokens"]
                fig[m]["req"].append(1000 * (time.time() - t0))
                fig[m]["prefill"].append(r["timings"]["prefill_ms"])
                fig[m]["tok"].append(r["timings"]["decode_ms"] / max(n - 1, 1))
                fig[m]["n"].append(n)
    med = {m: {k: statistics.median(v) for k, v in f.items()} for m, f in fig.items()}
    f, qt = med["free"], med["quote"]
    at_free_len = (qt["prefill"] + qt["tok"] * f["n"]) / (f["prefill"] + f["tok"] * f["n"]) - 1
    print(f"quote decoding: medians of {reps} queries of about {depth} tokens, {threads} "
          f"threads, the default model, at most {max_tokens} answer tokens")
    for m in ("free", "quote"):
        print(f"{m} request_ms={med[m]['req']:.0f} prefill_ms={med[m]['prefill']:.0f} "
              f"ms_per_token={med[m]['tok']:.1f} answer_tokens={med[m]['n']:.0f}")
    print(f"quote at the free answer's length: cost_pct={100 * at_free_len:.1f} "
          f"(prefill {qt['prefill'] - f['prefill']:+.0f} ms, {qt['tok'] - f['tok']:+.2f} ms a "
          f"token); whole requests {100 * (qt['req'] / f['req'] - 1):+.1f}%")
    print(f"target: <= 10% of a request at {depth} tokens -> "
          f"{'met' if at_free_len <= 0.10 else 'NOT met'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depths", default="2048,8192")
    ap.add_argument("--gen", type=int, default=48, help="tokens decoded per run")
    ap.add_argument("--check-depth", type=int, default=4096,
                    help="document tokens of the self-check's queries")
    ap.add_argument("--check-reps", type=int, default=5)
    ap.add_argument("--only", choices=["masses", "after-answer", "quote"], help="one part only")
    a = ap.parse_args()
    if a.only in (None, "quote"):
        quote_cost(a.check_reps, a.threads, a.check_depth, a.gen)
    if a.only == "quote":
        return
    if a.only != "masses":
        after_answer_cost(a.check_reps, a.threads, a.check_depth, a.gen)
    if a.only == "after-answer":
        return
    depths = [int(d) for d in a.depths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        ids = tokens(max(depths), tmp)
        print(f"grounding signals: decode tokens/s, off vs on (--watch auto), median of "
              f"{a.reps} interleaved runs, {a.threads} threads, {a.gen} tokens per run")
        worst = 0.0
        for d in depths:
            path = pathlib.Path(tmp) / f"ids{d}.txt"
            # a prompt that ends mid-text would let the model stop at once: end on a question
            path.write_text(" ".join(ids[:d]))
            off, on = [], []
            for _ in range(a.reps):
                off.append(decode_rate(path, d, a.gen, a.threads, False))
                on.append(decode_rate(path, d, a.gen, a.threads, True))
            mo, mn = statistics.median(off), statistics.median(on)
            cost = 1 - mn / mo
            worst = max(worst, cost)
            print(f"depth={d} off_tok_s={mo:.1f} on_tok_s={mn:.1f} ratio_on_off={mn / mo:.3f} "
                  f"cost_pct={100 * cost:.1f}")
        print(f"target: signals cost <= 5% of decode time: worst {100 * worst:.1f}% -> "
              f"{'met' if worst <= 0.05 else 'NOT met'}")


if __name__ == "__main__":
    main()
