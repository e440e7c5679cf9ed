"""Tests of the model tools (gen-tiny-model, convert-llama-to-diffv2, convert-diffv2-checkpoint)
and of the float64 NumPy reference tests/ref/ref_forward.py; none needs the C engine. The
checkpoint converter is checked against a forward pass written here over PyTorch-layout
weights in the style of the unilm code, which also checks the reference's RoPE variants."""
import contextlib
import importlib.machinery
import importlib.util
import io
import json
import math
import os
import pathlib
import struct
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import gguf
from gguf import GGMLQuantizationType as QT

from ref.ref_forward import load, logits

ROOT_DIR = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT_DIR / "tools"))
import diffrag_gguf as dg  # noqa: E402


_TOOL_MODULES = {}


def run_tool(name, *args, expect_rc=0, in_process=True):
    """Run tools/NAME with args; in-process through its main(argv) unless asked otherwise
    (each tool is also run once as a real executable), which saves an interpreter start."""
    argv = [str(x) for x in args]
    if not in_process:
        p = subprocess.run([str(ROOT_DIR / "tools" / name), *argv], capture_output=True,
                           text=True, timeout=120)
        rc, err = p.returncode, p.stderr
    else:
        mod = _TOOL_MODULES.get(name)
        if mod is None:
            loader = importlib.machinery.SourceFileLoader(
                name.replace("-", "_"), str(ROOT_DIR / "tools" / name))
            mod = importlib.util.module_from_spec(
                importlib.util.spec_from_loader(loader.name, loader))
            loader.exec_module(mod)
            _TOOL_MODULES[name] = mod
        buf = io.StringIO()
        with contextlib.redirect_stderr(buf):
            try:
                rc = mod.main(argv)
            except SystemExit as e:    # argparse usage errors
                rc = e.code
        err = buf.getvalue()
    assert rc == expect_rc, f"{name} {argv}: rc {rc}\n{err}"
    return types.SimpleNamespace(returncode=rc, stderr=err)


def rel_diff(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(a)))


def fields(path):
    r = gguf.GGUFReader(str(path))
    return r, {k: f.contents() for k, f in r.fields.items()}


# ---------------------------------------------------------------------------------------------
# (a) gen-tiny-model

GEN_CASES = {
    "llama-mha": ["--arch", "llama", "--heads", "4", "--kv-heads", "4"],
    "llama-gqa2": ["--arch", "llama", "--heads", "4", "--kv-heads", "2", "--untied"],
    "llama-neox-linear": ["--arch", "llama", "--rope-layout", "neox", "--rope-scaling", "linear",
                          "--rope-factor", "2"],
    "llama-yarn-partial": ["--arch", "llama", "--rope-scaling", "yarn", "--rope-dim", "8",
                           "--dtype", "f16"],
    "diffv2-group1": ["--arch", "diffv2", "--heads", "4", "--kv-heads", "4", "--untied"],
    "diffv2-group2": ["--arch", "diffv2", "--heads", "4", "--kv-heads", "2", "--dtype", "q8_0"],
    "diffv2-mqa-neox-yarn": ["--arch", "diffv2", "--heads", "2", "--kv-heads", "1",
                             "--head-dim", "32", "--rope-layout", "neox", "--rope-scaling", "yarn",
                             "--rope-dim", "16", "--layers", "3"],
    "diffv2-linear-q4_1": ["--arch", "diffv2", "--rope-scaling", "linear", "--dtype", "q4_1",
                           "--vocab", "300"],
}


