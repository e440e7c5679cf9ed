"""The layering rule (tools/check-layers.py): the tree passes, and copies of it with an upward
include, a forbidden sideways include or an include of a missing file fail, naming the file."""
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "tools" / "check-layers.py"
LAYERS = ["text", "kernels", "model", "retriever", "daemon", "clients", "tools"]


def run(root):
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True,
                          text=True, timeout=120)


def test_tree_keeps_the_layers():
    r = run(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout == ""


@pytest.fixture
def tree(tmp_path):
    for layer in LAYERS:
        shutil.copytree(ROOT / layer, tmp_path / layer,
                        ignore=shutil.ignore_patterns("*.o", "*.d", "__pycache__"))
    return tmp_path


def plant(path, line):
    text = path.read_text()
    head, _, rest = text.partition("\n#include")
    path.write_text(head + "\n" + line + "\n#include" + rest)


def test_upward_include_fails(tree):
    plant(tree / "text" / "utf8.c", '#include "model/engine.h"')
    r = run(tree)
    assert r.returncode == 1
    assert 'text/utf8.c:' in r.stdout
    assert 'text (layer 0) includes "model/engine.h" of model (layer 2)' in r.stdout
    assert len(r.stdout.splitlines()) == 1, r.stdout


def test_retriever_may_not_include_daemon(tree):
    plant(tree / "retriever" / "bm25.c", '#include "daemon/log.h"')
    r = run(tree)
    assert r.returncode == 1
    assert 'retriever/bm25.c:' in r.stdout and "daemon (layer 3)" in r.stdout


def test_clients_include_only_clients_and_text(tree):
    client = sorted((tree / "clients" / "c").glob("*.c"))[0]
    plant(client, '#include "kernels/backend.h"')
    r = run(tree)
    assert r.returncode == 1
    assert f"clients/c/{client.name}:" in r.stdout and "kernels (layer 1)" in r.stdout


def test_missing_include_fails(tree):
    plant(tree / "model" / "gguf.c", '#include "model/no_such_header.h"')
    r = run(tree)
    assert r.returncode == 1
    assert 'model/gguf.c:' in r.stdout
    assert '"model/no_such_header.h", which does not exist' in r.stdout
