"""The engine's products on quantised and bf16 weights, end to end: tiny random models of both
architectures in every weight type the CPU backend handles (Q4_0, Q4_1, Q8_0 in the
interleaved layout, Q5_0, Q5_1, BF16 in rows) against the float64 NumPy reference, which
dequantises the file exactly (1e-4 relative, as test_engine_ref); prefill in one chunk and
token by token (the one-token kernels); and one model through every instruction-set path the
machine supports (DIFFRAG_CPU_ISA) and both prefill product engines (DIFFRAG_GEMM). The
K-quants (Q2_K .. Q6_K, row layout, 256-wide super-blocks) and Q5_0 (interleaved) run through
every path too, prefill and one token at a time. All of these run the f32 attention
(DIFFRAG_ATTN=f32); the AMX attention, the default where the processor has it, is checked in a
whole model on its own."""
import functools
import os
import re
import subprocess

import numpy as np
import pytest

from conftest import BUILD
from engine_util import F32_PRODUCTS, RUN, gen_tiny, rel_err
from ref.ref_forward import load, logits

DTYPES = ["q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "bf16"]


def c_logits(model, tokens, tmp_path, *args, env=F32_PRODUCTS):
    out = tmp_path / "logits.bin"
    cmd = [str(RUN), "-m", str(model), "--dump-logits", str(out), "-n", "0", "--kv", "f32",
           "--tokens", ",".join(map(str, tokens)), *map(str, args)]
    # The f32 attention unless the caller names one: the AMX path multiplies in bf16 and is
    # checked on its own (test_amx_attention_end_to_end).
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, **{"DIFFRAG_ATTN": "f32", **env}))
    assert r.returncode == 0, r.stderr[-2000:]
    return np.fromfile(out, dtype="<f4")


@functools.lru_cache(maxsize=None)
def kernel_report():
    """What build/tests/test_kernels prints about this machine (run once per session)."""
    r = subprocess.run([str(BUILD / "tests" / "test_kernels")], capture_output=True, text=True,
                       timeout=600)
    return r.stdout


def supported_paths():
    out = kernel_report()
    m = re.search(r"paths supported here: ([a-z0-9 ]+) \(", out)
    assert m, out[-2000:]
    return m.group(1).split()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "diffv2"])
def test_quantised_model_matches_reference(dtype, arch, tmp_path):
    model = gen_tiny(tmp_path / "m.gguf", "--arch", arch, "--dtype", dtype, "--heads", "4",
                     "--kv-heads", "2", "--dim", "64", "--ffn", "96", "--seed", "3")
    ref = load(model)
    tokens = np.random.default_rng(1).integers(0, ref.vocab, size=40).tolist()
    want = logits(ref, tokens)[-1]
    for chunk in (40, 1):
        err = rel_err(c_logits(model, tokens, tmp_path, "--chunk", chunk, "--threads", 2), want)
        print(f"{arch} {dtype} chunk={chunk}: max rel diff {err:.3e}")
        assert err <= 1e-4, f"{arch} {dtype} chunk {chunk}: relative error {err:.3e}"


def test_every_path_matches_reference(tmp_path):
    model = gen_tiny(tmp_path / "m.gguf", "--arch", "diffv2", "--dtype", "q4_1", "--heads", "4",
                     "--kv-heads", "2", "--dim", "64", "--ffn", "96", "--seed", "5")
    ref = load(model)
    tokens = np.random.default_rng(2).integers(0, ref.vocab, size=40).tolist()
    want = logits(ref, tokens)[-1]
    paths = supported_paths()
    assert "scalar" in paths
    for isa in paths:
        for gemm in ("native", "openblas"):
            for chunk in (40, 3):
                got = c_logits(model, tokens, tmp_path, "--chunk", chunk, "--threads", 3,
                               env={"DIFFRAG_CPU_ISA": isa, "DIFFRAG_GEMM": gemm})
                err = rel_err(got, want)
                print(f"{isa}/{gemm} chunk={chunk}: max rel diff {err:.3e}")
                assert err <= 1e-4, f"{isa}/{gemm} chunk {chunk}: relative error {err:.3e}"


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k",
                                   "q5_k", "q6_k"])
