"""Damaged stores (docs/retriever.md#damaged-stores): copies of a store of a few hundred
documents cut short (by 1 MiB, by half), with 20 zeroed pages in the middle, or with 200
flipped bytes (a fixed seed). `diffrag-store verify` and `collections` must report the damage
with exit status 1 (never die of SIGABRT, SIGBUS or SIGSEGV); diffragd must refuse to start on
them, naming the problem and the verify command, and never log ready; with allow_damaged_store
it serves the store read-only (reads answered, writes refused, /readyz and
diffrag_store_damaged say so), except a file cut short, which it refuses either way. A store
damaged while the daemon runs turns read-only at the first read that meets the damage."""
import json
import os
import random
import shutil
import subprocess
import time

import pytest

from conftest import BUILD, ROOT
from daemon_util import Daemon, fast_model, http_get

STORE_TOOL = BUILD / "diffrag-store"
COLL = "c1"
N_DOCS = 400
DAMAGES = ("cut_1mib", "cut_half", "zeroed_pages", "flipped_bytes")
WORDS = ("river mountain city capital sea alps danube rhine paris vienna forest lake valley "
         "bridge castle tower market harbor island desert").split()


def store_tool(data, *args):
    return subprocess.run([str(STORE_TOOL), "--data-dir", str(data), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def sound_store(tmp_path_factory):
    d = tmp_path_factory.mktemp("sound")
    rnd = random.Random(1)
    with open(d / "docs.jsonl", "w", encoding="utf-8") as f:
        for i in range(N_DOCS):
            text = " ".join(rnd.choice(WORDS) + str(rnd.randrange(50))
                            for _ in range(rnd.randrange(200, 600)))
            f.write(json.dumps({"id": "doc-%04d" % i, "title": "Doc %d" % i, "text": text}) + "\n")
    r = store_tool(d / "store", "-c", COLL, "ingest", "--approx-tokens", str(d / "docs.jsonl"))
    assert r.returncode == 0, r.stderr
    r = store_tool(d / "store", "verify")
    assert r.returncode == 0 and " 0 problems" in r.stdout, r.stdout + r.stderr
    size = os.path.getsize(d / "store" / "data.mdb")
    assert size > 2 << 20, size      # room to cut 1 MiB and still hold the meta pages
    return d / "store"


def damage(sound, dest, kind):
    """A copy of the sound store with one kind of damage; returns its directory."""
    shutil.copytree(sound, dest)
    path = dest / "data.mdb"
    size = os.path.getsize(path)
    if kind == "cut_1mib":
        os.truncate(path, size - (1 << 20))
    elif kind == "cut_half":
        os.truncate(path, size // 2)
    elif kind == "zeroed_pages":
        with open(path, "r+b") as f:
            f.seek((size // 4096 // 2 - 10) * 4096)
            f.write(b"\0" * 20 * 4096)
    elif kind == "flipped_bytes":
        rnd = random.Random(22)
        data = bytearray(path.read_bytes())
        for _ in range(200):
            i = rnd.randrange(2 * 4096, len(data))     # past the two meta pages
            data[i] ^= 1 << rnd.randrange(8)
        path.write_bytes(data)
    else:
        raise ValueError(kind)
    return dest


@pytest.mark.parametrize("kind", DAMAGES)
def test_tool_reports_damage(sound_store, tmp_path, kind):
    data = damage(sound_store, tmp_path / "store", kind)
    v = store_tool(data, "verify")
    print(kind, "verify:", v.returncode, v.stdout.strip(), v.stderr.strip()[-600:])
    assert v.returncode == 1, (v.returncode, v.stdout, v.stderr)
    assert "diffrag-store: " in v.stderr and "ok\n" not in v.stdout
    c = store_tool(data, "collections")
    print(kind, "collections:", c.returncode, c.stdout.strip(), c.stderr.strip()[-300:])
    if kind.startswith("cut"):
        # both figures: what the file holds, what its meta page needs
        size = os.path.getsize(data / "data.mdb")
        for p in (v, c):
            assert p.returncode == 1 and "cut short" in p.stderr, p.stderr
            assert "holds %d bytes" % size in p.stderr and "%d bytes" % os.path.getsize(
                sound_store / "data.mdb") in p.stderr, p.stderr
    else:
        # collections reads only the collection records: it may succeed, but never crash
        assert c.returncode in (0, 1), (c.returncode, c.stderr)
        assert "problem" in v.stderr or "damaged" in v.stderr, v.stderr


def test_verify_turns_an_lmdb_abort_into_a_finding(sound_store, tmp_path):
    """The zeroed pages make LMDB's cursor assert (IS_LEAF) in this layout: the walk runs in a
    child process, whose death is reported."""
    data = damage(sound_store, tmp_path / "store", "zeroed_pages")
    v = store_tool(data, "verify")
    if "signal" not in v.stderr:
        pytest.skip("the zeroed pages did not make LMDB abort in this layout: %s" % v.stderr[-300:])
    assert v.returncode == 1 and "LMDB aborted while reading it (signal 6)" in v.stderr, v.stderr
    assert "1 problems" in v.stdout, v.stdout


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fast_model(tmp_path_factory.mktemp("models"))


def run_to_exit(d, timeout=60.0):
    """Starts diffragd, which must exit on its own: (exit status, log)."""
    try:
        d.start(wait_ready=False)
        try:
            rc = d.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("diffragd kept running on a damaged store:\n" + d.log_text()[-3000:])
        return rc, d.log_text()
    finally:
        d.__exit__(None, None, None)


@pytest.mark.parametrize("kind", DAMAGES)
def test_daemon_refuses_damaged_store(sound_store, model, tmp_path, kind):
    data = damage(sound_store, tmp_path / "store", kind)
    rc, log = run_to_exit(Daemon(tmp_path, model, workers=1, data_dir=data))
    print(kind, "exit", rc, log[-1500:])
    assert rc == 1, (rc, log[-3000:])
    assert 'msg="ready"' not in log and "listening" not in log, log[-3000:]
    line = next((l for l in log.splitlines() if "the store is damaged; not starting" in l), None)
    assert line is not None, log[-3000:]
    assert "diffrag-store --data-dir %s verify" % data in line, line
    if kind.startswith("cut"):
        assert "cut short" in line and "allow_damaged_store" not in line, line


def test_daemon_allow_damaged_store_serves_read_only(sound_store, model, tmp_path):
    data = damage(sound_store, tmp_path / "store", "flipped_bytes")
    d = Daemon(tmp_path, model, workers=1, data_dir=data, allow_damaged_store=1)
    with d:
        log = d.log_text()
        assert "the store is damaged; serving it read-only (allow_damaged_store)" in log, log[-3000:]
        status, body = http_get(d.metrics_url + "/readyz")
        assert status == 200 and "store: read-only (damaged)" in body, (status, body)
        assert d.metric("diffrag_store_damaged") == 1
        c = d.client()
        _, r = c.call({"v": 1, "op": "list", "id": 1})
        assert r["ok"] and r["collections"] == [COLL], r
        _, r = c.call({"v": 1, "op": "ingest", "id": 2, "collection": COLL,
                       "docs": [{"id": "new", "text": "A new document."}]})
        assert r["ok"] is False and r["error"]["code"] == "internal", r
        msg = r["error"]["message"]
        assert "read-only" in msg and "diffrag-store --data-dir %s verify" % data in msg, msg
        _, r = c.call({"v": 1, "op": "delete", "id": 3, "collection": COLL, "ids": ["doc-0001"]})
        assert r["ok"] is False and "read-only" in r["error"]["message"], r
        assert d.stop() == 0, d.log_text()[-2000:]


def test_daemon_refuses_a_short_file_even_when_allowed(sound_store, model, tmp_path):
    data = damage(sound_store, tmp_path / "store", "cut_1mib")
    rc, log = run_to_exit(Daemon(tmp_path, model, workers=1, data_dir=data, allow_damaged_store=1))
    assert rc == 1 and "cut short" in log and 'msg="ready"' not in log, (rc, log[-3000:])


def test_damage_at_run_time_turns_the_store_read_only(sound_store, model, tmp_path):
    """A document record made malformed while the daemon runs (its header's title length, found
    by the record's bytes: LMDB maps the file, so the daemon reads the change at once)."""
    data = tmp_path / "store"
    shutil.copytree(sound_store, data)
    d = Daemon(tmp_path, model, workers=1, data_dir=data)
    with d:
        c = d.client()
        _, r = c.call({"v": 1, "op": "get", "id": 1, "collection": COLL, "doc_id": "doc-0123"})
        assert r["ok"], r
        assert d.metric("diffrag_store_damaged") == 0
        assert http_get(d.metrics_url + "/readyz")[1].strip() == "ready"
        doc = r["doc"]
        record = (doc["title"] + doc["text"]).encode()
        raw = (data / "data.mdb").read_bytes()
        at = raw.find(record)
        assert at >= 24 and raw.find(record, at + 1) < 0, at
        with open(data / "data.mdb", "r+b") as f:
            f.seek(at - 24 + 8)              # DocHeader.title_len
            f.write((0x7FFFFFFF).to_bytes(4, "little"))
        _, r = c.call({"v": 1, "op": "get", "id": 2, "collection": COLL, "doc_id": "doc-0123"})
        assert r["ok"] is False and r["error"]["code"] == "internal", r
        # reads of sound records go on; writes are refused
        _, r = c.call({"v": 1, "op": "get", "id": 3, "collection": COLL, "doc_id": "doc-0001"})
        assert r["ok"], r
        _, r = c.call({"v": 1, "op": "ingest", "id": 4, "collection": COLL,
                       "docs": [{"id": "new", "text": "A new document."}]})
        assert r["ok"] is False and "read-only" in r["error"]["message"], r
        status, body = http_get(d.metrics_url + "/readyz")
        assert status == 200 and "store: read-only (damaged)" in body, (status, body)
        assert d.metric("diffrag_store_damaged") == 1
        time.sleep(0.1)
        log = d.log_text()
        assert log.count("the store is damaged: serving it read-only from now on") == 1, log[-3000:]
        assert "diffrag-store --data-dir %s verify" % data in log
        assert d.stop() == 0, d.log_text()[-2000:]


def patch_text(data, doc, at, byte):
    """Sets byte `at` of a stored document's text in the data file (LMDB maps the file, so a
    running daemon reads the change at once)."""
    record = (doc["title"] + doc["text"]).encode()
    raw = (data / "data.mdb").read_bytes()
    pos = raw.find(record)
    assert pos >= 24 and raw.find(record, pos + 1) < 0, pos
    with open(data / "data.mdb", "r+b") as f:
        f.seek(pos + len(doc["title"].encode()) + at)
        f.write(bytes([byte]))


def test_damaged_documents_are_never_served(sound_store, model, tmp_path):
    """With allow_damaged_store, a document whose text changed under the store (one letter:
    still UTF-8; or a byte that is not UTF-8, as the audit found) is refused by get, by a query
    that would place it whole and by a search that finds its chunk, each with `internal` and a
    message naming the document; other documents are served, and no reply carries bytes that
    are not UTF-8 (the client decodes every string)."""
    data = tmp_path / "store"
    shutil.copytree(sound_store, data)
    d = Daemon(tmp_path, model, workers=1, data_dir=data, allow_damaged_store=1)
    with d:
        c = d.client()
        docs = {}
        for i, name in enumerate(("doc-0123", "doc-0200", "doc-0001")):
            _, r = c.call({"v": 1, "op": "get", "id": i, "collection": COLL, "doc_id": name})
            assert r["ok"], r
            docs[name] = r["doc"]
        patch_text(data, docs["doc-0123"], 3, ord("Q") if docs["doc-0123"]["text"][3] != "Q"
                   else ord("R"))
        patch_text(data, docs["doc-0200"], 5, 0xFF)
        for i, name in enumerate(("doc-0123", "doc-0200")):
            _, r = c.call({"v": 1, "op": "get", "id": 10 + i, "collection": COLL,
                           "doc_id": name})
            print(r)
            assert r["ok"] is False and r["error"]["code"] == "internal", r
            msg = r["error"]["message"]
            assert 'document "%s" in collection "%s" is damaged' % (name, COLL) in msg, msg
            assert "diffrag-store --data-dir %s verify" % data in msg, msg
            # a query that reads it whole
            _, q = c.call({"v": 1, "op": "query", "id": 20 + i, "question": "What is it about?",
                           "collection": COLL, "ids": [name], "max_tokens": 2})
            assert q["ok"] is False and name in q["error"]["message"], q
            # a search whose hits are its chunks (its own rare words)
            words = " ".join(docs[name]["text"].split()[:3])
            _, q = c.call({"v": 1, "op": "query", "id": 30 + i, "question": words,
                           "collection": COLL, "ids": [name], "top_k": 4, "max_tokens": 2})
            assert q["ok"] is False and name in q["error"]["message"], q
        # a sound document is served, whole and through a search
        _, r = c.call({"v": 1, "op": "get", "id": 40, "collection": COLL, "doc_id": "doc-0001"})
        assert r["ok"] and r["doc"]["text"] == docs["doc-0001"]["text"], r
        _, q = c.call({"v": 1, "op": "query", "id": 41, "question": "What is it about?",
                       "collection": COLL, "ids": ["doc-0001"], "max_tokens": 2})
        assert q["ok"], q
        _, q = c.call({"v": 1, "op": "query", "id": 42, "top_k": 3,
                       "question": " ".join(docs["doc-0001"]["text"].split()[:3]),
                       "collection": COLL, "ids": ["doc-0001"], "max_tokens": 2})
        assert q["ok"], q
        assert d.metric("diffrag_store_damaged") == 1
        assert d.stop() == 0, d.log_text()[-2000:]
    v = store_tool(data, "verify")
    assert v.returncode == 1 and "doc-0123" in v.stdout + v.stderr, v.stdout + v.stderr