@pytest.mark.parametrize("case", sorted(GEN_CASES))
def test_gen_tiny_model(tmp_path, case):
    out = tmp_path / f"{case}.gguf"
    run_tool("gen-tiny-model", out, *GEN_CASES[case], "--seed", "3")
    r, kv = fields(out)
    arch = kv["general.architecture"]
    args = GEN_CASES[case]
    assert arch == args[args.index("--arch") + 1]
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "attention.key_length",
                "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
                "rope.layout", "rope.scaling.type"):
        assert f"{arch}.{key}" in kv, key
    if "--rope-layout" in args:
        assert kv[f"{arch}.rope.layout"] == args[args.index("--rope-layout") + 1]
    if "yarn" in args:
        assert kv[f"{arch}.rope.scaling.original_context_length"] > 0
        assert kv[f"{arch}.rope.scaling.factor"] > 1

    # no all-zero tensor, and the sizes the reference derives match the metadata
    for t in r.tensors:
        vals = dg.dequantize(t)
        assert np.any(vals != 0), f"{t.name} is all zero"
        assert np.all(np.isfinite(vals)), t.name
    m = load(out)
    assert m.n_q == (2 if arch == "diffv2" else 1) * m.n_head
    assert m.vocab == kv[f"{arch}.vocab_size"] == len(kv["tokenizer.ggml.tokens"])
    toks = [1, 40, 41, 42, 43, 7, 100, 250]
    out_logits = logits(m, toks)
    assert out_logits.shape == (len(toks), m.vocab)
    spread = out_logits.std(axis=1)
    print(f"{case}: logits std per position min {spread.min():.3f} max {spread.max():.3f}")
    assert np.all(np.isfinite(out_logits)) and spread.min() > 0.1 and spread.max() < 100
    if arch == "diffv2":
        lam = [1 / (1 + np.exp(-(m.w[f"blk.{n}.attn_lambda.weight"] @ np.ones(m.d))))
               for n in range(m.n_layer)]
        assert np.ptp(np.concatenate(lam)) > 0.05, "lambda weights give a constant lambda"


