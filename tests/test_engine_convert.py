"""The DIFF V2 conversion of the default model (tools/convert-llama-to-diffv2) computes the
same function: logits within 1e-4 relative and the same 32-token greedy continuation."""
import subprocess
import sys

import pytest

from conftest import ROOT
from engine_util import last_logits, rel_err, run


@pytest.fixture(scope="module")
def diffv2_model(default_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "smollm2-diffv2.gguf"
    subprocess.run([sys.executable, str(ROOT / "tools" / "convert-llama-to-diffv2"),
                    str(default_model), str(out)], check=True, capture_output=True)
    return out


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
