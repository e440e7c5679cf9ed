"""Shared helpers for diffrag's model tools: copying GGUF metadata verbatim, exact scaling of
quantised blocks, a synthetic byte-level BPE tokenizer for test models, and a minimal
safetensors reader (bf16 included, no torch needed). Format contract: docs/model-format.md."""
import json
import re
import struct
from collections import Counter

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

# Keys the reader synthesises from the file header, never copied as metadata.
HEADER_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")

# Block types whose first two bytes are the f16 scale d; MIN_TYPES also hold the f16 min m in
# bytes 2..3. Every dequantised value is d*q (+ m), so doubling d (and m) doubles it exactly.
SCALE_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0)
MIN_TYPES = (QT.Q4_1, QT.Q5_1)

# K-quant super-blocks (256 values): byte offsets of the f16 super-block scale d and of the f16
# min dmin (None where the type has none). Every value is d * (6- or 4-bit scale) * q, minus
# dmin * (sub-block min) where there is one, so doubling d and dmin doubles it exactly.
K_SCALE_OFFSETS = {
    QT.Q2_K: (80, 82),     # scales[16] qs[64] d dmin
    QT.Q3_K: (108, None),  # hmask[32] qs[64] scales[12] d
    QT.Q4_K: (0, 2),       # d dmin scales[12] qs[128]
    QT.Q5_K: (0, 2),       # d dmin scales[12] qh[32] qs[128]
    QT.Q6_K: (208, None),  # ql[128] qh[64] scales[16] (int8) d
}


class ToolError(Exception):
    """A user-facing failure: bad input file, inconsistent shapes, unsupported type."""


# ---------------------------------------------------------------------------------------------
# metadata

def field_raw(field):
    """(value, vtype, sub_type) of a GGUFReader field with strings kept as raw bytes, so copies
    are byte-exact even for tokens that are not valid UTF-8. None for nested arrays."""
    vtype = field.types[0]
    if vtype == VT.ARRAY:
        sub = field.types[-1]
        if len(field.types) > 2:
            return None
        if sub == VT.STRING:
            val = [bytes(field.parts[i]) for i in field.data]
        elif field.data:
            val = np.concatenate([field.parts[i] for i in field.data]).tolist()
        else:
            val = []
        return val, vtype, sub
    if vtype == VT.STRING:
        return bytes(field.parts[field.data[0]]), vtype, None
    return field.parts[field.data[0]].tolist()[0], vtype, None


def field_value(reader, key, default=None):
    """Decoded value of a metadata key (str for strings, list for arrays), or default."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def copy_field(writer, field, key=None):
    """Copy one metadata field into writer under key (default: the same name). Empty arrays
    are skipped because GGUFWriter cannot write them."""
    raw = field_raw(field)
    if raw is None:
        raise ToolError(f"metadata {field.name}: nested arrays are not supported")
    val, vtype, sub = raw
    if vtype == VT.ARRAY and len(val) == 0:
        return
    writer.add_key_value(key or field.name, val, vtype, sub)


def metadata_fields(reader):
    """The reader's metadata fields in file order, without the header pseudo-keys."""
    return [f for name, f in reader.fields.items() if name not in HEADER_KEYS]


# ---------------------------------------------------------------------------------------------
# exact tensor scaling

def double_tensor(data, ttype):
    """Return a new array holding the tensor whose dequantised values are exactly twice those of
    data (a GGUFReader tensor's data, any of F32/F16/BF16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K..Q6_K).
    Raises ToolError if a value would overflow its storage type (never re-quantises)."""
    ttype = QT(ttype)
    with np.errstate(over="ignore", invalid="ignore"):
        return _double_tensor(data, ttype)


