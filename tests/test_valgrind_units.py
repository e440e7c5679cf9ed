"""The C unit tests under valgrind memcheck: no invalid read or write, no use of uninitialised
memory, no definitely lost block (--error-exitcode, --leak-check=full). They are built for
valgrind in build/valgrind (AVX2 at most: valgrind does not decode AVX-512; the kernels pick
their vector path at run time from what the CPU, here valgrind's, reports).

Every functional check must still pass; checks of speed (a FAIL line that states a time) are
expected to fail at valgrind's 20-50x slowdown and are listed instead.

valgrind runs one thread at a time; --fair-sched=yes hands the time slices round in turn. Without
it, threads that never block take nearly every slice and starve the one that does the work:
test_store's two reader threads held its writer back for minutes (the whole binary took over
8 minutes instead of about 2, and over 40 on a slower 2-core machine).

DIFFRAG_TEST_SCALE=small is set for every binary: test_store then runs its context assembly
over the first 300 SQuAD passages with budgets up to 16,384 tokens instead of 1,216 passages and
131,072 tokens (the same checks; it prints that it runs reduced); test_quote walks over 12
random documents instead of 60, and test_lookup fills the context and reaches max_tokens at
every ninth size instead of every third. The native run under `make test` (test_c_units.py)
stays at full scale.

test_engine runs on a tiny random model (DIFFRAG_TEST_MODEL; 4 layers of width 64, a context of
131,072 for its budget check): valgrind emulates every FMA instruction through a helper, so
a single decode step of the default 135M model takes it about 15 s, and the whole binary on
that model over 40 minutes. On the tiny model it takes seconds; `make test` runs it on the
default model natively and under ASan (test_c_units.py).

Two binaries take a minute or more under valgrind and run only when named in
DIFFRAG_VALGRIND_EXTRA (comma-separated, or `all`): test_store and test_kernels (80 and 60 s on
a current x86 core; the CI runs them). Each run is stopped after 20 minutes, which only a hang
reaches."""
import os
import re
import subprocess

import pytest

from conftest import ROOT, run_make
from engine_util import gen_tiny

VG_BUILD = "build/valgrind"
SLOW = ["test_kernels", "test_store"]
ALL = sorted(p.stem for p in (ROOT / "tests").glob("test_*.c"))
EXTRA = os.environ.get("DIFFRAG_VALGRIND_EXTRA", "").split(",")
SELECTED = [t for t in ALL if t not in SLOW or t in EXTRA or "all" in EXTRA]
TIMING = re.compile(r"\d\s*(ns|us|µs|ms|s)\b|per second|/s\b|takes|faster|slower")
VG_ERROR = re.compile(r"^==\d+== .*(Invalid|uninitialised|Uninitialised|definitely lost|"
                      r"Mismatched|overlap|Syscall param)", re.M)


@pytest.fixture(scope="module")
def vg_build():
    # test_sampler loads the host emulation of the GPU table from beside itself
    targets = ["%s/tests/%s" % (VG_BUILD, t) for t in SELECTED]
    targets.append("%s/tests/libdiffrag_hostgpu.so" % VG_BUILD)
    r = run_make(["make", "-s", "-j2", "BUILD=" + VG_BUILD, "ARCH=-march=x86-64-v3", "OPT=-O1",
                  *targets], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return ROOT / VG_BUILD / "tests"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return gen_tiny(tmp_path_factory.mktemp("vg") / "tiny.gguf", "--layers", "4", "--dim", "64",
                    "--heads", "2", "--kv-heads", "2", "--ffn", "128", "--vocab", "512",
                    "--ctx", "131072", "--seed", "9")


@pytest.mark.parametrize("name", SELECTED)
def test_unit_under_memcheck(vg_build, tiny_model, name):
    env = dict(os.environ, DIFFRAG_TEST_SCALE="small", DIFFRAG_TEST_MODEL=str(tiny_model))
    r = subprocess.run(["valgrind", "-q", "--fair-sched=yes", "--error-exitcode=99", "--leak-check=full",
                        "--errors-for-leak-kinds=definite", "--show-leak-kinds=definite",
                        str(vg_build / name)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200)
    out = r.stdout + r.stderr
    errors = VG_ERROR.findall(r.stderr)
    fails = [l for l in out.splitlines() if l.startswith("FAIL")]
    timing = [l for l in fails if TIMING.search(l)]
    print("%s under memcheck%s: exit %d, %d valgrind reports, %d failed checks (%d of them timing: %s)"
          % (name, " (reduced scale)" if "reduced scale" in out else "", r.returncode, len(errors),
             len(fails), len(timing), timing[:3]))
    assert r.returncode != 99 and not errors, r.stderr[-6000:]
    assert fails == timing, [l for l in fails if l not in timing]
    assert r.returncode == 0 or (fails and fails == timing), out[-3000:]
