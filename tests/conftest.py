"""Shared pytest fixtures: paths to the build, the default model and the evaluation data."""
import importlib.util
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = ROOT / os.environ.get("BUILD", "build")
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

# DIFFRAG_TEST_SCALE=small: the suites that spend minutes in the models' arithmetic run the same
# checks over shorter inputs or fewer questions (each says so in its output). Unset, the scale
# follows the processor: full where the prefill products run on AVX-512 VNNI (the machines the
# full suite was sized on: about 18 minutes on 2 cores), small elsewhere, where the same
# arithmetic is 10 to 20 times slower (an AVX2 processor: over an hour at full scale, past what
# CI allows). .ci/run sets small for the pass against the sanitizer build. The scale is in the
# report's header and reaches the C check programs through the environment.
def _vnni():
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and " avx512_vnni" in line for line in f)
    except OSError:
        return False


TEST_SCALE = os.environ.get("DIFFRAG_TEST_SCALE") or ""
SCALE_WHY = "set"
if not TEST_SCALE:
    TEST_SCALE, SCALE_WHY = ("full", "chosen: AVX-512 VNNI here") if _vnni() else \
        ("small", "chosen: no AVX-512 VNNI here; DIFFRAG_TEST_SCALE=full runs everything whole")
if TEST_SCALE not in ("full", "small"):
    raise SystemExit('DIFFRAG_TEST_SCALE=%s: expected "small" or "full"' % TEST_SCALE)
os.environ["DIFFRAG_TEST_SCALE"] = TEST_SCALE
SMALL = TEST_SCALE == "small"



def load_tool(filename):
    """A program of tools/ (its file name has dashes, so it cannot be imported by name) as a
    module, for the tests that drive its functions."""
    name = filename.removesuffix(".py").replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / filename)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# SQuAD 2.0 (dev, CC BY-SA 4.0), shipped compressed in tests/data/squad2/ and unpacked here once,
# before any test runs: the C unit tests (test_store) read the plain files as well.
SQUAD_DIR = load_tool("squad_data.py").squad_dir()


def offline_venv(path):
    """A fresh virtual environment at `path` that sees this interpreter's packages (pip, pyzmq,
    msgpack...) through a .pth file, whichever interpreter runs the tests (the project's .venv,
    whose base python3 may be Debian's without them, or any other): `pip install` of the
    in-tree client package then needs nothing from an index. Returns its python."""
    import site
    import subprocess
    import sys
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    py = pathlib.Path(path) / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (pathlib.Path(purelib) / "_tests_parent.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return py


def run_make(argv, **kw):
    """subprocess.run of a make command, one at a time across the workers of a parallel run
    (`make test` runs pytest-xdist): two makes building the same tree at once would write the
    same objects. The lock is a file in build/; the wait does not count against kw's timeout."""
    import fcntl
    import subprocess
    lock = ROOT / "build" / ".tests-make.lock"
    lock.parent.mkdir(exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        return subprocess.run(argv, **kw)


def asan_built(program):
    """Whether a program of the build under test carries AddressSanitizer (BUILD=build/asan)."""
    return b"__asan_init" in program.read_bytes()


def pytest_report_header(config):
    return "diffrag: BUILD=%s, DIFFRAG_TEST_SCALE=%s (%s)" % (BUILD, TEST_SCALE, SCALE_WHY)


@pytest.fixture(scope="session")
def root():
    return ROOT


@pytest.fixture(scope="session")
def build_dir():
    return BUILD


@pytest.fixture(scope="session")
def default_model():
    if not DEFAULT_MODEL.exists():
        pytest.fail(f"default model missing: run `make model` ({DEFAULT_MODEL})")
    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def squad_dir():
    return SQUAD_DIR
