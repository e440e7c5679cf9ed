"""tests/test_gguf.c built with AddressSanitizer + UndefinedBehaviorSanitizer (build/asan) and run
with leak detection: the malformed-file suite there opens every case from an exactly-sized heap
copy, so any read past the end of a truncated or corrupted GGUF image is reported here. Also
reads the default model through the sanitized reader and dequantisation kernels."""
import os
import subprocess

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from conftest import run_make

ASAN_BUILD = "build/asan"
ENV = dict(os.environ,
           ASAN_OPTIONS="detect_leaks=1:halt_on_error=1",
           UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1")
SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error")


@pytest.fixture(scope="module")
def asan_tool(root):
    target = f"{ASAN_BUILD}/tests/test_gguf"
    r = run_make(["make", "-s", "-j2", f"BUILD={ASAN_BUILD}", target],
                 cwd=root, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, f"ASan build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return root / target


def run_sanitized(args, root):
    r = subprocess.run(args, cwd=root, env=ENV, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    for marker in SANITIZER_MARKERS:
        assert marker not in out, f"sanitizer report ({marker}):\n{out[-6000:]}"
    assert r.returncode == 0, f"{args[1:]} exited {r.returncode}:\n{out[-6000:]}"
    return r.stdout


def test_gguf_units_under_asan(asan_tool, root):
    out = run_sanitized([str(asan_tool)], root)
    print(out)
    assert "malformed:" in out and " 0 failed" in out


def test_default_model_under_asan(asan_tool, root, default_model, tmp_path):
    listing = run_sanitized([str(asan_tool), "--list", str(default_model)], root)
    assert sum(line.startswith("tensor ") for line in listing.splitlines()) == 272
    reader = gguf.GGUFReader(default_model)
    for t in reader.tensors:
        if t.name not in ("blk.0.attn_q.weight", "output_norm.weight"):
            continue
        out = tmp_path / "t.f32"
        run_sanitized([str(asan_tool), "--dump", str(default_model), t.name, str(out)], root)
        got = np.fromfile(out, dtype=np.float32)
        want = dequantize(np.asarray(t.data), t.tensor_type).reshape(-1)
        max_diff = float(np.max(np.abs(got - want)))
        print(f"{t.name} under ASan: {got.size} values, max |C - gguf| = {max_diff:.3g}")
        assert np.array_equal(got, want)
