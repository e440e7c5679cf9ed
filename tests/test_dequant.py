"""The C GGUF reader and dequantisation kernels checked against the gguf Python package.

`build/tests/test_gguf --dump FILE TENSOR OUT.bin` writes a tensor dequantised by
kernels/cpu/dequant.c; it is compared with gguf.quants.dequantize (bit-exact expected, at most
1e-6 absolute allowed) for tensors of the default model (Q8_0 embedding, Q4_1 weights, F32 norms)
and for F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and F32 tensors written here with
gguf.GGUFWriter. The K-quants (Q2_K .. Q6_K) are checked the same way on random valid blocks
(the gguf package cannot quantise them): random bytes with the f16 scale fields set to finite
values; and against blocks quantised and dequantised by ggml's own C code, recorded under
tests/data/ by tests/data/gen-kquant-blocks.sh. `test_gguf --list FILE` (keys, values and tensor layout as the C reader sees
them) is compared with gguf.GGUFReader on the same files.
"""
import subprocess

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf.quants import dequantize, quantize

from conftest import run_make

TOL = 1e-6


@pytest.fixture(scope="module")
def tool(root, build_dir):
    build = build_dir.relative_to(root) if build_dir.is_relative_to(root) else build_dir
    exe = build / "tests" / "test_gguf"
    r = run_make(["make", "-s", f"BUILD={build}", str(exe)], cwd=root,
                 capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"building {exe} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return root / exe


def c_dequant(tool, path, name, tmp_path):
    out = tmp_path / "tensor.f32"
    r = subprocess.run([str(tool), "--dump", str(path), name, str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"--dump {name}: {r.stderr}"
    data = np.fromfile(out, dtype=np.float32)
    out.unlink()
    return data


def compare(label, got, want):
    """Bit-exact where possible; NaN must match NaN; otherwise at most TOL apart."""
    want = np.asarray(want, dtype=np.float32).reshape(-1)
    assert got.shape == want.shape, f"{label}: {got.shape} elements, expected {want.shape}"
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_got, nan_want), f"{label}: NaN positions differ"
    g, w = got[~nan_want], want[~nan_want]
    same_bits = g.view(np.uint32) == w.view(np.uint32)
    equal = g == w  # also +0 == -0, inf == inf
    diff = np.zeros(g.shape)
    diff[~equal] = np.abs(g[~equal].astype(np.float64) - w[~equal].astype(np.float64))
    max_diff = float(diff.max()) if diff.size else 0.0
    print(f"{label}: {got.size} values, {int((~same_bits).sum())} not bit-identical, "
          f"{int(nan_got.sum())} NaN, max |C - gguf| = {max_diff:.3g}")
    assert max_diff <= TOL, f"{label}: max difference {max_diff}"
    return int((~same_bits).sum())


def reader_tensor(reader, name):
    for t in reader.tensors:
        if t.name == name:
            return t
    raise KeyError(name)


def reference(t):
    return dequantize(np.asarray(t.data), t.tensor_type)


# ---- the default model --------------------------------------------------------------------

def test_default_model_tensors(tool, default_model, tmp_path):
    reader = gguf.GGUFReader(default_model)
    names = ["token_embd.weight", "output_norm.weight"]
    names += [t.name for t in reader.tensors if t.name.startswith("blk.0.")]
    seen = set()
    for name in names:
        t = reader_tensor(reader, name)
        seen.add(t.tensor_type)
        got = c_dequant(tool, default_model, name, tmp_path)
        mismatched = compare(f"{name} ({t.tensor_type.name})", got, reference(t))
        assert mismatched == 0, f"{name}: {mismatched} values differ in the last bits"
    assert seen == {Q.Q8_0, Q.Q4_1, Q.F32}


# ---- tensors written here ----------------------------------------------------------------

def awkward_rows(rng, rows, cols):
    """Normal data plus blocks that hit the corner cases of each format."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, :32] = 0.0                                     # zero scale
    x[0, 32:64] = 3.25                                  # constant block (min == max)
    x[1, :32] *= 1e-6                                   # subnormal-range f16 scales
    x[1, 32:64] = np.linspace(-60000, 60000, 32)        # near the f16 limit
    x[2, :32] = -np.abs(x[2, :32])                      # all negative
    x[2, 5] = 40.0                                      # outlier
    return x


QUANT_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]


def write_test_file(path, alignment):
    """Returns {tensor name: (type, expected f32 values)}."""
    rng = np.random.default_rng(20240611)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("test.u8", 250)
    w.add_int8("test.i8", -120)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -32000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_uint64("test.u64", 2**62 + 3)
    w.add_int64("test.i64", -(2**62) - 5)
    w.add_float32("test.f32", 0.1)
    w.add_float64("test.f64", 1.0 / 3.0)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "déjà vu ☃")
    w.add_key_value("test.strs", ["a", "", "ĠHello", "<|im_end|>", "x" * 300], V.ARRAY,
                    sub_type=V.STRING)
    w.add_key_value("test.f32s", [1.5, -2.25, 1e-30], V.ARRAY, sub_type=V.FLOAT32)
    w.add_key_value("test.i32s", [-1, 0, 2**31 - 1], V.ARRAY, sub_type=V.INT32)
    w.add_key_value("test.u8s", [0, 255], V.ARRAY, sub_type=V.UINT8)
    w.add_key_value("test.bools", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    expected = {}

    x = awkward_rows(rng, 5, 96)
    w.add_tensor("f32.weight", x)
    expected["f32.weight"] = (Q.F32, x)

    every_half = np.arange(65536, dtype=np.uint16).view(np.float16).reshape(256, 256)
    w.add_tensor("f16_all.weight", every_half)
    expected["f16_all.weight"] = (Q.F16, dequantize(every_half, Q.F16))
    x = awkward_rows(rng, 3, 64).astype(np.float16)
    w.add_tensor("f16.weight", x)
    expected["f16.weight"] = (Q.F16, dequantize(x, Q.F16))

    every_bf16 = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(256, 512)
    w.add_tensor("bf16_all.weight", every_bf16, raw_dtype=Q.BF16)
    expected["bf16_all.weight"] = (Q.BF16, dequantize(every_bf16, Q.BF16))
    q = quantize(awkward_rows(rng, 4, 64), Q.BF16)
    w.add_tensor("bf16.weight", q, raw_dtype=Q.BF16)
    expected["bf16.weight"] = (Q.BF16, dequantize(q, Q.BF16))

    for qt in QUANT_TYPES:
        # 2-D, and a 3-D tensor with several rows per plane.
        for name, shape in ((f"{qt.name.lower()}.weight", (6, 160)),
                            (f"{qt.name.lower()}_3d.weight", (2, 3, 64))):
            x = awkward_rows(rng, int(np.prod(shape[:-1])), shape[-1]).reshape(shape)
            q = quantize(x, qt)
            w.add_tensor(name, q, raw_dtype=qt)
            expected[name] = (qt, dequantize(q, qt))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("alignment", [None, 64])
def test_written_tensors(tool, tmp_path, alignment):
    path = tmp_path / "types.gguf"
    expected = write_test_file(path, alignment)
    reader = gguf.GGUFReader(path)
    types = set()
    for name, (qt, want) in expected.items():
        assert reader_tensor(reader, name).tensor_type == qt
        got = c_dequant(tool, path, name, tmp_path)
        mismatched = compare(f"{name} ({qt.name})", got, want)
        # Only NaN payloads may differ (none are compared bit-wise), so all values match.
        assert mismatched == 0, f"{name}: {mismatched} values differ in the last bits"
        types.add(qt)
    assert types == {Q.F32, Q.F16, Q.BF16, *QUANT_TYPES}
    check_listing(tool, path)


# ---- K-quants ------------------------------------------------------------------------------

# ggml type: (block bytes, offsets of the f16 scale fields, (low, high) magnitude of d / dmin)
K_TYPES = {
    Q.Q2_K: (84, {80: (1e-4, 0.5), 82: (1e-4, 0.5)}),
    Q.Q3_K: (110, {108: (1e-4, 0.5)}),
    Q.Q4_K: (144, {0: (1e-4, 0.5), 2: (1e-4, 0.5)}),
    Q.Q5_K: (176, {0: (1e-4, 0.5), 2: (1e-4, 0.5)}),
    Q.Q6_K: (210, {208: (1e-4, 0.5)}),
}


def random_k_blocks(rng, qt, n_blocks):
    """Random bytes everywhere (every quant and packed scale pattern), with the f16 scale fields
    replaced by finite values of either sign, some zero, some subnormal."""
    size, fields = K_TYPES[qt]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off, (lo, hi) in fields.items():
        mag = np.exp(rng.uniform(np.log(lo), np.log(hi), n_blocks))
        val = (mag * rng.choice([-1.0, 1.0], n_blocks)).astype(np.float16)
        val[0] = 0.0
        val[1] = np.float16(3e-6)  # subnormal half
        val[2] = np.float16(65504.0) if off in (0, 80, 108, 208) else val[2]
        raw[:, off:off + 2] = val.view(np.uint8).reshape(n_blocks, 2)
    return raw


def test_k_quants_random_blocks(tool, tmp_path):
    rng = np.random.default_rng(20251201)
    path = tmp_path / "kquants.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    expected = {}
    for qt in K_TYPES:
        # 2-D (rows of several super-blocks) and 3-D; 96 blocks of each type.
        for name, shape in ((f"{qt.name.lower()}.weight", (12, 2048)),
                            (f"{qt.name.lower()}_3d.weight", (2, 3, 4096))):
            n_blocks = int(np.prod(shape)) // 256
            raw = random_k_blocks(rng, qt, n_blocks).reshape(*shape[:-1], -1)
            w.add_tensor(name, raw, raw_dtype=qt)
            expected[name] = (qt, dequantize(raw, qt))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(path)
    for name, (qt, want) in expected.items():
        assert reader_tensor(reader, name).tensor_type == qt
        got = c_dequant(tool, path, name, tmp_path)
        assert np.isfinite(want).all(), f"{name}: the reference has non-finite values"
        mismatched = compare(f"{name} ({qt.name})", got, want)
        assert mismatched == 0, f"{name}: {mismatched} values differ in the last bits"
    check_listing(tool, path)


def test_k_quants_ggml_blocks(tool, root, tmp_path):
    """Blocks made by ggml's quantize_row_q*_K_ref, decoded as ggml's dequantize_row_q*_K
    decoded them (recorded by tests/data/gen-kquant-blocks.sh)."""
    data = root / "tests" / "data"
    path = tmp_path / "ggml_kquants.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    expected = {}
    for qt, (size, _) in K_TYPES.items():
        stem = data / f"kquant-{qt.name.lower()}"
        raw = np.fromfile(f"{stem}.blocks", dtype=np.uint8)
        want = np.fromfile(f"{stem}.f32", dtype="<f4")
        assert raw.size % size == 0 and want.size == raw.size // size * 256, stem
        raw = raw.reshape(2, -1)  # two rows of super-blocks
        w.add_tensor(f"{qt.name.lower()}.weight", raw, raw_dtype=qt)
        expected[f"{qt.name.lower()}.weight"] = (qt, want)
        # The gguf package's port agrees with ggml on these too.
        assert np.array_equal(dequantize(raw, qt).reshape(-1).view(np.uint32), want.view(np.uint32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for name, (qt, want) in expected.items():
        got = c_dequant(tool, path, name, tmp_path)
        assert np.count_nonzero(want) > want.size // 2, f"{name}: the recorded values are mostly zero"
        mismatched = compare(f"{name} ({qt.name}, ggml's blocks and values)", got, want)
        assert mismatched == 0, f"{name}: {mismatched} values differ from ggml's in the last bits"


# ---- the reader's view of keys and tensors -------------------------------------------------

def run_list(tool, path):
    r = subprocess.run([str(tool), "--list", str(path)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def hexs(b):
    return b.hex() if b else "-"


def expected_listing(path):
    reader = gguf.GGUFReader(path)
    lines = [f"version {int(reader.fields['GGUF.version'].parts[-1][0])}"]
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        vt = f.types[0]
        if vt == V.STRING:
            lines.append(f"kv {key} {int(vt)} {hexs(f.parts[f.data[0]].tobytes())}")
        elif vt == V.ARRAY:
            et = f.types[-1]
            lines.append(f"kv {key} {int(vt)} {int(et)} {len(f.data)}")
            if et == V.STRING:
                lines += [f"e {hexs(f.parts[i].tobytes())}" for i in f.data]
            else:
                lines += [("e", f.parts[i][0], et) for i in f.data]
        else:
            lines.append(("kv", key, int(vt), f.parts[f.data[0]][0], vt))
    base = reader.data_offset
    for t in reader.tensors:
        ne = list(int(n) for n in t.shape) + [1] * (4 - len(t.shape))
        lines.append(f"tensor {t.name} {int(t.tensor_type)} {len(t.shape)} "
                     + " ".join(str(n) for n in ne)
                     + f" {t.data_offset - base} {int(t.n_elements)} {int(t.n_bytes)}")
    return lines


def number_matches(text, value, vt, element):
    if vt == V.FLOAT64 and element:  # array elements print at full double precision
        return float(text) == float(value)
    if vt in (V.FLOAT32, V.FLOAT64):  # f32 values, and f64 scalars through gguf_get_f32
        return np.float32(float(text)) == np.float32(value)
    if vt == V.BOOL:
        return int(text) == int(bool(value))
    return int(text) == int(value)


def check_listing(tool, path):
    got = run_list(tool, path)
    want = expected_listing(path)
    assert len(got) == len(want), f"{path.name}: {len(got)} listing lines, expected {len(want)}"
    n_values = 0
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, str):
            assert g == w, f"{path.name} line {i}: C '{g[:200]}' vs gguf '{w[:200]}'"
        elif w[0] == "e":
            _, value, vt = w
            assert g.startswith("e ") and number_matches(g[2:], value, vt, True), \
                f"{path.name} line {i}: '{g}' vs {value}"
        else:
            _, key, vt_num, value, vt = w
            prefix = f"kv {key} {vt_num} "
            assert g.startswith(prefix) and number_matches(g[len(prefix):], value, vt, False), \
                f"{path.name} line {i}: '{g}' vs {key} = {value}"
        n_values += 1
    print(f"{path.name}: {n_values} listing lines (keys, array elements, tensors) match gguf")


def test_default_model_listing(tool, default_model):
    check_listing(tool, default_model)
