#!/usr/bin/env python3
"""`make bench-engine`: prefill tokens/s at 512 and 2,048 tokens and decode tokens/s of the
default model (llama form and its DIFF V2 conversion), medians of repeated runs in one
process tree so both forms see the same machine state. Prints a table; writes nothing."""
import argparse
import json
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN = ROOT / "build" / "diffrag-run"
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SQUAD = ROOT.parent / "shared" / "data" / "squad2" / "passages.jsonl"


def timings(stderr):
    for line in stderr.splitlines():
        if line.startswith("timings:"):
            return {k: float(v) for k, v in re.findall(r"(\w+)=([-\d.]+)", line)}
    raise RuntimeError(stderr[-2000:])


def prompt_tokens(n, tmp):
    text = []
    with open(SQUAD, encoding="utf-8") as f:
        for line in f:
            text.append(json.loads(line)["text"])
            if sum(map(len, text)) > 6 * n:
                break
    r = subprocess.run([RUN, "-m", MODEL, "-n", "0", "--print-tokens", "-p", "\n\n".join(text)],
                       capture_output=True, text=True, check=True)
    ids = [l for l in r.stderr.splitlines() if l.startswith("tokens:")][0].split()[1:n + 1]
    path = pathlib.Path(tmp) / f"p{n}.tokens"
    path.write_text(",".join(ids))
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        diff = pathlib.Path(tmp) / "diffv2.gguf"
        subprocess.run([sys.executable, ROOT / "tools" / "convert-llama-to-diffv2", MODEL, diff],
                       check=True, capture_output=True)
        prompts = {n: prompt_tokens(n, tmp) for n in (512, 2048)}
        rows = []
        for name, model in (("llama", MODEL), ("diffv2", diff)):
            res = {}
            for rep in range(a.reps):
                for n, path in prompts.items():
                    t = timings(subprocess.run(
                        [RUN, "-m", model, "--tokens-file", path, "-n", "0", "--threads",
                         str(a.threads)], capture_output=True, text=True, check=True).stderr)
                    res.setdefault(f"prefill_{n}", []).append(t["prefill_tok_s"])
                t = timings(subprocess.run(
                    [RUN, "-m", model, "--tokens", "1,504,3458", "-n", "128", "--threads",
                     str(a.threads)], capture_output=True, text=True, check=True).stderr)
                res.setdefault("decode", []).append(t["decode_tok_s"])
                res.setdefault("rss", []).append(t["peak_rss_mb"])
            rows.append((name, {k: statistics.median(v) for k, v in res.items()}))
    print(f"engine benchmark: default model, {a.threads} threads, median of {a.reps} runs")
    print(f"{'form':8} {'prefill@512 tok/s':>18} {'prefill@2048 tok/s':>19} "
          f"{'decode tok/s':>13} {'peak RSS MiB':>13}")
    for name, r in rows:
        print(f"{name:8} {r['prefill_512']:18.1f} {r['prefill_2048']:19.1f} "
              f"{r['decode']:13.1f} {r['rss']:13.1f}")


if __name__ == "__main__":
    main()