def test_int8_products_end_to_end(dtype, tmp_path):
    """The int8 prefill products (AVX-512 VNNI or AVX2) in a whole model: against the exact reference
    within the activations' 8-bit rounding (their kernels are checked exactly in
    test_kernels.c), the same top token, and exactly what DIFFRAG_GEMM=q8 asks for where the
    processor has them, the f32 products where it has not."""
    k_type = dtype.endswith("_k")
    shape = (["--dim", "256", "--ffn", "512", "--untied"] if k_type else
             ["--dim", "64", "--ffn", "96"])
    model = gen_tiny(tmp_path / "m.gguf", "--arch", "qwen2", "--dtype", dtype, "--heads", "4",
                     "--kv-heads", "2", *shape, "--seed", "13")
    ref = load(model)
    tokens = np.random.default_rng(6).integers(0, ref.vocab, size=48).tolist()
    want = logits(ref, tokens)[-1]
    int8 = "int8 (q8) runs checked" in kernel_report()
    got = c_logits(model, tokens, tmp_path, "--chunk", 48, "--threads", 2,
                   env={"DIFFRAG_GEMM": "q8"})
    f32 = c_logits(model, tokens, tmp_path, "--chunk", 48, "--threads", 2)
    err, err32 = rel_err(got, want), rel_err(f32, want)
    print(f"{dtype}: int8 products {err:.3e}, f32 products {err32:.3e} (int8 path here: {int8})")
    assert np.argmax(got) == np.argmax(want)
    if not int8:
        assert np.array_equal(got, f32)
        return
    # 8-bit activations: about 1/254 of each block's largest value per element.
    assert 1e-5 < err <= 3e-2, f"{dtype}: int8 products off the reference by {err:.3e}"


K_DTYPES = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q5_0"]


@pytest.mark.parametrize("dtype", K_DTYPES)
def test_k_quant_model_every_path(dtype, tmp_path):
    model = gen_tiny(tmp_path / "m.gguf", "--arch", "qwen2", "--dtype", dtype, "--dim", "256",
                     "--ffn", "512", "--heads", "4", "--kv-heads", "2", "--untied", "--seed", "11")
    ref = load(model)
    tokens = np.random.default_rng(4).integers(0, ref.vocab, size=24).tolist()
    want = logits(ref, tokens)[-1]
    for isa in supported_paths():
        for chunk in (24, 1):
            got = c_logits(model, tokens, tmp_path, "--chunk", chunk, "--threads", 2,
                           env={"DIFFRAG_CPU_ISA": isa, "DIFFRAG_GEMM": "native"})
            err = rel_err(got, want)
            print(f"{dtype} {isa} chunk={chunk}: max rel diff {err:.3e}")
            assert err <= 1e-4, f"{dtype} {isa} chunk {chunk}: relative error {err:.3e}"


def test_amx_attention_end_to_end(tmp_path):
    """The default attention (the AMX tile path where the processor has it: bf16 products,
    kernels/cpu/attention_amx.c) in a whole model with 64-wide heads, prefill in one chunk, in
    chunks and token by token: against the exact reference within the bf16 rounding of the
    probabilities and values (2e-2 relative; the kernel is checked to 4e-3 in test_kernels.c),
    the same top token, and the same logits whatever the chunking (each row's arithmetic is
    that of any chunk's, which keeps the prefix cache exact). Where the processor has no AMX the
    default is the f32 path, and the test says so and holds it to the f32 bound."""
    model = gen_tiny(tmp_path / "m.gguf", "--arch", "qwen2", "--dtype", "q8_0", "--dim", "256",
                     "--ffn", "512", "--heads", "4", "--kv-heads", "2", "--untied", "--seed", "17")
    ref = load(model)
    tokens = np.random.default_rng(8).integers(0, ref.vocab, size=150).tolist()
    want = logits(ref, tokens)[-1]
    amx = "AMX bf16 path)" in kernel_report()
    print("AMX attention here" if amx else "no AMX here: the default attention is the f32 path")
    got = {}
    for chunk in (150, 64, 7):
        got[chunk] = c_logits(model, tokens, tmp_path, "--chunk", chunk, "--threads", 2,
                              env={"DIFFRAG_ATTN": "", "DIFFRAG_GEMM": "native"})
        err = rel_err(got[chunk], want)
        print(f"default attention, chunk={chunk}: max rel diff {err:.3e}")
        assert np.argmax(got[chunk]) == np.argmax(want)
        assert err <= (2e-2 if amx else 1e-4), f"chunk {chunk}: relative error {err:.3e}"
    assert np.array_equal(got[150], got[64]) and np.array_equal(got[150], got[7])
