"""The DIFF V2 conversion (tools/convert-llama-to-diffv2) computes the same function: for the
default llama model, logits within 1e-4 relative and the same 32-token greedy continuation; for
the Qwen model (qwen2: q, k and v biases, neox RoPE, Q5_0/Q8_0/Q4_K/Q6_K tensors), logits within
1e-4 relative on 300 tokens of real text (the start of tests/data/qwen-oracle.json's SQuAD
passages) and the same 8-token greedy continuation."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT
from engine_util import last_logits, rel_err, run

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