def _double_tensor(data, ttype):
    if ttype == QT.F32:
        out = np.asarray(data, dtype=np.float32) * np.float32(2)
        if not np.all(np.isfinite(out) | ~np.isfinite(data)):
            raise ToolError("doubling an F32 tensor overflows")
        return out
    if ttype == QT.F16:
        src = np.asarray(data, dtype=np.float16)
        out = src * np.float16(2)
        if not np.all(np.isfinite(out) | ~np.isfinite(src)):
            raise ToolError("doubling an F16 tensor overflows f16")
        return out
    if ttype == QT.BF16:
        raw = np.ascontiguousarray(data).view(np.uint16)
        f = (raw.astype(np.uint32) << 16).view(np.float32) * np.float32(2)
        if not np.all(np.isfinite(f) | ~np.isfinite((raw.astype(np.uint32) << 16).view(np.float32))):
            raise ToolError("doubling a BF16 tensor overflows")
        # The product has at most 8 significant bits, so truncating to bf16 is exact.
        out16 = (f.view(np.uint32) >> 16).astype(np.uint16)
        return out16.view(np.uint8).reshape(np.shape(data))
    if ttype in SCALE_TYPES or ttype in K_SCALE_OFFSETS:
        _, type_size = gguf.GGML_QUANT_SIZES[ttype]
        blocks = np.array(data, dtype=np.uint8, copy=True).reshape(-1, type_size)
        if ttype in K_SCALE_OFFSETS:
            offsets = tuple(o for o in K_SCALE_OFFSETS[ttype] if o is not None)
        else:
            offsets = (0, 2) if ttype in MIN_TYPES else (0,)
        for off in offsets:
            half = np.ascontiguousarray(blocks[:, off:off + 2]).view(np.float16)
            doubled = half * np.float16(2)
            if not np.all(np.isfinite(doubled) | ~np.isfinite(half)):
                raise ToolError(f"doubling a {ttype.name} block scale overflows f16")
            blocks[:, off:off + 2] = doubled.view(np.uint8)
        return blocks.reshape(np.shape(data))
    raise ToolError(f"cannot scale a {ttype.name} tensor exactly (supported: F32, F16, BF16, "
                    "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)")


def dequantize(tensor):
    """Float32 values of a GGUFReader tensor in numpy order (ggml shape reversed)."""
    shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
    vals = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return np.asarray(vals, dtype=np.float32).reshape(shape)


# ---------------------------------------------------------------------------------------------
# tokenizer for synthetic models

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Training text for the synthetic merges: ordinary prose so that the merges look like those of
# a real byte-level BPE (frequent English pairs first, space-prefixed words).
_BPE_TEXT = """
The quick brown fox jumps over the lazy dog. A retrieval system reads the question, finds the
passages that answer it, and hands them to the language model together with the question.
The model reads every passage in one long context and writes the answer in a few words.
Differential attention subtracts two attention maps so that the noise common to both cancels
and the relevant tokens stand out. Where is the answer? It is in the third passage, near the
end of the second paragraph. Who wrote the report in 1998? The report was written by the
committee after the hearing in London. When did the river flood the town? In the spring of
2004, after three weeks of rain, the water rose over the bridge and into the market square.
What is the capital of France? Paris is the capital and the largest city of France.
Models are tested against a reference written in plain arithmetic, and every difference is
printed so that a reader can see how close the two results are. The cache keeps keys and
values for each layer; the prompt is processed in chunks and the logits of the last position
are returned. Small models with random weights are enough to check the arithmetic.
Questions about history, science, sport and music are mixed with questions that have no
answer in the passages; for those the model should say that it cannot find the answer.
"""

