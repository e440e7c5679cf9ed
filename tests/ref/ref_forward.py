#!/usr/bin/env python3
"""Float64 NumPy reference forward pass for diffrag's llama, qwen2 and diffv2 GGUF models, written
from the equations in docs/model-format.md: full causal attention materialised per head, GQA,
q/k/v biases, both RoPE layouts, none/linear/yarn scaling, partial rotary dimensions. Meant for
small models.

    from ref.ref_forward import load, logits
    model = load("tiny.gguf"); out = logits(model, [1, 2, 3])   # [3, vocab] float64
CLI: python3 tests/ref/ref_forward.py MODEL --tokens 1,2,3 --out logits.npy
"""
import argparse
import math
import sys
from dataclasses import dataclass, field

import numpy as np
import gguf


@dataclass
class Model:
    arch: str                   # "llama", "qwen2" or "diffv2"
    n_layer: int
    d: int                      # model width
    ffn: int
    n_head: int                 # llama, qwen2: query heads; diffv2: output heads h
    n_q: int                    # query heads: n_head (llama, qwen2) or 2 * n_head (diffv2)
    n_kv: int
    hd: int
    eps: float
    rope_base: float
    rot: int                    # rotated dimensions per head
    rope_layout: str            # "adjacent" or "neox"
    scaling: str                # "none", "linear" or "yarn"
    factor: float
    orig_ctx: int
    attn_factor: float
    beta_fast: float
    beta_slow: float
    vocab: int
    # name -> float64 array in numpy order: a projection n_in -> n_out is [n_out, n_in]
    w: dict = field(default_factory=dict)


