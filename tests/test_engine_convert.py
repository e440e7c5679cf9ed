"""The DIFF V2 conversion (tools/convert-llama-to-diffv2) computes the same function: for tiny
random qwen2 models in every K-quant type, the float64 reference's logits agree to 1e-12
relative (attn_output doubled exactly, the q bias split with the q rows); for the default llama
model, logits within 1e-4 relative and the same 32-token greedy continuation; for
the Qwen model (qwen2: q, k and v biases, neox RoPE, Q5_0/Q8_0/Q4_K/Q6_K tensors), logits within
1e-4 relative on 300 tokens of real text (the start of tests/data/qwen-oracle.json's SQuAD
passages) and the same 8-token greedy continuation."""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from engine_util import gen_tiny, last_logits, rel_err, run
from ref.ref_forward import load, logits

QWEN = ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
QWEN_TOKENS = 300


def convert(src, dst):
    subprocess.run([sys.executable, str(ROOT / "tools" / "convert-llama-to-diffv2"),
                    str(src), str(dst)], check=True, capture_output=True)
    return dst


@pytest.fixture(scope="module")
def diffv2_model(default_model, tmp_path_factory):
    return convert(default_model, tmp_path_factory.mktemp("conv") / "smollm2-diffv2.gguf")


@pytest.fixture(scope="module")
def qwen_diffv2(tmp_path_factory):
    if not QWEN.exists():
        pytest.fail(f"Qwen model missing: run `make model` ({QWEN})")
    out = convert(QWEN, tmp_path_factory.mktemp("conv-qwen") / "qwen-diffv2.gguf")
    yield out
    out.unlink()  # half a gigabyte


@pytest.mark.parametrize("dtype", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"])
def test_qwen2_tiny_conversion_exact(dtype, tmp_path):
    # every matrix in the K type, attn_output included (its d and dmin are what doubles)
    src = gen_tiny(tmp_path / "qwen2.gguf", "--arch", "qwen2", "--dtype", dtype, "--dim", "256",
                   "--ffn", "512", "--heads", "4", "--kv-heads", "2", "--untied", "--seed", "4")
    a, b = load(src), load(convert(src, tmp_path / "diffv2.gguf"))
    assert (b.arch, b.n_head, b.n_q, b.n_kv, b.rope_layout) == ("diffv2", 4, 8, 2, "neox")
    for n in range(a.n_layer):
        p = f"blk.{n}."
        assert np.array_equal(b.w[p + "attn_output.weight"], 2 * a.w[p + "attn_output.weight"])
        bq = a.w[p + "attn_q.bias"].reshape(4, a.hd)
        assert np.array_equal(b.w[p + "attn_q.bias"].reshape(8, a.hd)[0::2], bq)
        assert np.array_equal(b.w[p + "attn_q.bias"].reshape(8, a.hd)[1::2], bq)
        for t in ("attn_k.bias", "attn_v.bias"):
            assert np.array_equal(b.w[p + t], a.w[p + t])
    toks = [1, 17, 300, 45, 45, 9, 260, 2, 88, 140, 33, 500]
    err = rel_err(logits(b, toks), logits(a, toks))
    print(f"qwen2 {dtype} -> diffv2: reference logits max rel diff {err:.3e}")
    assert err < 1e-12


def test_diffv2_conversion_equivalent(default_model, diffv2_model, tmp_path):
    prompt = ("The Normans were the people who in the 10th and 11th centuries gave their name "
              "to Normandy, a region in France. They were descended from")
    r = run(default_model, "--print-tokens", "-n", 0, "-p", prompt)
    line = [l for l in r.stderr.decode().splitlines() if l.startswith("tokens:")][0]
    tokens = [int(t) for t in line.split()[1:]]
    for kv in ("f32", "f16"):
        a = last_logits(default_model, tokens, tmp_path, "--kv", kv, "--chunk", 16, name="a.bin")
        b = last_logits(diffv2_model, tokens, tmp_path, "--kv", kv, "--chunk", 16, name="b.bin")
        err = rel_err(b, a)
        print(f"kv={kv}: llama vs diffv2 max rel diff {err:.3e}")
        assert err <= 1e-4
    ca = run(default_model, "-n", 32, "-p", prompt).stdout
    cb = run(diffv2_model, "-n", 32, "-p", prompt).stdout
    print("llama :", ca.decode(errors="replace").strip())
    print("diffv2:", cb.decode(errors="replace").strip())
    assert ca == cb and len(ca.strip()) > 0


def test_qwen2_diffv2_conversion_equivalent(qwen_diffv2, tmp_path):
    record = json.loads((ROOT / "tests" / "data" / "qwen-oracle.json").read_text())
    tokens = record["tokens"][:QWEN_TOKENS]
    for kv, chunk in (("f32", 64), ("f16", 512)):
        a = last_logits(QWEN, tokens, tmp_path, "--kv", kv, "--chunk", chunk, name="a.bin")
        b = last_logits(qwen_diffv2, tokens, tmp_path, "--kv", kv, "--chunk", chunk,
                        name="b.bin")
        err = rel_err(b, a)
        print(f"kv={kv} chunk={chunk}: qwen2 vs its diffv2 max rel diff {err:.3e}")
        assert err <= 1e-4
    ca = run(QWEN, "-n", 8, tokens=tokens[:64]).stdout
    cb = run(qwen_diffv2, "-n", 8, tokens=tokens[:64]).stdout
    print("qwen2 :", ca.decode(errors="replace").strip())
    print("diffv2:", cb.decode(errors="replace").strip())
    assert ca == cb and len(ca.strip()) > 0
