#!/usr/bin/env python3
"""`make bench-grounding`: what the groundedness signals cost. Decodes the default model after
prompts of real text (SQuAD passages) with the attention-mass measurement off and on (the
daemon's default watch set: every head of two layers, `--watch auto`), the two variants
interleaved run by run so both see the same machine state, and prints the median decode
tokens/s of each and their ratio. The target (issue 5): the signals cost at most 5% of decode
time. Writes nothing."""
import argparse
import pathlib
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_engine import MODEL, RUN, logfmt, tokens  # noqa: E402


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depths", default="2048,8192")
    ap.add_argument("--gen", type=int, default=48, help="tokens decoded per run")
    a = ap.parse_args()
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