def _get(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def load(path):
    """Read a GGUF model (a path, or an open gguf.GGUFReader to save re-parsing a large
    vocabulary) and dequantise every tensor to float64. Raises ValueError on an unsupported
    architecture or inconsistent shapes."""
    r = path if isinstance(path, gguf.GGUFReader) else gguf.GGUFReader(str(path))
    arch = _get(r, "general.architecture")
    if arch not in ("llama", "qwen2", "diffv2"):
        raise ValueError(f"{path}: unsupported architecture {arch!r}")
    w = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        vals = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        w[t.name] = np.asarray(vals, dtype=np.float64).reshape(shape)

    def hp(key, default=None):
        v = _get(r, f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"{path}: missing {arch}.{key}")
        return v

    d = int(hp("embedding_length"))
    n_head = int(hp("attention.head_count"))
    n_kv = int(hp("attention.head_count_kv", n_head))
    hd = int(hp("attention.key_length", d // n_head))
    n_q = 2 * n_head if arch == "diffv2" else n_head
    scaling = hp("rope.scaling.type", "none")
    factor = float(hp("rope.scaling.factor", 1.0))
    m = Model(
        arch=arch, n_layer=int(hp("block_count")), d=d, ffn=int(hp("feed_forward_length")),
        n_head=n_head, n_q=n_q, n_kv=n_kv, hd=hd,
        eps=float(hp("attention.layer_norm_rms_epsilon")),
        rope_base=float(hp("rope.freq_base", 10000.0)),
        rot=int(hp("rope.dimension_count", hd)),
        # qwen2's GGUF keeps q and k rows in the trained order (halves rotated together)
        rope_layout=hp("rope.layout", "neox" if arch == "qwen2" else "adjacent"),
        scaling=scaling, factor=factor,
        orig_ctx=int(hp("rope.scaling.original_context_length", 0)),
        attn_factor=float(hp("rope.scaling.attn_factor", 0.1 * math.log(factor) + 1.0)),
        beta_fast=float(hp("rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(hp("rope.scaling.yarn_beta_slow", 1.0)),
        vocab=w["token_embd.weight"].shape[0], w=w)
    if m.rope_layout not in ("adjacent", "neox"):
        raise ValueError(f"{path}: unknown rope layout {m.rope_layout!r}")
    if m.scaling not in ("none", "linear", "yarn"):
        raise ValueError(f"{path}: unknown rope scaling {m.scaling!r}")
    if m.n_q % m.n_kv or (arch == "diffv2" and (m.n_q // m.n_kv) % 2):
        raise ValueError(f"{path}: {m.n_q} query heads do not split into {m.n_kv} groups")
    if m.rot % 2 or m.rot > hd:
        raise ValueError(f"{path}: rope dimension {m.rot} invalid for head dim {hd}")
    if m.scaling == "yarn" and m.orig_ctx <= 0:
        raise ValueError(f"{path}: yarn scaling needs original_context_length")
    expect = {"attn_q.weight": (n_q * hd, d), "attn_k.weight": (n_kv * hd, d),
              "attn_v.weight": (n_kv * hd, d), "attn_output.weight": (d, n_head * hd),
              "ffn_gate.weight": (m.ffn, d), "ffn_up.weight": (m.ffn, d),
              "ffn_down.weight": (d, m.ffn), "attn_norm.weight": (d,), "ffn_norm.weight": (d,)}
    if arch == "diffv2":
        expect["attn_lambda.weight"] = (n_head, d)
    optional = {"attn_q.bias": (n_q * hd,), "attn_k.bias": (n_kv * hd,),
                "attn_v.bias": (n_kv * hd,)}
    for n in range(m.n_layer):
        for name, shape in expect.items():
            t = w.get(f"blk.{n}.{name}")
            if t is None or t.shape != shape:
                raise ValueError(f"{path}: blk.{n}.{name}: expected numpy shape {shape}, "
                                 f"got {None if t is None else t.shape}")
        for name, shape in optional.items():
            t = w.get(f"blk.{n}.{name}")
            if t is not None and t.shape != shape:
                raise ValueError(f"{path}: blk.{n}.{name}: expected numpy shape {shape}, "
                                 f"got {t.shape}")
        for name in ("attn_output.bias", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias"):
            if f"blk.{n}.{name}" in w:
                raise ValueError(f"{path}: blk.{n}.{name}: unsupported bias")
    return m


def rope_frequencies(m):
    """(f_i for i < rot/2, magnitude factor) as in docs/model-format.md."""
    i = np.arange(m.rot // 2, dtype=np.float64)
    theta = m.rope_base ** (-2.0 * i / m.rot)
    if m.scaling == "none":
        return theta, 1.0
    if m.scaling == "linear":
        return theta / m.factor, 1.0

    def corr(r):
        return m.rot * math.log(m.orig_ctx / (2.0 * math.pi * r)) / (2.0 * math.log(m.rope_base))

    low = max(math.floor(corr(m.beta_fast)), 0)
    high = min(math.ceil(corr(m.beta_slow)), m.rot - 1)
    span = high - low if high != low else 0.001
    ramp = np.clip((i - low) / span, 0.0, 1.0)
    e = 1.0 - ramp
    return (theta / m.factor) * (1.0 - e) + theta * e, m.attn_factor


def apply_rope(m, x, pos):
    """x: [n_tok, n_heads, hd]; rotates the first rot dims of every head at positions pos."""
    f, mag = rope_frequencies(m)
    phi = np.asarray(pos, dtype=np.float64)[:, None] * f[None, :]      # [n_tok, rot/2]
    cos = (np.cos(phi) * mag)[:, None, :]
    sin = (np.sin(phi) * mag)[:, None, :]
    half = m.rot // 2
    if m.rope_layout == "adjacent":
        a_idx = np.arange(half) * 2
        b_idx = a_idx + 1
    else:
        a_idx = np.arange(half)
        b_idx = a_idx + half
    out = x.copy()
    xa, xb = x[:, :, a_idx], x[:, :, b_idx]
    out[:, :, a_idx] = xa * cos - xb * sin
    out[:, :, b_idx] = xa * sin + xb * cos
    return out


def rmsnorm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def hidden(m, tokens, start_pos=0, maps=None):
    """Final residual stream before output_norm: [n_tok, d]. When `maps` is a dict, it receives
    per layer (probabilities [n_q, n, n], sigmoid(lambda) [n, h] or None): the attention maps
    materialised, for checking the engine's attention-mass signals."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError("tokens must be a non-empty 1-D sequence")
    if tokens.min() < 0 or tokens.max() >= m.vocab:
        raise ValueError(f"token id out of range [0, {m.vocab})")
    n = tokens.size
    pos = np.arange(start_pos, start_pos + n)
    x = m.w["token_embd.weight"][tokens].copy()
    causal = np.tril(np.ones((n, n), dtype=bool))
    group = m.n_q // m.n_kv
    for layer in range(m.n_layer):
        p = f"blk.{layer}."
        a = rmsnorm(x, m.w[p + "attn_norm.weight"], m.eps)
        zero = np.zeros(1)
        q = (a @ m.w[p + "attn_q.weight"].T + m.w.get(p + "attn_q.bias", zero)
             ).reshape(n, m.n_q, m.hd)
        k = (a @ m.w[p + "attn_k.weight"].T + m.w.get(p + "attn_k.bias", zero)
             ).reshape(n, m.n_kv, m.hd)
        v = (a @ m.w[p + "attn_v.weight"].T + m.w.get(p + "attn_v.bias", zero)
             ).reshape(n, m.n_kv, m.hd)
        q = apply_rope(m, q, pos)
        k = apply_rope(m, k, pos)
        o = np.empty((n, m.n_q, m.hd))
        probs = np.empty((m.n_q, n, n)) if maps is not None else None
        for j in range(m.n_q):
            g = j // group
            s = (q[:, j, :] @ k[:, g, :].T) / math.sqrt(m.hd)
            s = np.where(causal, s, -np.inf)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            if probs is not None:
                probs[j] = s
            o[:, j, :] = s @ v[:, g, :]
        if m.arch == "diffv2":
            lam = _sigmoid(a @ m.w[p + "attn_lambda.weight"].T)            # [n, h]
            attn = o[:, 0::2, :] - lam[:, :, None] * o[:, 1::2, :]
        else:
            lam = None
            attn = o
        if maps is not None:
            maps[layer] = (probs, lam)
        x = x + attn.reshape(n, m.n_head * m.hd) @ m.w[p + "attn_output.weight"].T
        mm = rmsnorm(x, m.w[p + "ffn_norm.weight"], m.eps)
        gate = mm @ m.w[p + "ffn_gate.weight"].T
        up = mm @ m.w[p + "ffn_up.weight"].T
        x = x + (_silu(gate) * up) @ m.w[p + "ffn_down.weight"].T
    return x


def logits(m, tokens, start_pos=0):
    """Logits at every position, [n_tokens, vocab] float64, for tokens placed at positions
    start_pos, start_pos + 1, ... of an otherwise empty context."""
    x = rmsnorm(hidden(m, tokens, start_pos), m.w["output_norm.weight"], m.eps)
    out_w = m.w.get("output.weight", m.w["token_embd.weight"])
    return x @ out_w.T


def main(argv=None):
    ap = argparse.ArgumentParser(description="float64 reference logits of a GGUF model")
    ap.add_argument("model")
    ap.add_argument("--tokens", required=True, help="comma-separated token ids")
    ap.add_argument("--out", help="write all positions' logits [n_tokens, vocab] as .npy")
    ap.add_argument("--last-f32", help="write the last position's logits as raw float32")
    a = ap.parse_args(argv)
    try:
        toks = [int(t) for t in a.tokens.split(",") if t.strip()]
        m = load(a.model)
        out = logits(m, toks)
    except ValueError as e:
        print(f"ref_forward: {e}", file=sys.stderr)
        return 1
    if a.out:
        np.save(a.out, out)
    if a.last_f32:
        out[-1].astype("<f4").tofile(a.last_f32)
    top = np.argsort(-out[-1])[:5]
    print("last position top-5:", ", ".join(f"{i}:{out[-1][i]:.6f}" for i in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
