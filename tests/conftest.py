"""Shared pytest fixtures: paths to the build, the default model and the shared data."""
import importlib.util
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = ROOT / os.environ.get("BUILD", "build")
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SHARED_DATA = ROOT.parent / "shared" / "data"

# DIFFRAG_TEST_SCALE=small: the suites that spend minutes in the default model's arithmetic run
# the same checks over shorter inputs (each says so in its output). .ci/run sets it for the
# pass against the sanitizer build, where that arithmetic is 10 times slower; `make test` runs
# everything at full scale.
TEST_SCALE = os.environ.get("DIFFRAG_TEST_SCALE") or "full"
if TEST_SCALE not in ("full", "small"):
    raise SystemExit('DIFFRAG_TEST_SCALE=%s: expected "small" or "full"' % TEST_SCALE)
SMALL = TEST_SCALE == "small"


def load_tool(filename):
    """A program of tools/ (its file name has dashes, so it cannot be imported by name) as a
    module, for the tests that drive its functions."""
    name = filename.removesuffix(".py").replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / filename)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def asan_built(program):
    """Whether a program of the build under test carries AddressSanitizer (BUILD=build/asan)."""
    return b"__asan_init" in program.read_bytes()


def pytest_report_header(config):
    return "diffrag: BUILD=%s, DIFFRAG_TEST_SCALE=%s" % (BUILD, TEST_SCALE)


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
    d = SHARED_DATA / "squad2"
    if not (d / "passages.jsonl").exists():
        pytest.fail(f"shared evaluation data missing at {d}")
    return d
