"""Helpers for the engine tests: tiny model generation and running diffrag-run."""
import os
import pathlib
import re
import subprocess
import sys

import numpy as np

from conftest import BUILD, ROOT, asan_built

RUN = BUILD / "diffrag-run"


def sanitized():
    """Whether the diffrag-run under test is built with AddressSanitizer (BUILD=build/asan)."""
    return asan_built(RUN)


def gen_tiny(path, *args):
    """Write a tiny random model with tools/gen-tiny-model and return its path."""
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen-tiny-model"), str(path), *args],
                   check=True, capture_output=True, text=True)
    return pathlib.Path(path)


def run(model, *args, tokens=None, timeout=900, check=True, stdin=None, env=None):
    """Run diffrag-run; returns the CompletedProcess (stdout as bytes)."""
    cmd = [str(RUN), "-m", str(model), *map(str, args)]
    if tokens is not None:
        cmd += ["--tokens", ",".join(map(str, tokens))]
    r = subprocess.run(cmd, capture_output=True, timeout=timeout, input=stdin,
                       env=dict(os.environ, **(env or {})))
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[:8])} ... exited {r.returncode}: "
                             f"{r.stderr.decode(errors='replace')[-2000:]}")
    return r


# The prefill arithmetic the reference comparisons use: f32 products (DIFFRAG_GEMM=native) and
# f32 attention (DIFFRAG_ATTN=f32), which stay within f32 rounding of exact arithmetic; the int8
# products (the default with AVX-512 VNNI or AVX2) round the activations to 8 bits first, and the
# AMX attention (the default where the processor has it) multiplies in bf16: each is checked on
# its own (test_kernels.c, test_qwen_oracle.py).
F32_PRODUCTS = {"DIFFRAG_GEMM": "native", "DIFFRAG_ATTN": "f32"}


def last_logits(model, tokens, tmp_path, *args, name="logits.bin", env=F32_PRODUCTS):
    """Last-position logits of the C engine, float32 array."""
    out = tmp_path / name
    if len(tokens) > 200:
        tf = tmp_path / (name + ".tokens")
        tf.write_text(",".join(map(str, tokens)))
        run(model, "--tokens-file", tf, "--dump-logits", out, "-n", 0, *args, env=env)
    else:
        run(model, "--dump-logits", out, "-n", 0, *args, tokens=tokens, env=env)
    return np.fromfile(out, dtype="<f4")


def run_check_binary(binary, model, gemm=None, timeout=600):
    """Run a C check binary (build/tests/engine_*) on a model; gemm sets DIFFRAG_GEMM (None: the
    default products, whatever the caller's environment says), and "native" (the f32 products)
    also the f32 attention (DIFFRAG_ATTN=f32), the f32 arithmetic of F32_PRODUCTS. Prints its
    stdout, asserts it exited 0 and returns the stdout."""
    env = dict(os.environ)
    env.pop("DIFFRAG_GEMM", None)
    env.pop("DIFFRAG_ATTN", None)
    if gemm:
        env["DIFFRAG_GEMM"] = gemm
    if gemm == "native":
        env["DIFFRAG_ATTN"] = "f32"
    r = subprocess.run([str(binary), str(model)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    print(r.stdout)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def rel_err(a, b):
    """max |a - b| / max |b|: the relative error the tolerances are stated in."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def logfmt(stderr, prefix):
    """Parse the `prefix: k=v ...` line of diffrag-run's stderr into a dict of floats/strs."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    for line in text.splitlines():
        if line.startswith(prefix + ":"):
            out = {}
            for k, v in re.findall(r"(\w+)=(\S+)", line):
                try:
                    out[k] = float(v)
                except ValueError:
                    out[k] = v
            return out
    raise AssertionError(f"no '{prefix}:' line in output:\n{text[-2000:]}")
