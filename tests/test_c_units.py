"""Runs every C unit-test binary (build/tests/test_*) and fails on a non-zero exit."""
import os
import subprocess

import pytest

from conftest import BUILD, ROOT

BINARIES = sorted(p for p in (BUILD / "tests").glob("test_*") if p.is_file() and p.suffix == "")


@pytest.mark.parametrize("binary", BINARIES, ids=[b.name for b in BINARIES])
def test_c_unit(binary):
    # full scale and the default model here, whatever the shell exports (test_valgrind_units.py
    # runs reduced, test_engine on a tiny model)
    env = {k: v for k, v in os.environ.items()
           if k not in ("DIFFRAG_TEST_SCALE", "DIFFRAG_TEST_MODEL")}
    r = subprocess.run([str(binary)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1800)
    print(r.stdout)
    print(r.stderr)
    assert r.returncode == 0, f"{binary.name} exited {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"


def test_c_units_were_built():
    assert BINARIES, "no C unit tests found: run `make` first"
