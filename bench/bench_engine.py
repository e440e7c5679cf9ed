#!/usr/bin/env python3
"""`make bench-engine`: the engine's speed on the CPU for the small model, in its llama form
and in its DIFF V2 conversion (or, with --model qwen, for Qwen2.5-Coder-0.5B-Instruct Q4_K_M
in its qwen2 form only), against two ceilings measured in the same run on the same threads (an
AVX-512 FMA loop, the physical limit, and a large OpenBLAS sgemm).

Prints, per form: prefill tokens/s at 512, 2,048, 8,192 and 32,768 tokens (the last a single
run), decode tokens/s at depth 0 and 8,192, peak resident memory, and the achieved GFLOP/s of
the prefill (matrix products + attention, counted from the model's shape) with the share of
each ceiling; then, for the small model, the issue's targets with llama.cpp's figures (for
the Qwen model, bench/bench_llamacpp.py --models qwen measures llama.cpp in the same run).
Figures are medians of --reps runs, the forms interleaved so both see the same machine state.
Writes nothing.
Method and latest figures: docs/performance.md."""
import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = ROOT / os.environ.get("BUILD", "build")
RUN = BUILD / "diffrag-run"
BENCH = BUILD / "bench_kernels"
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN = ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
sys.path.insert(0, str(ROOT / "tools"))
import squad_data  # noqa: E402

# SQuAD 2.0 (dev, CC BY-SA 4.0) paragraphs: the repository's copy (tests/data/squad2/), unpacked
SQUAD = squad_data.squad_dir() / "passages.jsonl"

# llama-bench on the default model's shape, 2 threads, f16 KV cache (issue 7).
LLAMA_CPP = {"prefill_512": 490.0, "prefill_2048": 358.0, "decode_0": 85.0}


def logfmt(text, prefix):
    for line in text.splitlines():
        if line.startswith(prefix + ":"):
            out = {}
            for k, v in re.findall(r"(\w+)=(\S+)", line):
                try:
                    out[k] = float(v)
                except ValueError:
                    out[k] = v
            return out
    raise RuntimeError(f"no '{prefix}:' line in:\n{text[-2000:]}")


def tokens(n_max, tmp, model=MODEL):
    """Token ids of real text (SQuAD passages through the model's tokenizer)."""
    text, total = [], 0
    with open(SQUAD, encoding="utf-8") as f:
        for line in f:
            text.append(json.loads(line)["text"])
            total += len(text[-1])
            if total > 6 * n_max:
                break
    # --ctx 1 makes diffrag-run stop after printing the ids, before any evaluation.
    r = subprocess.run([RUN, "-m", model, "-n", "0", "--ctx", "1", "--print-tokens", "-p", "-"],
                       input="\n\n".join(text), capture_output=True, text=True)
    line = [l for l in r.stderr.splitlines() if l.startswith("tokens:")]
    if not line:
        raise RuntimeError(r.stderr[-2000:])
    ids = line[0].split()[1:]
    if len(ids) < n_max:
        raise RuntimeError(f"only {len(ids)} tokens of text")
    return ids


