"""The one Unicode table (text/unicode_tables.h) is what tools/gen-unicode-tables.py generates,
and the generator refuses a Python whose Unicode version is not the pinned one."""
import subprocess
import sys
import unicodedata

import pytest

from conftest import ROOT

GEN = ROOT / "tools" / "gen-unicode-tables.py"


@pytest.mark.skipif(unicodedata.unidata_version != "14.0.0",
                    reason="this Python's unicodedata is not Unicode 14.0.0")
def test_committed_tables_match_the_generator():
    r = subprocess.run([sys.executable, str(GEN), "--check"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = (ROOT / "text" / "unicode_tables.h").read_text().count("\n")
    assert lines <= 900, f"{lines} lines"


def test_generator_refuses_another_unicode_version(tmp_path):
    # Run the generator as a script with unicodedata reporting another version: it must stop
    # before writing anything.
    code = ("import runpy, sys, unicodedata\n"
            "unicodedata.unidata_version = '15.0.0'\n"
            f"sys.argv = [{str(GEN)!r}]\n"
            f"runpy.run_path({str(GEN)!r}, run_name='__main__')\n")
    before = (ROOT / "text" / "unicode_tables.h").read_bytes()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "pinned to 14.0.0" in r.stderr
    assert (ROOT / "text" / "unicode_tables.h").read_bytes() == before
