#!/usr/bin/env python3
"""`make bench-llamacpp`: diffrag's CPU engine against llama.cpp's llama-bench on the same GGUF
files, the same thread count and the same prompt lengths, the two run one after the other in
every repetition so both see the same machine.

Models: the small model (Q4_1), random-weight models of its shape in Q8_0 and F16
(tools/gen-tiny-model; llama.cpp's figures in issue 7 were measured on such models), and, with
--models qwen (`make bench-qwen`), Qwen2.5-Coder-0.5B-Instruct Q4_K_M, whose targets are
prefill >= 2.5x llama.cpp at every length and decode >= 1.0x (printed). For each
model and prompt length: llama.cpp's prefill tokens/s without and with flash attention (its
`-fa 0` and `-fa 1`; the better one is the comparison), diffrag's prefill of real text of that
length (`bench_kernels engine`), and the ratio. Then decode tokens/s at depth 0 and 8,192 for
both (llama.cpp: `-n 64 -d DEPTH`, f16 KV cache, the better of -fa 0/1 at each depth; diffrag:
64 greedy steps after a prefill of that depth, f16 and int8 KV caches).

llama-bench comes from bench/build-llama-bench.sh (llama.cpp as vendored by the PyPI sdist of
llama-cpp-python, pinned there) unless --llama-bench names one. Figures are medians of --reps
runs; prompt lengths of --once-from tokens and more (default 32,768) run in the first
repetition only. Writes nothing outside a temporary directory. Method and figures: docs/performance.md."""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = ROOT / os.environ.get("BUILD", "build")
BENCH = BUILD / "bench_kernels"
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN = ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
# The Qwen model's targets (issue 17): diffrag / llama.cpp's better of -fa 0/1.
QWEN_PREFILL_X, QWEN_DECODE_X = 2.5, 1.0
# The long-context prefill targets (issue 53): at least 4.5x at 8,192 tokens, 6x at 32,768.
QWEN_PREFILL_LONG_X = {8192: 4.5, 32768: 6.0}
SHAPE = ["--layers", "30", "--dim", "576", "--heads", "9", "--kv-heads", "3", "--head-dim", "64",
         "--ffn", "1536", "--vocab", "49152", "--ctx", "16384", "--rope-base", "100000", "--tied"]

sys.path.insert(0, str(ROOT / "bench"))
from bench_engine import engine, tokens  # noqa: E402


