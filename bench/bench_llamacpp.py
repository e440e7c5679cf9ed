#!/usr/bin/env python3
"""`make bench-llamacpp`: diffrag's CPU engine against llama.cpp's llama-bench on the same GGUF
files, the same thread count and the same prompt lengths, the two run one after the other in
every repetition so both see the same machine.

Models: the default model (Q4_1), and random-weight models of its shape in Q8_0 and F16
(tools/gen-tiny-model; llama.cpp's figures in issue 7 were measured on such models). For each
model and prompt length: llama.cpp's prefill tokens/s without and with flash attention (its
`-fa 0` and `-fa 1`; the better one is the comparison), diffrag's prefill of real text of that
length (`bench_kernels engine`), and the ratio. Then decode tokens/s at depth 0 and 8,192 for
both (llama.cpp: `-n 64 -d DEPTH`, f16 KV cache, the better of -fa 0/1 at each depth; diffrag:
64 greedy steps after a prefill of that depth, f16 and int8 KV caches).

llama-bench comes from bench/build-llama-bench.sh (llama.cpp as vendored by the PyPI sdist of
llama-cpp-python, pinned there) unless --llama-bench names one. Figures are medians of --reps
runs. Writes nothing outside a temporary directory. Method and figures: docs/performance.md."""
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
    ap.add_argument("--models", default="q4_1,q8_0,f16", help="of q4_1 (the default model), "
                    "q8_0, f16 (random weights of its shape)")
    ap.add_argument("--no-decode", action="store_true", help="prefill only")
    ap.add_argument("--llama-bench", type=pathlib.Path, default=BUILD / "llama.cpp" / "bin" / "llama-bench")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    names = a.models.split(",")
    if not a.llama_bench.exists():
        subprocess.run(["sh", str(ROOT / "bench" / "build-llama-bench.sh"),
                        str(a.llama_bench.parent.parent)], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        models = {}
        for name in names:
            if name == "q4_1":
                models[name] = MODEL
            else:
                models[name] = tmp / f"{name}.gguf"
                subprocess.run([sys.executable, str(ROOT / "tools" / "gen-tiny-model"),
                                str(models[name]), *SHAPE, "--dtype", name, "--seed", "1"],
                               check=True, capture_output=True)
        ids = tokens(max(sizes + [8192]), tmp)
        files = {}
        for n in sorted(set(sizes + [8192, 1])):
            files[n] = tmp / f"p{n}.tokens"
            files[n].write_text(",".join(ids[:n]))
        res = {}

        def add(key, v):
            res.setdefault(key, []).append(v)
        for rep in range(a.reps):
            for name, model in models.items():
                for n in sizes:
                    for fa in (0, 1):
                        add((name, "llama.cpp", f"fa{fa}", n), llama_bench(a.llama_bench, model, a.threads, fa, prompt=n))
                    add((name, "diffrag", "pp", n), engine(model, files[n], a.threads)["prefill_tok_s"])
                    print(f"rep {rep + 1} {name} {n}: llama.cpp "
                          f"{res[(name, 'llama.cpp', 'fa0', n)][-1]:.1f} / "
                          f"{res[(name, 'llama.cpp', 'fa1', n)][-1]:.1f}, diffrag "
                          f"{res[(name, 'diffrag', 'pp', n)][-1]:.1f} tok/s", flush=True)
                if a.no_decode:
                    continue
                for depth in (0, 8192):
                    for fa in (0, 1):
                        add((name, "llama.cpp", f"tg_fa{fa}", depth),
                            llama_bench(a.llama_bench, model, a.threads, fa, gen=64, depth=depth))
                    for kv in ("f16", "q8"):
                        e = engine(model, files[max(depth, 1)], a.threads, decode=64, kv=kv)
                        add((name, "diffrag", f"tg_{kv}", depth), e["decode_tok_s"])
                    print(f"rep {rep + 1} {name} decode@{depth}: llama.cpp "
                          f"{res[(name, 'llama.cpp', 'tg_fa0', depth)][-1]:.1f} / "
                          f"{res[(name, 'llama.cpp', 'tg_fa1', depth)][-1]:.1f}, diffrag f16 "
                          f"{res[(name, 'diffrag', 'tg_f16', depth)][-1]:.1f} q8 "
                          f"{res[(name, 'diffrag', 'tg_q8', depth)][-1]:.1f} tok/s", flush=True)

    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"\nllama.cpp (llama-bench) against diffrag, {a.threads} threads, median of {a.reps} "
          f"run(s); tokens/s")
    print(f"{'model':6} {'tokens':>6} {'llama.cpp fa=0':>15} {'fa=1':>8} {'diffrag':>8} "
          f"{'diffrag / best':>15}")
    for name in models:
        for n in sizes:
            f0, f1 = med[(name, "llama.cpp", "fa0", n)], med[(name, "llama.cpp", "fa1", n)]
            d = med[(name, "diffrag", "pp", n)]
            print(f"{name:6} {n:6d} {f0:15.1f} {f1:8.1f} {d:8.1f} {d / max(f0, f1):14.2f}x")
    if a.no_decode:
        return
    print(f"{'model':6} {'depth':>6} {'llama.cpp fa=0':>15} {'fa=1':>8} {'diffrag f16':>12} "
          f"{'q8':>8} {'f16 / best':>11}")
    for name in models:
        for depth in (0, 8192):
            f0, f1 = med[(name, "llama.cpp", "tg_fa0", depth)], med[(name, "llama.cpp", "tg_fa1", depth)]
            d16, d8 = med[(name, "diffrag", "tg_f16", depth)], med[(name, "diffrag", "tg_q8", depth)]
            print(f"{name:6} {depth:6d} {f0:15.1f} {f1:8.1f} {d16:12.1f} {d8:8.1f} "
                  f"{d16 / max(f0, f1):10.2f}x")


if __name__ == "__main__":
    main()
