#!/usr/bin/env python3
"""Writes tests/data/qwen-oracle.json: llama.cpp's own evaluation of a fixed text with the
Qwen model, the reference tests/test_qwen_oracle.py holds the engine to.

The text: SQuAD 2.0 (dev, CC BY-SA 4.0) passages in file order, joined by blank lines, long
enough to give --tokens tokens; llama.cpp tokenises it itself (no BOS, no special tokens) and
the record keeps the first --tokens ids. llama.cpp (as vendored by the PyPI sdist of
llama-cpp-python, pinned in bench/build-llama-bench.sh, which builds it when missing) evaluates
them in one context of that many tokens on the CPU, logits at every position, f16 KV cache,
plain attention (no flash attention), batches of 512; bench/llama_oracle.c records per position
the top token, the NLL of the next token and the gap between the two best logits, and the
perplexity. Tests never build llama.cpp: they read the record.

llama.cpp's quantised dot products round the activations to 8 bits (Q8_0 / Q8_K blocks) first,
which moves near-tied logits; so the record also holds, under "f32_weights", llama.cpp's
evaluation of the same weights dequantised to F32 (bench/dequant_gguf.py: the same values,
no activation rounding), the reference for an engine that keeps its activations in f32.

usage: python3 bench/llama_oracle.py [--model M] [--tokens 4096] [--threads 2] [--out PATH]"""
import argparse
import hashlib
import json
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
sys.path.insert(0, str(ROOT / "tools"))
import squad_data  # noqa: E402

# SQuAD 2.0 (dev, CC BY-SA 4.0) paragraphs: the repository's copy (tests/data/squad2/), unpacked
SQUAD = squad_data.squad_dir() / "passages.jsonl"
OUT = ROOT / "tests" / "data" / "qwen-oracle.json"
LIBS = ("src/libllama.a", "ggml/src/libggml.a", "ggml/src/libggml-cpu.a", "ggml/src/libggml-base.a")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def squad_text(n_chars):
    """Passages in file order joined by blank lines until the text passes n_chars."""
    texts, ids = [], []
    with open(SQUAD, encoding="utf-8") as f:
        for line in f:
            p = json.loads(line)
            texts.append(p["text"])
            ids.append(p["id"])
            if sum(map(len, texts)) > n_chars:
                break
    return "\n\n".join(texts), ids


def build_oracle(llama_dir):
    """Compiles bench/llama_oracle.c against llama.cpp's headers and static libraries."""
    version = re.search(r"^VERSION=(\S+)", (ROOT / "bench" / "build-llama-bench.sh").read_text(),
                        re.M).group(1)
    cmake = llama_dir / "cmake"
    if not all((cmake / lib).exists() for lib in LIBS):
        subprocess.run(["sh", str(ROOT / "bench" / "build-llama-bench.sh"), str(llama_dir)], check=True)
    missing = [lib for lib in LIBS if not (cmake / lib).exists()]
    if missing:
        sys.exit(f"llama_oracle: llama.cpp's build in {llama_dir} lacks {', '.join(missing)}")
    src = llama_dir / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    exe = llama_dir / "llama_oracle"
    subprocess.run(["cc", "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror",
                    "-I", str(src / "include"), "-I", str(src / "ggml" / "include"),
                    str(ROOT / "bench" / "llama_oracle.c"), "-o", str(exe),
                    "-Wl,--start-group", *[str(cmake / lib) for lib in LIBS], "-Wl,--end-group",
                    "-lstdc++", "-fopenmp", "-lm", "-lpthread"], check=True)
    sdist = llama_dir / f"llama_cpp_python-{version}.tar.gz"
    return exe, version, sha256(sdist) if sdist.exists() else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=pathlib.Path, default=MODEL)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    ap.add_argument("--llama-dir", type=pathlib.Path, default=ROOT / "build" / "llama.cpp")
    ap.add_argument("--no-f32", action="store_true", help="skip the F32-weights evaluation")
    a = ap.parse_args()
    exe, version, sdist_sha = build_oracle(a.llama_dir)
    text, passage_ids = squad_text(6 * a.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "text.txt"
        path.write_text(text, encoding="utf-8")

        def oracle(model):
            r = subprocess.run([str(exe), str(model), str(path), str(a.tokens), str(a.threads)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"llama_oracle: exit {r.returncode}\n{r.stderr[-2000:]}")
            return json.loads(r.stdout)
        res = oracle(a.model)
        if not a.no_f32:
            f32 = pathlib.Path(tmp) / "f32.gguf"
            subprocess.run([sys.executable, str(ROOT / "bench" / "dequant_gguf.py"), str(a.model),
                            str(f32)], check=True)
            ref = oracle(f32)
            if ref["tokens"] != res["tokens"]:
                sys.exit("llama_oracle: the F32 copy tokenises the text differently")
    head = {
        "made_by": "python3 bench/llama_oracle.py (bench/llama_oracle.c)",
        "llama_cpp": f"llama.cpp as vendored by llama-cpp-python {version} (PyPI sdist"
                     + (f", sha256 {sdist_sha})" if sdist_sha else ")"),
        "system_info": res["system_info"].strip(),
        "settings": {"n_ctx": a.tokens, "threads": a.threads, "batch": 512, "kv_cache": "f16",
                     "flash_attention": False, "device": "CPU"},
        "model": a.model.name,
        "model_sha256": sha256(a.model),
        "text": {"source": "SQuAD 2.0 (dev, CC BY-SA 4.0): squad2/passages.jsonl of the repository's "
                           "evaluation data (tests/data/squad2), passages in file order joined by blank lines",
                 "passages": len(passage_ids), "first_passage": passage_ids[0],
                 "last_passage": passage_ids[-1], "chars": len(text),
                 "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                 "tokenized_by": "llama.cpp (llama_tokenize, no BOS, no special tokens)",
                 "text_tokens": res["n_text_tokens"], "kept_tokens": a.tokens},
        "meaning": "position p: top[p] is llama.cpp's argmax after tokens[0..p], nll[p] the "
                   "negative log-likelihood of tokens[p+1] (natural log), margin[p] the gap "
                   "between the two best logits",
        "n_tokens": res["n_tokens"], "n_vocab": res["n_vocab"],
        "mean_nll": res["mean_nll"], "perplexity": res["perplexity"],
    }
    lines = [f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in head.items()]
    lines += [f"{json.dumps(k)}: {json.dumps(res[k], separators=(',', ':'))}"
              for k in ("tokens", "top", "nll", "margin")]
    if not a.no_f32:
        f32 = {"made_by": "llama.cpp on the same weights dequantised to F32 by "
                          "bench/dequant_gguf.py, the same settings",
               "mean_nll": ref["mean_nll"], "perplexity": ref["perplexity"],
               "top": ref["top"], "nll": ref["nll"], "margin": ref["margin"]}
        lines.append(f'"f32_weights": {json.dumps(f32, separators=(",", ":"))}')
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")
    print(f"llama_oracle: {a.out}: {res['n_tokens']} tokens, perplexity {res['perplexity']:.4f}"
          + ("" if a.no_f32 else f", with F32 weights {ref['perplexity']:.4f}"))


if __name__ == "__main__":
    main()