def test_gen_is_deterministic_and_seeded(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    run_tool("gen-tiny-model", a, "--arch", "diffv2", "--seed", "5", in_process=False)
    run_tool("gen-tiny-model", b, "--arch", "diffv2", "--seed", "5")
    run_tool("gen-tiny-model", c, "--arch", "diffv2", "--seed", "6")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_gen_rejects_bad_options(tmp_path):
    p = run_tool("gen-tiny-model", tmp_path / "x.gguf", "--heads", "4", "--kv-heads", "3",
                 expect_rc=2)
    assert "multiple" in p.stderr
    p = run_tool("gen-tiny-model", tmp_path / "x.gguf", "--vocab", "100", expect_rc=1)
    assert "vocab" in p.stderr


def test_tokenizer_is_consistent(tmp_path):
    out = tmp_path / "t.gguf"
    run_tool("gen-tiny-model", out, "--vocab", "512")
    _, kv = fields(out)
    tokens, types, merges = (kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"],
                             kv["tokenizer.ggml.merges"])
    assert len(tokens) == len(types) == 512 and len(set(tokens)) == 512
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and types[:3] == [3] * 3
    assert set(types[3:]) == {1}
    alphabet = dg.byte_to_unicode()
    assert tokens[3:259] == alphabet and len(set(alphabet)) == 256
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "smollm"
    assert kv["tokenizer.ggml.bos_token_id"] == 1 and kv["tokenizer.ggml.eos_token_id"] == 2
    assert kv["tokenizer.ggml.add_bos_token"] is True
    assert "<|im_start|>" in kv["tokenizer.chat_template"]
    index = {t: i for i, t in enumerate(tokens)}
    for mrg in merges:
        left, right = mrg.split(" ")
        assert left in index and right in index and left + right in index, mrg
        assert index[left + right] > max(index[left], index[right]) or left + right in tokens[:259]
    assert len(merges) >= 512 - 259

    # The vocabulary and merges form a working byte-level BPE: encoding round-trips.
    import tokenizers
    bpe = tokenizers.models.BPE(vocab=index, merges=[tuple(x.split(" ")) for x in merges])
    tk = tokenizers.Tokenizer(bpe)
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    text = "The answer is in the third passage, 1998 \u00e9t\u00e9 \u2603."
    ids = tk.encode(text).ids
    print(f"tokenizer: {len(text)} chars -> {len(ids)} tokens")
    assert tk.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8")), "no merge applied"


# ---------------------------------------------------------------------------------------------
# reference properties that need no second implementation

def test_ref_rope_layouts_are_a_permutation(tmp_path):
    """A neox model equals an adjacent one whose q/k rows are permuted within each head."""
    out = tmp_path / "m.gguf"
    run_tool("gen-tiny-model", out, "--arch", "diffv2", "--rope-dim", "8", "--rope-scaling",
             "yarn", "--rope-orig-ctx", "16")
    m = load(out)
    toks = [5, 9, 200, 31, 77, 3, 64, 12, 400, 8]
    base = logits(m, toks)
    half = m.rot // 2
    perm = np.arange(m.hd)
    perm[:half] = np.arange(half) * 2
    perm[half:m.rot] = np.arange(half) * 2 + 1
    for n in range(m.n_layer):
        for t, heads in (("attn_q", m.n_q), ("attn_k", m.n_kv)):
            w = m.w[f"blk.{n}.{t}.weight"].reshape(heads, m.hd, m.d)
            m.w[f"blk.{n}.{t}.weight"] = w[:, perm, :].reshape(heads * m.hd, m.d)
    m.rope_layout = "neox"
    neox = logits(m, toks)
    m.rope_layout = "adjacent"
    wrong = logits(m, toks)
    print(f"layout permutation: rel diff {rel_diff(base, neox):.2e}, "
          f"unpermuted layout {rel_diff(base, wrong):.2e}")
    assert rel_diff(base, neox) < 1e-12
    assert rel_diff(base, wrong) > 1e-3


def test_ref_is_causal(tmp_path):
    out = tmp_path / "m.gguf"
    run_tool("gen-tiny-model", out, "--arch", "diffv2", "--heads", "4", "--kv-heads", "1")
    m = load(out)
    full = logits(m, [3, 4, 5, 6, 7, 8])
    prefix = logits(m, [3, 4, 5])
    assert rel_diff(full[:3], prefix) < 1e-13
    changed = logits(m, [3, 4, 5, 6, 7, 9])
    assert rel_diff(full[:5], changed[:5]) < 1e-13 and rel_diff(full[5:], changed[5:]) > 1e-6


def test_ref_cli(tmp_path):
    model = tmp_path / "m.gguf"
    run_tool("gen-tiny-model", model, "--arch", "diffv2", "--untied")
    p = subprocess.run([sys.executable, str(ROOT_DIR / "tests" / "ref" / "ref_forward.py"),
                        str(model), "--tokens", "5,6,7", "--out", str(tmp_path / "l.npy"),
                        "--last-f32", str(tmp_path / "l.bin")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    want = logits(load(model), [5, 6, 7])
    assert np.array_equal(np.load(tmp_path / "l.npy"), want)
    last = np.fromfile(tmp_path / "l.bin", dtype="<f4")
    assert last.shape == (want.shape[1],) and rel_diff(want[-1], last) < 1e-6
    bad = subprocess.run([sys.executable, str(ROOT_DIR / "tests" / "ref" / "ref_forward.py"),
                          str(model), "--tokens", "5,100000"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 1 and "out of range" in bad.stderr


# ---------------------------------------------------------------------------------------------
# (b) convert-llama-to-diffv2

@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_llama_to_diffv2_tiny(tmp_path, dtype):
    src, dst = tmp_path / "llama.gguf", tmp_path / "diffv2.gguf"
    run_tool("gen-tiny-model", src, "--arch", "llama", "--heads", "4", "--kv-heads", "2",
             "--dtype", dtype, "--rope-scaling", "yarn", "--rope-dim", "8", "--untied")
    run_tool("convert-llama-to-diffv2", src, dst)
    a, b = load(src), load(dst)
    assert b.arch == "diffv2" and b.n_head == a.n_head and b.n_q == 2 * a.n_q
    assert (b.n_kv, b.hd, b.rot, b.scaling, b.factor, b.orig_ctx) == \
        (a.n_kv, a.hd, a.rot, a.scaling, a.factor, a.orig_ctx)
    for n in range(a.n_layer):
        assert np.array_equal(b.w[f"blk.{n}.attn_output.weight"],
                              2 * a.w[f"blk.{n}.attn_output.weight"])
    toks = [1, 17, 300, 45, 45, 9, 260, 2, 88, 140, 33, 500]
    la, lb = logits(a, toks), logits(b, toks)
    d = rel_diff(la, lb)
    print(f"llama->diffv2 {dtype}: max rel logit diff {d:.3e}")
    assert d < 1e-12


def test_llama_to_diffv2_rejects_diffv2(tmp_path):
    src = tmp_path / "d.gguf"
    run_tool("gen-tiny-model", src, "--arch", "diffv2")
    p = run_tool("convert-llama-to-diffv2", src, tmp_path / "o.gguf", expect_rc=1)
    assert "expected 'llama'" in p.stderr


def test_double_tensor_overflow_is_an_error():
    big = np.full((1, 4), 40000.0, dtype=np.float16)
    with pytest.raises(dg.ToolError):
        dg.double_tensor(big, QT.F16)
    with pytest.raises(dg.ToolError):
        dg.double_tensor(np.zeros((1, 18), np.uint8), QT.IQ4_NL)  # no scale to double


def test_llama_to_diffv2_default_model(tmp_path, default_model):
    dst = tmp_path / "smollm2-diffv2.gguf"
    t0 = time.time()
    run_tool("convert-llama-to-diffv2", default_model, dst, in_process=False)
    # printed for the record; speed is for the benchmarks, not asserted here
    print(f"default model converted in {time.time() - t0:.1f} s")
    ra, rb = gguf.GGUFReader(str(default_model)), gguf.GGUFReader(str(dst))
    ka = {k: f.contents() for k, f in ra.fields.items() if not k.startswith("tokenizer.")}
    kb = {k: f.contents() for k, f in rb.fields.items() if not k.startswith("tokenizer.")}
    assert kb["general.architecture"] == "diffv2"
    h, hkv = ka["llama.attention.head_count"], ka["llama.attention.head_count_kv"]
    d = ka["llama.embedding_length"]
    hd = d // h
    assert kb["diffv2.attention.head_count"] == h
    assert kb["diffv2.attention.head_count_kv"] == hkv
    assert kb["diffv2.attention.key_length"] == hd
    assert not any(k.startswith("llama.") for k in kb)
    for k, v in ka.items():
        if k.startswith("llama."):
            assert kb["diffv2." + k[6:]] == v, k
        elif not k.startswith("GGUF.") and k != "general.architecture":
            assert kb[k] == v, k
    for f in ra.fields.values():
        if f.name.startswith("tokenizer."):
            assert dg.field_raw(f) == dg.field_raw(rb.fields[f.name]), f.name

    ta, tb = {t.name: t for t in ra.tensors}, {t.name: t for t in rb.tensors}
    n_layer = ka["llama.block_count"]
    assert set(tb) == set(ta) | {f"blk.{n}.attn_lambda.weight" for n in range(n_layer)}
    for name, t in ta.items():
        u = tb[name]
        if ".attn_q." in name or ".attn_output." in name:
            assert u.tensor_type == t.tensor_type
            continue
        assert u.tensor_type == t.tensor_type and np.array_equal(u.data, t.data), name
    max_o = 0.0
    for n in range(n_layer):
        q0 = dg.dequantize(ta[f"blk.{n}.attn_q.weight"]).reshape(h, hd, d)
        q1 = dg.dequantize(tb[f"blk.{n}.attn_q.weight"]).reshape(2 * h, hd, d)
        assert np.array_equal(q1[0::2], q0) and np.array_equal(q1[1::2], q0), n
        o0 = dg.dequantize(ta[f"blk.{n}.attn_output.weight"])
        o1 = dg.dequantize(tb[f"blk.{n}.attn_output.weight"])
        max_o = max(max_o, float(np.max(np.abs(o1 - 2 * o0))))
        lam = tb[f"blk.{n}.attn_lambda.weight"]
        assert lam.tensor_type == QT.F32 and list(lam.shape) == [d, h] and not np.any(lam.data)
    print(f"default model: max |o_new - 2 o_old| = {max_o}")
    assert max_o == 0.0

    # Four tokens through the float64 reference: the two files must agree to rounding.
    toks = [1, 504, 3, 9]
    la = logits(load(ra), toks)
    lb = logits(load(rb), toks)
    print(f"default model: max rel logit diff {rel_diff(la, lb):.3e}")
    assert rel_diff(la, lb) < 1e-12


# ---------------------------------------------------------------------------------------------
# (c) convert-diffv2-checkpoint against a forward pass over PyTorch-layout weights

def make_params(rng, vocab, d, h, n_kv, hd, ffn, n_layer, tied):
    """Random DIFF V2 weights in nn.Linear layout (weight [out, in])."""
    def lin(n_out, n_in, gain=1.0):
        return (rng.standard_normal((n_out, n_in)) * gain / math.sqrt(n_in)).astype(np.float32)

    def norm():
        return (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    p = {"embed": rng.standard_normal((vocab, d)).astype(np.float32), "norm": norm(),
         "head": None if tied else lin(vocab, d), "layers": []}
    for _ in range(n_layer):
        p["layers"].append({
            "attn_norm": norm(), "q": lin(2 * h * hd, d, 1.5), "k": lin(n_kv * hd, d, 1.5),
            "v": lin(n_kv * hd, d), "o": lin(d, h * hd), "lambda": lin(h, d, 2.0),
            "ffn_norm": norm(), "fc1": lin(ffn, d), "gate": lin(ffn, d), "fc2": lin(d, ffn)})
    return p


def yarn_inv_freq(base, dim, factor, orig, beta_fast=32.0, beta_slow=1.0):
    """Hugging Face style YaRN: (inv_freq, attention scaling)."""
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    return interpolation * (1 - extra) + extrapolation * extra, 0.1 * math.log(factor) + 1


def direct_forward(p, tokens, h, n_kv, hd, rot, base, eps, interleaved, scaling=None,
                   embed_scale=1.0):
    """unilm-style forward: x @ W.T, apply_rotary_emb(interleaved) on the first rot dims,
    repeat_kv, causal softmax, attn[:, :, 0::2] - sigmoid(lambda_proj(x)) * attn[:, :, 1::2]."""
    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    n = len(tokens)
    if scaling is None:
        inv_freq, mag = 1.0 / base ** (np.arange(0, rot, 2) / rot), 1.0
    elif scaling[0] == "linear":
        inv_freq, mag = 1.0 / base ** (np.arange(0, rot, 2) / rot) / scaling[1], 1.0
    else:
        inv_freq, mag = yarn_inv_freq(base, rot, scaling[1], scaling[2])
    freqs = np.outer(np.arange(n), inv_freq)
    cos, sin = np.cos(freqs) * mag, np.sin(freqs) * mag

    def rotary(x):
        xr, rest = x[..., :rot], x[..., rot:]
        if interleaved:
            z = (xr[..., 0::2] + 1j * xr[..., 1::2]) * (cos + 1j * sin)[:, None, :]
            out = np.empty_like(xr)
            out[..., 0::2], out[..., 1::2] = z.real, z.imag
        else:
            c, s = np.concatenate([cos, cos], -1)[:, None], np.concatenate([sin, sin], -1)[:, None]
            x1, x2 = xr[..., :rot // 2], xr[..., rot // 2:]
            out = xr * c + np.concatenate([-x2, x1], -1) * s
        return np.concatenate([out, rest], -1)

    f64 = {k: (v.astype(np.float64) if isinstance(v, np.ndarray) else v) for k, v in p.items()}
    x = f64["embed"][tokens] * embed_scale
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for lp in p["layers"]:
        lp = {k: v.astype(np.float64) for k, v in lp.items()}
        xn = rms(x, lp["attn_norm"])
        q = rotary((xn @ lp["q"].T).reshape(n, 2 * h, hd))
        k = rotary((xn @ lp["k"].T).reshape(n, n_kv, hd))
        v = (xn @ lp["v"].T).reshape(n, n_kv, hd)
        k = np.repeat(k, 2 * h // n_kv, axis=1)
        v = np.repeat(v, 2 * h // n_kv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) * hd ** -0.5 + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", s, v)
        lam = 1 / (1 + np.exp(-(xn @ lp["lambda"].T)))
        attn = attn[:, 0::2] - lam[..., None] * attn[:, 1::2]
        x = x + attn.reshape(n, h * hd) @ lp["o"].T
        xn = rms(x, lp["ffn_norm"])
        g = xn @ lp["fc1"].T
        x = x + ((g / (1 + np.exp(-g))) * (xn @ lp["gate"].T)) @ lp["fc2"].T
    head = f64["embed"] if p["head"] is None else f64["head"]
    return rms(x, f64["norm"]) @ head.T


def unilm_state_dict(p, attn="attn", lambda_name="lambda_proj"):
    sd = {"embed_tokens.weight": p["embed"], "layer_norm.weight": p["norm"]}
    if p["head"] is not None:
        sd["output_projection.weight"] = p["head"]
    for n, lp in enumerate(p["layers"]):
        pre = f"layers.{n}."
        sd[pre + "attn_layer_norm.weight"] = lp["attn_norm"]
        for src, dst in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj"),
                         ("lambda", lambda_name)):
            sd[f"{pre}{attn}.{dst}.weight"] = lp[src]
        sd[pre + "final_layer_norm.weight"] = lp["ffn_norm"]
        for m in ("fc1", "gate", "fc2"):
            sd[f"{pre}ffn.{m}.weight"] = lp[m]
    return sd


def hf_state_dict(p):
    sd = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["norm"]}
    if p["head"] is not None:
        sd["lm_head.weight"] = p["head"]
    for n, lp in enumerate(p["layers"]):
        pre = f"model.layers.{n}."
        sd[pre + "input_layernorm.weight"] = lp["attn_norm"]
        sd[pre + "post_attention_layernorm.weight"] = lp["ffn_norm"]
        for src, dst in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj"),
                         ("lambda", "lambda_proj")):
            sd[f"{pre}self_attn.{dst}.weight"] = lp[src]
        for src, dst in (("fc1", "gate_proj"), ("gate", "up_proj"), ("fc2", "down_proj")):
            sd[f"{pre}mlp.{dst}.weight"] = lp[src]
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    return sd


def save_bf16_safetensors(path, sd):
    """Write a safetensors file with every tensor in bf16 (numpy has no bf16 type)."""
    header, blobs, off = {}, [], 0
    for name, arr in sd.items():
        raw = (np.ascontiguousarray(arr, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(arr.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    hb = json.dumps(header).encode()
    with open(path, "wb") as fp:
        fp.write(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))


def bf16_round(p):
    def r(a):
        return None if a is None else (a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    return {"embed": r(p["embed"]), "norm": r(p["norm"]), "head": r(p["head"]),
            "layers": [{k: r(v) for k, v in lp.items()} for lp in p["layers"]]}


def f16_round(p):
    def r(a):
        return None if a is None else a.astype(np.float16).astype(np.float32)
    keep = ("attn_norm", "ffn_norm")
    return {"embed": r(p["embed"]), "norm": p["norm"], "head": r(p["head"]),
            "layers": [{k: (v if k in keep else r(v)) for k, v in lp.items()}
                       for lp in p["layers"]]}


TOKENS = [1, 5, 77, 257, 12, 12, 99, 250, 4, 61, 180, 3, 45, 210]


def test_checkpoint_unilm_names_gqa(tmp_path):
    from safetensors.numpy import save_file
    vocab, d, h, n_kv, hd, ffn, n_layer = 320, 64, 4, 2, 16, 96, 2
    p = make_params(np.random.default_rng(11), vocab, d, h, n_kv, hd, ffn, n_layer, tied=False)
    save_file(unilm_state_dict(p), str(tmp_path / "ckpt.safetensors"))
    cfg = {"dim": d, "n_layers": n_layer, "head_dim": hd, "hidden_dim": ffn, "n_heads": h,
           "n_kv_heads": n_kv, "norm_eps": 1e-6, "vocab_size": vocab, "rope_theta": 500.0,
           "max_seq_len": 1024}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tok_src = tmp_path / "tok.gguf"
    run_tool("gen-tiny-model", tok_src, "--vocab", vocab)
    out = tmp_path / "m.gguf"
    run_tool("convert-diffv2-checkpoint", tmp_path / "ckpt.safetensors", out,
             "--config", tmp_path / "config.json", "--tokenizer-from", tok_src, in_process=False)
    m = load(out)
    assert (m.arch, m.n_head, m.n_q, m.n_kv, m.hd, m.rope_layout, m.eps) == \
        ("diffv2", h, 2 * h, n_kv, hd, "adjacent", pytest.approx(1e-6))
    _, kv = fields(out)
    assert len(kv["tokenizer.ggml.tokens"]) == vocab and kv["diffv2.context_length"] == 1024
    want = direct_forward(p, TOKENS, h, n_kv, hd, hd, 500.0, 1e-6, interleaved=True)
    got = logits(m, TOKENS)
    print(f"checkpoint unilm/adjacent/GQA: max rel logit diff {rel_diff(want, got):.3e}")
    assert rel_diff(want, got) < 1e-10
    # The same weights read with the wrong RoPE layout must not agree: the check has teeth.
    wrong = direct_forward(p, TOKENS, h, n_kv, hd, hd, 500.0, 1e-6, interleaved=False)
    assert rel_diff(wrong, got) > 1e-4


def test_checkpoint_hf_names_yarn_partial_f16(tmp_path):
    from safetensors.numpy import save_file
    vocab, d, h, n_kv, hd, ffn, n_layer = 300, 64, 2, 2, 16, 64, 2
    p = make_params(np.random.default_rng(12), vocab, d, h, n_kv, hd, ffn, n_layer, tied=True)
    save_file(hf_state_dict(p), str(tmp_path / "model.safetensors"))
    cfg = {"hidden_size": d, "num_hidden_layers": n_layer, "num_attention_heads": h,
           "num_key_value_heads": n_kv, "head_dim": hd, "intermediate_size": ffn,
           "rms_norm_eps": 1e-5, "rope_theta": 100.0, "partial_rotary_factor": 0.5,
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 64}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "m.gguf"
    run_tool("convert-diffv2-checkpoint", tmp_path / "model.safetensors", out,
             "--config", tmp_path / "config.json", "--dtype", "f16")
    m = load(out)
    assert (m.rope_layout, m.scaling, m.rot, m.orig_ctx) == ("neox", "yarn", 8, 64)
    assert "output.weight" not in m.w
    want = direct_forward(f16_round(p), TOKENS, h, n_kv, hd, 8, 100.0, 1e-5,
                          interleaved=False, scaling=("yarn", 4.0, 64))
    got = logits(m, TOKENS)
    print(f"checkpoint hf/neox/yarn/partial/f16: max rel logit diff {rel_diff(want, got):.3e}")
    assert rel_diff(want, got) < 1e-10
    plain = direct_forward(f16_round(p), TOKENS, h, n_kv, hd, 8, 100.0, 1e-5, interleaved=False)
    assert rel_diff(plain, got) > 1e-4


def test_checkpoint_bf16_name_map_embed_scale_linear(tmp_path):
    vocab, d, h, n_kv, hd, ffn, n_layer = 280, 64, 4, 1, 8, 64, 3
    p = bf16_round(make_params(np.random.default_rng(13), vocab, d, h, n_kv, hd, ffn, n_layer,
                               tied=True))
    sd = {"module." + k: v for k, v in
          unilm_state_dict(p, attn="self_attn", lambda_name="lam").items()}
    save_bf16_safetensors(tmp_path / "ckpt.safetensors", sd)
    (tmp_path / "map.json").write_text(json.dumps(
        {"blk.{n}.attn_lambda.weight": "layers.{n}.self_attn.lam.weight"}))
    out = tmp_path / "m.gguf"
    run_tool("convert-diffv2-checkpoint", tmp_path / "ckpt.safetensors", out,
             "--name-map", tmp_path / "map.json", "--embed-scale", "sqrt-dim",
             "--rope-scaling", "linear", "--rope-factor", "2", "--eps", "1e-5")
    m = load(out)
    assert "output.weight" in m.w, "a scaled tied embedding needs an unscaled output copy"
    want = direct_forward(p, TOKENS, h, n_kv, hd, hd, 10000.0, 1e-5, interleaved=True,
                          scaling=("linear", 2.0), embed_scale=math.sqrt(d))
    got = logits(m, TOKENS)
    print(f"checkpoint bf16/name-map/embed-scale/linear: max rel diff {rel_diff(want, got):.3e}")
    assert rel_diff(want, got) < 1e-10


def test_checkpoint_errors(tmp_path):
    from safetensors.numpy import save_file
    p = make_params(np.random.default_rng(14), 260, 32, 2, 2, 8, 32, 1, tied=True)
    save_file(unilm_state_dict(p), str(tmp_path / "c.safetensors"))
    (tmp_path / "bad.json").write_text(json.dumps({"n_heads": 4}))
    r = run_tool("convert-diffv2-checkpoint", tmp_path / "c.safetensors", tmp_path / "o.gguf",
                 "--config", tmp_path / "bad.json", expect_rc=1)
    assert "disagrees" in r.stderr
    sd = unilm_state_dict(p)
    del sd["layers.0.attn.lambda_proj.weight"]
    save_file(sd, str(tmp_path / "nolambda.safetensors"))
    r = run_tool("convert-diffv2-checkpoint", tmp_path / "nolambda.safetensors",
                 tmp_path / "o.gguf", expect_rc=1)
    assert "attn_lambda" in r.stderr
    (tmp_path / "c.pt").write_bytes(b"not a checkpoint")
    try:
        import torch  # noqa: F401
        has_torch = True
    except ImportError:
        has_torch = False
    r = run_tool("convert-diffv2-checkpoint", tmp_path / "c.pt", tmp_path / "o.gguf",
                 expect_rc=1)
    if not has_torch:
        assert "torch" in r.stderr


# ---------------------------------------------------------------------------------------------
# diffrag-run's options (getopt_long): --help to stdout, a bad option exits 2 with the usage

def test_diffrag_run_options(build_dir):
    exe = str(build_dir / "diffrag-run")
    for flag in ("--help", "-h"):
        r = subprocess.run([exe, flag], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and r.stdout.startswith("usage: diffrag-run") and r.stderr == ""
    for args, why in ((["--bogus"], "unknown option --bogus"), (["-x"], "unknown option -x"),
                      (["-m"], "-m needs a value"), (["--model"], "--model needs a value"),
                      (["-m", "m.gguf", "-p", "q", "extra"], "unexpected argument extra"),
                      (["-m", "m.gguf"], "usage: diffrag-run")):
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and why in r.stderr and "usage: diffrag-run" in r.stderr, args
        assert r.stdout == "", args
    r = subprocess.run([exe, "-m", "m.gguf", "-p", "q", "--kv", "f8"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "--kv must be f16, f32 or q8" in r.stderr
    # --opt=value and a value that starts with '-' (a missing model file: exit 1, not 2)
    r = subprocess.run([exe, "--model=/nonexistent.gguf", "-p", "-", "--stop", "-x"],
                       capture_output=True, text=True, timeout=30, input="")
    assert r.returncode == 1 and "nonexistent.gguf" in r.stderr, r.stderr


@pytest.mark.parametrize("tool", ["convert-llama-to-diffv2", "convert-diffv2-checkpoint", "gen-tiny-model"])
def test_numpy_tools_run_from_a_python_without_numpy(tool):
    # -S: a python3 that sees no site packages, as Debian's own is outside .venv; the tool
    # re-runs itself under .venv/bin/python3 (which `make test` made)
    path = str(ROOT_DIR / "tools" / tool)
    r = subprocess.run([sys.executable, "-S", path, "--help"], capture_output=True, text=True,
                       timeout=60, env={k: v for k, v in os.environ.items() if k != "DIFFRAG_VENV_TRIED"})
    assert r.returncode == 0 and r.stdout.startswith("usage: " + tool), r.stdout + r.stderr
    # where .venv cannot help either, one line says what to run first
    r = subprocess.run([sys.executable, "-S", path, "--help"], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, DIFFRAG_VENV_TRIED="1"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(tool + ": needs the Python package") and "run `make venv` first" in r.stderr
    assert len(r.stderr.splitlines()) == 1