def llama_bench(exe, model, threads, fa, prompt=0, gen=0, depth=0):
    """tokens/s of one llama-bench test (one repetition)."""
    cmd = [str(exe), "-m", str(model), "-t", str(threads), "-fa", str(fa), "-r", "1",
           "-p", str(prompt), "-n", str(gen), "-d", str(depth), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stderr[-2000:]}")
    rows = [t for t in json.loads(r.stdout) if t["n_prompt"] == prompt and t["n_gen"] == gen]
    if len(rows) != 1:
        raise RuntimeError(f"llama-bench printed {len(rows)} matching tests: {r.stdout[-1000:]}")
    return float(rows[0]["avg_ts"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="512,2048,8192", help="prompt lengths, comma-separated")
    ap.add_argument("--models", default="q4_1,q8_0,f16", help="of q4_1 (the small model), "
                    "q8_0, f16 (random weights of its shape), qwen (Qwen2.5-Coder-0.5B-Instruct "
                    "Q4_K_M)")
    ap.add_argument("--once-from", type=int, default=32768,
                    help="prompt lengths from this one up run in the first repetition only")
    ap.add_argument("--kv", default="f16,q8", help="diffrag's KV caches for decode")
    ap.add_argument("--no-decode", action="store_true", help="prefill only")
    ap.add_argument("--fa", default="0,1", help="llama.cpp's flash-attention settings to run "
                    "(the better one is the comparison)")
    # llama.cpp does not depend on diffrag's build flavour: one build serves every BUILD.
    ap.add_argument("--llama-bench", type=pathlib.Path,
                    default=ROOT / "build" / "llama.cpp" / "bin" / "llama-bench")
    a = ap.parse_args()
    fas = [int(f) for f in a.fa.split(",")]
    sizes = [int(s) for s in a.sizes.split(",")]
    names = a.models.split(",")
    kvs = a.kv.split(",")
    if not a.llama_bench.exists():
        subprocess.run(["sh", str(ROOT / "bench" / "build-llama-bench.sh"),
                        str(a.llama_bench.parent.parent)], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        models = {}
        for name in names:
            if name == "q4_1":
                models[name] = MODEL
            elif name == "qwen":
                models[name] = QWEN
            else:
                models[name] = tmp / f"{name}.gguf"
                subprocess.run([sys.executable, str(ROOT / "tools" / "gen-tiny-model"),
                                str(models[name]), *SHAPE, "--dtype", name, "--seed", "1"],
                               check=True, capture_output=True)
        # Real text through each model's tokenizer (the random models share the small one's).
        files = {}
        for tok in {QWEN if m == QWEN else MODEL for m in models.values()}:
            ids = tokens(max(sizes + [8192]), tmp, tok)
            for n in sorted(set(sizes + [8192, 1])):
                files[tok, n] = tmp / f"{tok.stem}-p{n}.tokens"
                files[tok, n].write_text(",".join(ids[:n]))
        res = {}

        def add(key, v):
            res.setdefault(key, []).append(v)
        for rep in range(a.reps):
            for name, model in models.items():
                tok = QWEN if model == QWEN else MODEL
                for n in sizes:
                    if n >= a.once_from and rep > 0:
                        continue
                    for fa in fas:
                        add((name, "llama.cpp", f"fa{fa}", n), llama_bench(a.llama_bench, model, a.threads, fa, prompt=n))
                    e = engine(model, files[tok, n], a.threads)
                    add((name, "diffrag", "pp", n), e["prefill_tok_s"])
                    # Where diffrag's prefill time went, and each phase's rate as counted
                    # (docs/performance.md sets these against the instructions' peaks).
                    print(f"rep {rep + 1} {name} {n}: llama.cpp " + " / ".join(
                          f"fa={fa} {res[(name, 'llama.cpp', f'fa{fa}', n)][-1]:.1f}" for fa in fas)
                          + f", diffrag {e['prefill_tok_s']:.1f} tok/s (products "
                          f"{e['matmul_s']:.1f} s at {e['matmul_gflops']:.0f} GFLOP/s, attention "
                          f"{e['attention_s']:.1f} s at {e['attention_gflops']:.0f} GFLOP/s, other "
                          f"{e['other_s']:.1f} s)", flush=True)
                if a.no_decode:
                    continue
                for depth in (0, 8192):
                    if depth >= a.once_from and rep > 0:
                        continue
                    for fa in fas:
                        add((name, "llama.cpp", f"tg_fa{fa}", depth),
                            llama_bench(a.llama_bench, model, a.threads, fa, gen=64, depth=depth))
                    for kv in kvs:
                        e = engine(model, files[tok, max(depth, 1)], a.threads, decode=64, kv=kv)
                        add((name, "diffrag", f"tg_{kv}", depth), e["decode_tok_s"])
                    print(f"rep {rep + 1} {name} decode@{depth}: llama.cpp " + " / ".join(
                          f"fa={fa} {res[(name, 'llama.cpp', f'tg_fa{fa}', depth)][-1]:.1f}"
                          for fa in fas) + ", diffrag " + " ".join(f"{kv} {res[(name, 'diffrag', f'tg_{kv}', depth)][-1]:.1f}"
                                     for kv in kvs) + " tok/s", flush=True)

    med = {k: statistics.median(v) for k, v in res.items()}

    def best(name, kind, n):
        return max(med[(name, "llama.cpp", f"{kind}fa{fa}", n)] for fa in fas)
    print(f"\nllama.cpp (llama-bench) against diffrag, {a.threads} threads, median of {a.reps} "
          f"run(s) ({a.once_from:,} tokens and more: one run); tokens/s")
    print(f"{'model':6} {'tokens':>6} " + " ".join(f"{f'llama.cpp fa={fa}':>15}" for fa in fas)
          + f" {'diffrag':>8} {'diffrag / best':>15}")
    for name in models:
        for n in sizes:
            d = med[(name, "diffrag", "pp", n)]
            print(f"{name:6} {n:6d} " + " ".join(
                  f"{med[(name, 'llama.cpp', f'fa{fa}', n)]:15.1f}" for fa in fas)
                  + f" {d:8.1f} {d / best(name, '', n):14.2f}x")
    if not a.no_decode:
        print(f"{'model':6} {'depth':>6} " + " ".join(f"{f'llama.cpp fa={fa}':>15}" for fa in fas)
              + " " + " ".join(f"{'diffrag ' + kv:>12}" for kv in kvs)
              + " " + " ".join(f"{kv + ' / best':>11}" for kv in kvs))
        for name in models:
            for depth in (0, 8192):
                d = [med[(name, "diffrag", f"tg_{kv}", depth)] for kv in kvs]
                print(f"{name:6} {depth:6d} " + " ".join(
                      f"{med[(name, 'llama.cpp', f'tg_fa{fa}', depth)]:15.1f}" for fa in fas)
                      + " " + " ".join(f"{v:12.1f}" for v in d) + " "
                      + " ".join(f"{v / best(name, 'tg_', depth):10.2f}x" for v in d))
    if "qwen" in models:
        print(f"targets for the Qwen model (diffrag / llama.cpp's better of fa={a.fa}):")
        for n in sizes:
            x = med[("qwen", "diffrag", "pp", n)] / best("qwen", "", n)
            want = QWEN_PREFILL_LONG_X.get(n, QWEN_PREFILL_X)
            print(f"  prefill@{n} >= {want}x: {x:.2f}x {'met' if x >= want else 'NOT met'}")
        if not a.no_decode:
            for depth in (0, 8192):
                x = med[("qwen", "diffrag", f"tg_{kvs[0]}", depth)] / best("qwen", "tg_", depth)
                print(f"  decode@{depth} ({kvs[0]} KV cache) >= {QWEN_DECODE_X}x: {x:.2f}x "
                      f"{'met' if x >= QWEN_DECODE_X else 'NOT met'}")


if __name__ == "__main__":
    main()
