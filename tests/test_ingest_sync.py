"""Ingesting again stores only what changed, and `ingest --sync` removes what is gone
(docs/cli.md#ingest): over a real diffragd on loopback with `diffrag ingest`, and on a store with
`diffrag-store ingest`. A folder ingested twice: all unchanged; then one file modified, one
deleted, one added and one that no longer reads: --sync counts each kind exactly, the search
follows, the unreadable file's old version stays, and documents of another folder and of a
.jsonl survive. The daemon's ingest reply counts added, changed and unchanged per batch. A
--sync of a file is a usage error; a --sync whose ingest fails removes nothing."""
import json
import subprocess

import pytest

from conftest import BUILD, ROOT
from daemon_util import Daemon
from test_cli import cli
from test_clients_python import tiny_model

STORE = BUILD / "diffrag-store"


def store(data, *args, cwd=ROOT):
    r = subprocess.run([str(STORE), "--data-dir", str(data), *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=120)
    print("$ diffrag-store", " ".join(map(str, args)), "->", r.returncode)
    print(r.stdout[-3000:], r.stderr[-3000:])
    return r


def search_ids(data, coll, words):
    r = store(data, "-c", coll, "search", "--json", "-k", "10", words)
    assert r.returncode == 0, r.stderr
    return {json.loads(line)["doc_id"] for line in r.stdout.splitlines() if line.strip()}


def make_tree(root):
    docs = root / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "rhine.txt").write_text("The Rhine is a European river. It is about 1,230 km long.\n")
    (docs / "paris.md").write_text("# Paris\n\nParis has 2,102,650 residents.\n")
    (docs / "sub" / "oxygen.txt").write_text("Oxygen has the atomic number 8.\n")
    (docs / "gold.txt").write_text("Gold has the atomic number 79. It does not rust.\n")
    other = root / "other"
    other.mkdir()
    (other / "tin.txt").write_text("Tin has the atomic number 50.\n")
    (root / "extra.jsonl").write_text(
        json.dumps({"id": "nile", "text": "The Nile flows north into the Mediterranean."}) + "\n" +
        json.dumps({"id": "docs/note", "text": "A note sent as JSON whose id starts like the "
                    "folder's."}) + "\n")
    return docs, other


def change_tree(docs):
    """One file modified, one deleted, one added, one made unreadable (not UTF-8)."""
    (docs / "rhine.txt").write_text("The Rhine flows into the North Sea near Rotterdam.\n")
    (docs / "sub" / "oxygen.txt").unlink()
    (docs / "zinc.txt").write_text("Zinc has the atomic number 30.\n")
    (docs / "gold.txt").write_bytes(b"Gold \xff\xfe broken\n")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("sync"), tiny_model(tmp_path_factory), workers=1)
    with d:
        yield d
        assert d.stop() == 0, d.log_text()[-2000:]


def summary(r):
    line = next(l for l in r.stdout.splitlines() if l.startswith("ingested "))
    return line[line.index(": ") + 2:line.index("; it holds")]


