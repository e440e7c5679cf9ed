"""The C engine against the float64 NumPy reference (tests/ref/ref_forward.py, written from
docs/model-format.md) on tiny random models of the three architectures: group sizes 1 and > 1,
both RoPE layouts, linear and YaRN scaling, partial rotary dimensions, q/k/v biases (qwen2,
and a diffv2 that carries them), every K-quant type, chunked prefill."""
import sys

import gguf
import numpy as np
import pytest

from conftest import ROOT
from engine_util import gen_tiny, last_logits, rel_err, run
from ref.ref_forward import load, logits

sys.path.insert(0, str(ROOT / "tools"))
import diffrag_gguf as dg  # noqa: E402

CASES = {
    # name: gen-tiny-model arguments
    "llama-g1-adjacent": ["--arch", "llama", "--heads", "4", "--kv-heads", "4"],
    "llama-g2-neox-linear": ["--arch", "llama", "--heads", "4", "--kv-heads", "2",
                             "--rope-layout", "neox", "--rope-scaling", "linear",
                             "--rope-factor", "2", "--untied"],
    "llama-g4-yarn-partial": ["--arch", "llama", "--heads", "4", "--kv-heads", "1",
                              "--rope-scaling", "yarn", "--rope-factor", "4",
                              "--rope-orig-ctx", "64", "--rope-dim", "8"],
    "diffv2-g2-adjacent": ["--arch", "diffv2", "--heads", "4", "--kv-heads", "4"],
    "diffv2-g4-neox-yarn": ["--arch", "diffv2", "--heads", "4", "--kv-heads", "2",
                            "--rope-layout", "neox", "--rope-scaling", "yarn",
                            "--rope-factor", "8", "--rope-orig-ctx", "32"],
    "diffv2-g8-linear-f16": ["--arch", "diffv2", "--heads", "4", "--kv-heads", "1",
                             "--rope-scaling", "linear", "--rope-factor", "4",
                             "--dtype", "f16", "--head-dim", "32"],
    # qwen2: biases on q, k and v; no rope.layout key (its layout is neox)
    "qwen2-g7-f32": ["--arch", "qwen2", "--heads", "7", "--kv-heads", "1", "--dim", "56",
                     "--head-dim", "8", "--untied"],
    "qwen2-g2-q8_0-tied": ["--arch", "qwen2", "--heads", "4", "--kv-heads", "2",
                           "--dtype", "q8_0"],
    "diffv2-g4-bias-neox": ["--arch", "diffv2", "--heads", "4", "--kv-heads", "2",
                            "--qkv-bias", "--rope-layout", "neox"],
}
# K-quant matrices: 256-value super-blocks, so widths are multiples of 256
K_SHAPE = ["--dim", "256", "--ffn", "512", "--heads", "4", "--kv-heads", "2", "--untied"]
K_CASES = {f"qwen2-{t}": ["--arch", "qwen2", "--dtype", t, *K_SHAPE]
           for t in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")}
K_CASES["llama-q4_k"] = ["--arch", "llama", "--dtype", "q4_k", *K_SHAPE]
K_CASES["llama-q6_k-neox"] = ["--arch", "llama", "--dtype", "q6_k", "--rope-layout", "neox",
                              *K_SHAPE]
CASES.update(K_CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_reference(name, tmp_path):
    model = gen_tiny(tmp_path / f"{name}.gguf", *CASES[name], "--seed", str(len(name)))
    rng = np.random.default_rng(7)
    ref = load(model)
    tokens = rng.integers(0, ref.vocab, size=97).tolist()
    want = logits(ref, tokens)[-1]
    worst = 0.0
    for chunk in (97, 16, 5):
        got = last_logits(model, tokens, tmp_path, "--chunk", chunk, "--kv", "f32", "--threads", 2)
        err = rel_err(got, want)
        worst = max(worst, err)
        print(f"{name} chunk={chunk} kv=f32: max rel diff {err:.3e}")
        assert err <= 1e-4, f"{name} chunk {chunk}: relative error {err:.3e}"
    got16 = last_logits(model, tokens, tmp_path, "--chunk", 32, "--kv", "f16")
    err16 = rel_err(got16, want)
    print(f"{name} chunk=32 kv=f16: max rel diff {err16:.3e}")
    # The f16 cache rounds keys and values to 11 significant bits.
    assert err16 <= 5e-3, f"{name} with an f16 KV cache: relative error {err16:.3e}"
    assert np.argmax(got16) == np.argmax(want)
    # The int8 cache keeps each position's key and value to 1/254 of its largest element.
    # Chunks of 32 stage its tiles in f32; chunks of 1 (decode) score keys in integers. Its
    # error grows with the head dimension (the bound is for the 16-wide heads of the small
    # models); the K-quant models' 64-wide heads are there for the weights' decoding.
    if name in K_CASES:
        return
    for chunk in (32, 1):
        got8 = last_logits(model, tokens, tmp_path, "--chunk", chunk, "--kv", "q8")
        err8 = rel_err(got8, want)
        print(f"{name} chunk={chunk} kv=q8: max rel diff {err8:.3e}")
        assert err8 <= 1.5e-2, f"{name} chunk {chunk} with an int8 KV cache: {err8:.3e}"
        assert np.argmax(got8) == np.argmax(want)


def _with_tensors(src, dst, extra):
    """A copy of GGUF src with the (name, f32 array) tensors of extra added."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), dg.field_value(r, "general.architecture"))
    for f in dg.metadata_fields(r):
        if f.name != "general.architecture":
            dg.copy_field(w, f)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, arr in extra:
        w.add_tensor(name, np.asarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("case", ["output-bias", "short-q-bias", "k-bias-only"])
def test_bias_tensors_checked(case, tmp_path):
    """A bias the engine does not apply is refused, one of the wrong length is an error, and a
    lone k bias is applied as the reference applies it."""
    src = gen_tiny(tmp_path / "llama.gguf", "--arch", "llama", "--heads", "4", "--kv-heads", "2")
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 512, size=20).tolist()
    if case == "output-bias":
        bad = _with_tensors(src, tmp_path / "bad.gguf", [("blk.1.attn_output.bias", np.ones(64))])
        r = run(bad, "-n", 0, tokens=tokens, check=False)
        msg = r.stderr.decode(errors="replace")
        assert r.returncode != 0 and "blk.1.attn_output.bias" in msg and "not supported" in msg, msg
    elif case == "short-q-bias":
        bad = _with_tensors(src, tmp_path / "bad.gguf", [("blk.0.attn_q.bias", np.ones(63))])
        r = run(bad, "-n", 0, tokens=tokens, check=False)
        msg = r.stderr.decode(errors="replace")
        assert r.returncode != 0 and "blk.0.attn_q.bias" in msg and "shape" in msg, msg
    else:
        model = _with_tensors(src, tmp_path / "kbias.gguf",
                              [("blk.0.attn_k.bias", rng.standard_normal(32))])
        want = logits(load(model), tokens)[-1]
        got = last_logits(model, tokens, tmp_path, "--kv", "f32")
        err = rel_err(got, want)
        print(f"llama with a k bias in layer 0: max rel diff {err:.3e}")
        assert err <= 1e-4
        assert rel_err(want, logits(load(src), tokens)[-1]) > 1e-3  # the bias matters
