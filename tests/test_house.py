"""The house rules (tools/check-house.py): the tree keeps them, and small trees that break one
fail, naming the file: a C file outside tests/ over 900 lines, and any file that reads the
`shared` folder beside a checkout, which a user's clone does not have."""
import subprocess
import sys

from conftest import ROOT

SCRIPT = ROOT / "tools" / "check-house.py"


def run(root):
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True,
                          text=True, timeout=120)


def test_tree_keeps_the_house_rules():
    r = run(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout == ""


def c_file(n):
    return "".join("int x%d;\n" % i for i in range(n))


def test_a_long_c_file_fails_outside_tests_only(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "model" / "ok.c").write_text(c_file(900))
    (tmp_path / "tests" / "test_big.c").write_text(c_file(2000))
    assert run(tmp_path).returncode == 0
    (tmp_path / "model" / "big.c").write_text(c_file(901))
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "big.cu").write_text(c_file(950))
    r = run(tmp_path)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        "kernels/big.cu: 950 lines, over 900: split it by concern",
        "model/big.c: 901 lines, over 900: split it by concern"], r.stdout


def test_reading_the_shared_folder_fails(tmp_path):
    up = "/".join(["..", "shared"])   # not a constant, so no compiled file holds the path
    (tmp_path / "tests").mkdir()
    (tmp_path / "tools").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text('DATA = ROOT.parent / "sha' + 'red" / "data"\n')
    (tmp_path / "tools" / "x.mk").write_text("ARGS := --passages %s/data/p.jsonl\n" % up)
    (tmp_path / "tests" / "test_y.c").write_text('#define P "%s/data/p.jsonl"\n' % up)
    r = run(tmp_path)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert [l.split(":")[0] for l in lines] == ["tests/test_x.py", "tests/test_y.c", "tools/x.mk"], r.stdout
    assert all("reads outside the repository" in l for l in lines)
    (tmp_path / "tests" / "test_x.py").write_text('DATA = ROOT / "tests" / "data"\n')
    (tmp_path / "tools" / "x.mk").unlink()
    (tmp_path / "tests" / "test_y.c").unlink()
    assert run(tmp_path).returncode == 0


def test_make_test_shows_the_report_header():
    # the header names the build and DIFFRAG_TEST_SCALE (tests/conftest.py), which the README
    # tells a reader to look at; pytest's -q would hide it
    r = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [l for l in r.stdout.splitlines() if "-m pytest" in l]
    assert len(lines) == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert " -q" not in lines[0].split("-m pytest", 1)[1], lines[0]


def test_the_daemon_asks_the_planner(tmp_path):
    # placement is the context planner's (retriever/planner.c): a daemon file that lays out a
    # prompt itself fails; the retriever, tests and benchmarks may call the layout
    for d in ("daemon", "retriever", "tests", "bench"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "x.c").write_text("int f(void) { return ctx_assemble (0, 0); }\n")
    r = run(tmp_path)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        "daemon/x.c: calls ctx_assemble: ask the context planner (retriever/planner.h)"], r.stdout
