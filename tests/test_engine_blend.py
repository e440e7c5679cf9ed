"""Acceptance of chunk KV reuse (engine_blend, docs/kv-reuse.md): with the recompute share at
1 the question's logits equal a full prefill's with the chunks' stored KV computed elsewhere;
at 0, on a one-chunk prompt, they equal the prefix-cached prefill's; a chunk's KV computed at
position p and moved to q equals the KV computed at q within f16 rounding, for both RoPE
layouts and with YaRN; every KV type; the default and the f32 prefill products; a copy made
after a lead (the chunk's label) is that prompt's own KV; the blend in steps computes what the
blend in one call does, while other sequences step in between.
build/tests/engine_blend does the checks; this runs it per model and product path."""
import pytest

from conftest import BUILD, ROOT, SMALL
from engine_util import gen_tiny, run_check_binary

BIN = BUILD / "tests" / "engine_blend"
SMOL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

FORMS = {
    "llama-adjacent-q4_1": ("--arch", "llama", "--layers", "3", "--dim", "64", "--heads", "4",
                            "--dtype", "q4_1", "--seed", "3"),
    "qwen2-neox-f16": ("--arch", "qwen2", "--layers", "3", "--dim", "64", "--heads", "4",
                       "--kv-heads", "2", "--dtype", "f16", "--seed", "5"),
    "qwen2-neox-yarn": ("--arch", "qwen2", "--layers", "3", "--dim", "64", "--heads", "4",
                        "--kv-heads", "2", "--dtype", "q8_0", "--seed", "6",
                        "--rope-scaling", "yarn", "--rope-factor", "4", "--rope-orig-ctx", "256"),
    "llama-adjacent-yarn": ("--arch", "llama", "--layers", "3", "--dim", "64", "--heads", "4",
                            "--dtype", "q4_1", "--seed", "7", "--rope-scaling", "yarn",
                            "--rope-factor", "8", "--rope-orig-ctx", "128"),
    "diffv2-q8_0": ("--arch", "diffv2", "--layers", "3", "--dim", "64", "--heads", "2",
                    "--kv-heads", "1", "--head-dim", "32", "--dtype", "q8_0", "--seed", "4"),
}


def check(model, gemm):
    out = run_check_binary(BIN, model, gemm)
    assert "0 failed" in out and "chunk KV reuse against full prefills" in out
    for kv in ("f16",) if SMALL else ("f16", "f32"):
        assert f"{kv}: share 1, chunks moved" in out
        assert f"{kv}: KV moved 5 -> 3000" in out
    assert "copies after a lead: share 0, one chunk: with the label as its lead" in out, out
    for store in ("an empty", "a filled"):
        line = f"blend in steps, {store} store, 1-token steps:"
        assert line in out, out
        assert "logits equal the one-call blend's" in out.split(line)[1].split("\n")[0]


@pytest.mark.parametrize("gemm", [None, "native"], ids=["default-products", "f32-products"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_blend_against_full_prefill(tmp_path, form, gemm):
    check(gen_tiny(tmp_path / f"{form}.gguf", *FORMS[form]), gemm)


# DIFFRAG_TEST_SCALE=small: the default model with its default products only (the f32 products
# run on the tiny models above).
@pytest.mark.parametrize("gemm", [None] if SMALL else [None, "native"],
                         ids=["default-products"] if SMALL else ["default-products", "f32-products"])
def test_blend_default_model(gemm):
    if not SMOL.exists():
        pytest.fail(f"{SMOL} is missing: run `make model`")
    check(SMOL, gemm)
