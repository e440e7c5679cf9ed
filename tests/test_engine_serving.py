"""Acceptance of the prefix cache (model/kvpool.h): cached and cold prefills of the same prompt
give logits within 1e-5 relative, the same attention masses and the same greedy answer, on and
off page boundaries (63, 64, 65 and 1,000 tokens, and a prompt sharing only its first 700
tokens), for the llama and DIFF V2 forms, every KV type, with the int8 and the f32 prefill
products; and a pool of a few pages evicts, refuses cleanly when every page is in use, and
returns to idle. Batches: 16 sequences of different prompts, their prefills cut into steps
with the others' decode tokens, give every logit bit for bit as each sequence alone, and the
same greedy answers. build/tests/engine_serving does the checks; this runs it per model and
product path."""
import pytest

from conftest import BUILD, ROOT
from engine_util import gen_tiny, run_check_binary

BIN = BUILD / "tests" / "engine_serving"
SMOL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

FORMS = {
    "llama-q4_1": ("--arch", "llama", "--layers", "2", "--dim", "64", "--heads", "4",
                   "--dtype", "q4_1", "--seed", "3"),
    "diffv2-q8_0": ("--arch", "diffv2", "--layers", "2", "--dim", "64", "--heads", "2",
                    "--kv-heads", "1", "--head-dim", "32", "--dtype", "q8_0", "--seed", "4"),
    "qwen2-f16": ("--arch", "qwen2", "--layers", "2", "--dim", "64", "--heads", "4",
                  "--kv-heads", "2", "--dtype", "f16", "--seed", "5"),
}


def check(model, gemm):
    out = run_check_binary(BIN, model, gemm)
    assert "0 failed" in out and "cached and cold prefills" in out
    assert "batched and alone" in out


@pytest.mark.parametrize("gemm", [None, "native"], ids=["default-products", "f32-products"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_cached_equals_cold(tmp_path, form, gemm):
    check(gen_tiny(tmp_path / f"{form}.gguf", *FORMS[form]), gemm)


def test_cached_equals_cold_default_model():
    if not SMOL.exists():
        pytest.fail(f"{SMOL} is missing: run `make model`")
    check(SMOL, None)