_PRETOKEN_RE = re.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def byte_to_unicode():
    """The GPT-2 byte-level alphabet: byte b -> a printable character, as a list of 256."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
                 + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    table = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def build_tokenizer(vocab_size, text=_BPE_TEXT):
    """Tokens, token types and merges of a byte-level BPE vocabulary of exactly vocab_size
    entries: the three ChatML specials, the 256 byte characters in byte order, then merge
    results learnt from text (then from letter pairs if the text runs out). Every merge "a b"
    yields the token "ab", which appears in the list after both of its parts."""
    base = len(SPECIAL_TOKENS) + 256
    if vocab_size < base:
        raise ToolError(f"vocab must be at least {base} (3 specials + 256 bytes)")
    alphabet = byte_to_unicode()
    tokens = list(SPECIAL_TOKENS) + alphabet
    types = [TOKEN_CONTROL] * len(SPECIAL_TOKENS) + [TOKEN_NORMAL] * 256
    known = set(tokens)
    merges = []

    words = Counter()
    for piece in _PRETOKEN_RE.findall(text):
        words[tuple(alphabet[b] for b in piece.encode("utf-8"))] += 1

    while len(tokens) < vocab_size:
        pairs = Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        # Highest count first; ties broken by the pair itself so the result is reproducible.
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merges.append(f"{a} {b}")
        if a + b not in known:
            tokens.append(a + b)
            types.append(TOKEN_NORMAL)
            known.add(a + b)
        merged = Counter()
        for w, n in words.items():
            out = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged

    # Text exhausted: extend with merges of existing tokens and lowercase letters.
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    i = 0
    while len(tokens) < vocab_size:
        left = tokens[len(SPECIAL_TOKENS) + i // 26] if i // 26 < len(tokens) - 3 else None
        if left is None:
            raise ToolError("cannot build a vocabulary that large")
        right = letters[i % 26]
        i += 1
        if left + right in known:
            continue
        merges.append(f"{left} {right}")
        tokens.append(left + right)
        types.append(TOKEN_NORMAL)
        known.add(left + right)
    return tokens, types, merges


def add_tokenizer(writer, vocab_size):
    """Write the synthetic byte-level tokenizer (gpt2 model, smollm pre-tokenizer, ChatML)."""
    tokens, types, merges = build_tokenizer(vocab_size)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "smollm")
    writer.add_key_value("tokenizer.ggml.tokens", tokens, VT.ARRAY, VT.STRING)
    writer.add_key_value("tokenizer.ggml.token_type", types, VT.ARRAY, VT.INT32)
    writer.add_key_value("tokenizer.ggml.merges", merges, VT.ARRAY, VT.STRING)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_string("tokenizer.chat_template", CHATML_TEMPLATE)


def copy_tokenizer(writer, reader):
    """Copy every tokenizer.* key of another GGUF; returns the number of tokens (0 if none)."""
    n = 0
    for f in metadata_fields(reader):
        if f.name.startswith("tokenizer."):
            copy_field(writer, f)
            if f.name == "tokenizer.ggml.tokens":
                n = len(f.data)
    return n


# ---------------------------------------------------------------------------------------------
# safetensors

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bf16",
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8}


def read_safetensors(path):
    """{name: float32/float64/int ndarray} from a .safetensors file. bf16 is widened to f32
    exactly (numpy has no bf16, which is why safetensors.numpy cannot read it)."""
    with open(path, "rb") as fp:
        head = fp.read(8)
        if len(head) != 8:
            raise ToolError(f"{path}: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > (1 << 30):
            raise ToolError(f"{path}: implausible safetensors header size {n}")
        try:
            header = json.loads(fp.read(n))
        except ValueError as e:
            raise ToolError(f"{path}: bad safetensors header: {e}") from None
        body = np.fromfile(fp, dtype=np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES.get(info.get("dtype"))
        if dt is None:
            raise ToolError(f"{path}: tensor {name}: unsupported dtype {info.get('dtype')}")
        start, end = info["data_offsets"]
        if not 0 <= start <= end <= body.size:
            raise ToolError(f"{path}: tensor {name}: data offsets out of range")
        shape = tuple(info["shape"])
        raw = body[start:end]
        if dt == "bf16":
            arr = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = raw.view(dt)
        if arr.size != int(np.prod(shape, dtype=np.int64)):
            raise ToolError(f"{path}: tensor {name}: size does not match shape {shape}")
        out[name] = arr.reshape(shape)
    return out