def test_cli_sync_over_the_daemon(daemon, tmp_path):
    docs, other = make_tree(tmp_path)
    ep = daemon.endpoint
    r = cli("ingest", "-c", "s", docs, endpoint=ep)
    assert r.returncode == 0 and summary(r) == "4 added, 0 changed, 0 unchanged, 0 removed, 0 skipped"
    r = cli("ingest", "-c", "s", other, tmp_path / "extra.jsonl", endpoint=ep)
    assert r.returncode == 0, r.stderr
    r = cli("ingest", "-c", "s", "--json", docs, endpoint=ep)
    j = json.loads(r.stdout)
    assert (j["added"], j["changed"], j["unchanged"], j["removed"]) == (0, 0, 4, 0), j
    assert j["docs"] == 7, j

    # --sync of a file: a usage error, nothing stored or removed
    (docs / "sub" / "oxygen.txt").unlink()
    r = cli("ingest", "-c", "s", "--sync", docs / "rhine.txt", endpoint=ep)
    assert r.returncode == 2 and "--sync takes folders only" in r.stderr, r.stderr
    (docs / "sub" / "oxygen.txt").write_text("Oxygen has the atomic number 8.\n")

    change_tree(docs)
    r = cli("ingest", "-c", "s", "--sync", docs, endpoint=ep)
    assert r.returncode == 0, r.stderr
    assert summary(r).startswith("1 added, 1 changed, 1 unchanged, 1 removed, 1 skipped (")
    assert "gold.txt" in summary(r) and "UTF-8" in summary(r), summary(r)
    ids = sorted(d["id"] for d in json.loads(cli("ls", "-c", "s", "--json",
                                                 endpoint=ep).stdout)["docs"])
    assert ids == ["docs/gold.txt", "docs/note", "docs/paris.md", "docs/rhine.txt",
                   "docs/zinc.txt", "nile", "other/tin.txt"], ids
    # the unreadable file's document is its old version
    g = json.loads(cli("get", "-c", "s", "--json", "docs/gold.txt", endpoint=ep).stdout)
    assert "does not rust" in g["doc"]["text"], g
    data = daemon.data_dir
    assert search_ids(data, "s", "Rotterdam") == {"docs/rhine.txt"}
    assert "docs/rhine.txt" not in search_ids(data, "s", "European")
    assert search_ids(data, "s", "zinc") == {"docs/zinc.txt"}
    assert "docs/sub/oxygen.txt" not in search_ids(data, "s", "oxygen")
    assert search_ids(data, "s", "tin") == {"other/tin.txt"}

    # --sync into a collection that nothing was stored in (every file skipped): nothing to remove
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "latin1.txt").write_bytes(b"caf\xe9\n")
    r = cli("ingest", "-c", "fresh", "--sync", lone, endpoint=ep)
    assert r.returncode == 0 and summary(r).startswith("0 added, 0 changed, 0 unchanged, 0 "
                                                       "removed, 1 skipped ("), r.stdout + r.stderr

    # the reply of the op itself, per batch
    c = daemon.client()
    _, rep = c.call({"v": 1, "op": "ingest", "collection": "s", "docs": [
        {"id": "nile", "text": "The Nile flows north into the Mediterranean."},
        {"id": "docs/note", "text": "Another text."},
        {"id": "amazon", "text": "The Amazon carries the most water."}]})
    assert rep["ok"] and (rep["added"], rep["changed"], rep["unchanged"]) == (1, 1, 1), rep
    assert rep["ingested"] == 3 and rep["docs"] == 8, rep


def test_store_sync(tmp_path):
    docs, other = make_tree(tmp_path)
    data = tmp_path / "store"
    r = store(data, "-c", "s", "ingest", "--approx-tokens", docs, other, tmp_path / "extra.jsonl")
    assert r.returncode == 0 and "7 added, 0 changed, 0 unchanged, 0 removed" in r.stderr
    r = store(data, "-c", "s", "ingest", "--approx-tokens", "--sync", docs)
    assert r.returncode == 0 and "0 added, 0 changed, 4 unchanged, 0 removed, 0 skipped" in r.stderr
    change_tree(docs)
    # an ingest that fails (a malformed .jsonl line in the folder) removes nothing
    (docs / "bad.jsonl").write_text("{not json\n")
    r = store(data, "-c", "s", "ingest", "--approx-tokens", "--sync", docs)
    assert r.returncode == 1 and "0 removed" in r.stderr, r.stderr
    r = store(data, "-c", "s", "get", "docs/sub/oxygen.txt")
    assert r.returncode == 0 and "atomic number 8" in r.stdout
    (docs / "bad.jsonl").unlink()
    # given as "." from inside the folder: the same prefix, the same ids
    r = store(data, "-c", "s", "ingest", "--approx-tokens", "--sync", ".", cwd=docs)
    assert r.returncode == 0, r.stderr
    assert "1 added, 1 changed, 1 unchanged, 1 removed, 1 skipped (" in r.stderr, r.stderr
    r = store(data, "-c", "s", "list")
    assert r.stdout.split() == ["docs/gold.txt", "docs/note", "docs/paris.md", "docs/rhine.txt",
                                "docs/zinc.txt", "nile", "other/tin.txt"], r.stdout
    r = store(data, "-c", "s", "get", "docs/gold.txt")
    assert "does not rust" in json.loads(r.stdout)["text"]
    assert search_ids(data, "s", "Rotterdam") == {"docs/rhine.txt"}
    r = store(data, "verify")
    assert r.returncode == 0 and " 0 problems" in r.stdout, r.stdout
    r = store(data, "-c", "s", "ingest", "--approx-tokens", "--sync", docs / "zinc.txt")
    assert r.returncode == 2 and "--sync takes folders only" in r.stderr, r.stderr
    r = store(data, "-c", "s", "ingest", "--approx-tokens", "--sync", "/")
    assert r.returncode == 2 and "root folder" in r.stderr, r.stderr