def engine(model, path, threads, decode=0, kv="f16"):
    r = subprocess.run([BENCH, "engine", "-m", model, "--tokens-file", path, "--threads",
                        str(threads), "--decode", str(decode), "--kv", kv],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return logfmt(r.stdout, "engine")


def peaks(threads, reps, env=None):
    r = subprocess.run([BENCH, "peaks", "--threads", str(threads), "--reps", str(reps)],
                       capture_output=True, text=True, env=env, check=True)
    return logfmt(r.stdout, "peaks")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one run each, no 32,768-token prefill")
    ap.add_argument("--model", choices=("smollm", "qwen"), default="smollm",
                    help="smollm: the small model, llama and DIFF V2 forms; qwen: "
                    "Qwen2.5-Coder-0.5B-Instruct (qwen2 form only)")
    a = ap.parse_args()
    qwen = a.model == "qwen"
    reps = 1 if a.quick else a.reps
    sizes = (512, 2048, 8192) + (() if a.quick else (32768,))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        if qwen:
            forms = (("qwen2", QWEN),)
        else:
            diff = tmp / "diffv2.gguf"
            subprocess.run([sys.executable, ROOT / "tools" / "convert-llama-to-diffv2", MODEL,
                            diff], check=True, capture_output=True)
            forms = (("llama", MODEL), ("diffv2", diff))
        ids = tokens(max(sizes), tmp, forms[0][1])
        files = {}
        for n in sizes:
            files[n] = tmp / f"p{n}.tokens"
            files[n].write_text(",".join(ids[:n]))
        files[0] = tmp / "p0.tokens"
        files[0].write_text(",".join(ids[:1]))

        ceil = {"fma": [], "sgemm": []}
        res = {name: {} for name, _ in forms}
        for rep in range(reps):
            p = peaks(a.threads, 3)
            ceil["fma"].append(p["fma_gflops"])
            ceil["sgemm"].append(p["sgemm_gflops"])
            for name, model in forms:
                r = res[name]
                for n in sizes:
                    if n == 32768 and rep > 0:
                        continue
                    e = engine(model, files[n], a.threads, decode=64 if n == 8192 else 0)
                    r.setdefault(f"prefill_{n}", []).append(e["prefill_tok_s"])
                    r.setdefault(f"gflops_{n}", []).append(e["prefill_gflops"])
                    r.setdefault(f"matmul_gflops_{n}", []).append(e["matmul_gflops"])
                    r.setdefault(f"attention_gflops_{n}", []).append(e["attention_gflops"])
                    r.setdefault(f"rss_{n}", []).append(e["peak_rss_mb"])
                    if n == 8192:
                        r.setdefault("decode_8192", []).append(e["decode_tok_s"])
                e = engine(model, files[0], a.threads, decode=128)
                r.setdefault("decode_0", []).append(e["decode_tok_s"])
                # The same two decodes with the int8 KV cache (--kv q8).
                e = engine(model, files[8192], a.threads, decode=64, kv="q8")
                r.setdefault("q8_prefill_8192", []).append(e["prefill_tok_s"])
                r.setdefault("q8_decode_8192", []).append(e["decode_tok_s"])
                e = engine(model, files[0], a.threads, decode=128, kv="q8")
                r.setdefault("q8_decode_0", []).append(e["decode_tok_s"])
        coretype = os.environ.get("OPENBLAS_CORETYPE")
        haswell = None
        if coretype != "Haswell":
            env = dict(os.environ, OPENBLAS_CORETYPE="Haswell")
            haswell = statistics.median(peaks(a.threads, 3, env)["sgemm_gflops"] for _ in range(reps))

    med = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in res.items()}
    fma, sgemm = statistics.median(ceil["fma"]), statistics.median(ceil["sgemm"])
    print(f"engine benchmark: {forms[0][1].name}, {a.threads} threads, median of {reps} run(s) "
          f"(32,768 tokens: one run)")
    print(f"ceilings in this run: AVX-512 FMA loop {fma:.1f} GFLOP/s; OpenBLAS sgemm 2048^3 "
          f"{sgemm:.1f} GFLOP/s (OPENBLAS_CORETYPE={coretype or 'unset'})"
          + (f"; with OPENBLAS_CORETYPE=Haswell {haswell:.1f}" if haswell else ""))
    hdr = f"{'form':7} {'tokens':>6} {'prefill tok/s':>13} {'GFLOP/s':>8} {'of FMA':>7} " \
          f"{'products':>9} {'of sgemm':>9} {'attention':>10} {'peak RSS MiB':>13}"
    print(hdr)
    for name, m in med.items():
        for n in sizes:
            print(f"{name:7} {n:6d} {m[f'prefill_{n}']:13.1f} {m[f'gflops_{n}']:8.1f} "
                  f"{100 * m[f'gflops_{n}'] / fma:6.0f}% {m[f'matmul_gflops_{n}']:9.1f} "
                  f"{100 * m[f'matmul_gflops_{n}'] / sgemm:8.0f}% "
                  f"{m[f'attention_gflops_{n}']:10.1f} {m[f'rss_{n}']:13.1f}")
    print(f"{'form':7} {'KV':>3} {'decode tok/s @0':>16} {'@8192':>8} {'ratio':>6} "
          f"{'prefill tok/s @8192':>20}")
    for name, m in med.items():
        for kv, pre in (("f16", ""), ("q8", "q8_")):
            print(f"{name:7} {kv:>3} {m[pre + 'decode_0']:16.1f} {m[pre + 'decode_8192']:8.1f} "
                  f"{m[pre + 'decode_0'] / m[pre + 'decode_8192']:5.2f}x "
                  f"{m[pre + 'prefill_8192']:20.1f}")
    share = min(m[f"matmul_gflops_{n}"] for m in med.values() for n in sizes) / sgemm
    if qwen:
        print(f"prefill products: lowest {100 * share:.0f}% of the in-run sgemm; llama.cpp on "
              f"this model: bench/bench_llamacpp.py --models qwen")
        return
    L, D = med["llama"], med["diffv2"]

    def verdict(ok):
        return "met" if ok else "NOT met"
    print("targets (llama.cpp: prefill 490 tok/s at 512, 358 at 2,048; decode 85 tok/s):")
    print(f"  llama prefill@512 >= 1.0x: {L['prefill_512'] / LLAMA_CPP['prefill_512']:.2f}x "
          f"{verdict(L['prefill_512'] >= LLAMA_CPP['prefill_512'])}")
    for n in sizes[1:]:
        print(f"  llama prefill@{n} >= 1.2x of 358: {L[f'prefill_{n}'] / LLAMA_CPP['prefill_2048']:.2f}x "
              f"{verdict(L[f'prefill_{n}'] >= 1.2 * LLAMA_CPP['prefill_2048'])}")
    print(f"  diffv2 prefill@2048 >= 358: {D['prefill_2048']:.1f} "
          f"{verdict(D['prefill_2048'] >= LLAMA_CPP['prefill_2048'])}")
    print(f"  decode@0 >= 85: llama {L['decode_0']:.1f} {verdict(L['decode_0'] >= 85)}, "
          f"diffv2 {D['decode_0']:.1f} {verdict(D['decode_0'] >= 85)}")
    for name, m in (("llama", L), ("diffv2", D)):
        for kv, pre in (("f16", ""), ("q8", "q8_")):
            print(f"  {name} decode@8192 no more than 2x slower, {kv} KV cache: "
                  f"{m[pre + 'decode_0'] / m[pre + 'decode_8192']:.2f}x "
                  f"{verdict(m[pre + 'decode_8192'] * 2 >= m[pre + 'decode_0'])}")
    print(f"  prefill products >= 70% of the in-run sgemm: lowest {100 * share:.0f}% "
          f"{verdict(share >= 0.7)}")


if __name__ == "__main__":
    main()
