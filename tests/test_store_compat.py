"""A store written by an earlier build (tests/data/store-fixture) opens with today's
diffrag-store, verifies, and answers every recorded search exactly as the code that wrote it:
the terms in existing stores must not move when the text layer changes. The one recorded
question that holds question words ("How is ...?") is asked since without them
(docs/retriever.md), so it is checked to answer exactly as its words without them do."""
import gzip
import json
import re
import shutil
import subprocess

import pytest

from conftest import ROOT
from ref.bm25_ref import QUESTION_WORDS, tokenize

FIXTURE = ROOT / "tests" / "data" / "store-fixture"


@pytest.fixture(scope="module")
def old_store(tmp_path_factory, build_dir):
    d = tmp_path_factory.mktemp("old-store")
    with gzip.open(FIXTURE / "data.mdb.gz", "rb") as src, open(d / "data.mdb", "wb") as dst:
        shutil.copyfileobj(src, dst)
    return d


def store_tool(build_dir, store, *args):
    return subprocess.run([str(build_dir / "diffrag-store"), "--data-dir", str(store), *args],
                          capture_output=True, text=True, timeout=120)


def test_old_store_verifies(build_dir, old_store):
    r = store_tool(build_dir, old_store, "verify")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 collections, 28 documents, 186 chunks" in r.stdout + r.stderr
    assert " 0 problems" in r.stdout + r.stderr


def test_old_store_same_answers(build_dir, old_store):
    expected = [json.loads(line) for line in (FIXTURE / "expected.jsonl").read_text().splitlines()]
    checked = differ = questions = 0
    for e in expected:
        coll = e["collection"]
        if "stats" in e:
            r = store_tool(build_dir, old_store, "-c", coll, "stats", "--json")
            assert r.returncode == 0, r.stderr
            got = json.loads(r.stdout)
            got.pop("map_bytes", None)
            assert got == e["stats"], coll
            continue
        r = store_tool(build_dir, old_store, "-c", coll, "search", "--json", "-k", "10", e["query"])
        assert r.returncode == 0, r.stderr
        hits = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
        words = tokenize(e["query"])
        if any(w in QUESTION_WORDS for w in words):
            rest = " ".join(w for w in words if w not in QUESTION_WORDS)
            r = store_tool(build_dir, old_store, "-c", coll, "search", "--json", "-k", "10", rest)
            assert r.returncode == 0 and rest, r.stderr
            again = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
            assert hits and again == hits, (e["query"], rest)
            questions += 1
            continue
        got = [{k: h[k] for k in ("rank", "doc_id", "chunk", "chunk_id", "byte_start", "byte_end")}
               for h in hits]
        want = [{k: h[k] for k in ("rank", "doc_id", "chunk", "chunk_id", "byte_start", "byte_end")}
                for h in e["hits"]]
        if got != want or any(abs(h["score"] - w["score"]) > 1e-5 * max(1.0, abs(w["score"]))
                              for h, w in zip(hits, e["hits"])):
            differ += 1
            print("differs: %s %r\n  got  %s\n  want %s" % (coll, e["query"], hits, e["hits"]))
        checked += 1
    print("old store: %d searches checked, %d differ; %d questions asked without their question "
          "words" % (checked, differ, questions))
    assert checked == 58 and questions == 2
    assert differ == 0


def test_old_store_without_checksums(build_dir, tmp_path):
    """The fixture predates document checksums (schema 3): opened, it is upgraded in place; its
    documents are served and verify passes, saying how many predate checksums; a document
    ingested since (new, or replacing an old one) has one; an old document whose text is no
    longer UTF-8 is refused by get and found by verify, though it has no checksum."""
    store = tmp_path / "old"
    store.mkdir()
    with gzip.open(FIXTURE / "data.mdb.gz", "rb") as src, open(store / "data.mdb", "wb") as dst:
        shutil.copyfileobj(src, dst)
    r = store_tool(build_dir, store, "verify")
    assert r.returncode == 0 and " 0 problems" in r.stdout, r.stdout + r.stderr
    assert "verify: 28 documents predate checksums" in r.stdout, r.stdout
    r = store_tool(build_dir, store, "-c", "default", "get", "de-1")
    assert r.returncode == 0, r.stderr
    old = json.loads(r.stdout)
    new = tmp_path / "src"
    new.mkdir()
    (new / "note.txt").write_text("A note written after the upgrade.\n")
    r = store_tool(build_dir, store, "-c", "default", "ingest", "--approx-tokens", str(new))
    assert r.returncode == 0, r.stderr
    line = json.dumps({"id": "de-1", "title": old["title"], "text": old["text"] + " Neu."})
    (tmp_path / "de.jsonl").write_text(line + "\n")
    r = store_tool(build_dir, store, "-c", "default", "ingest", "--approx-tokens",
                   str(tmp_path / "de.jsonl"))
    assert r.returncode == 0, r.stderr
    r = store_tool(build_dir, store, "verify")
    assert r.returncode == 0 and "29 documents" in r.stdout and " 0 problems" in r.stdout, r.stdout
    assert "verify: 27 documents predate checksums" in r.stdout, r.stdout
    # an old record damaged: a byte of its text that is not UTF-8 (in both collections)
    r = store_tool(build_dir, store, "-c", "default", "get", "ru-1")
    ru = json.loads(r.stdout)
    record = (ru["title"] + ru["text"]).encode()
    raw = (store / "data.mdb").read_bytes()
    at = [m.start() for m in re.finditer(re.escape(record), raw)]   # live and freed pages
    assert len(at) >= 2, at
    with open(store / "data.mdb", "r+b") as f:
        for i in at:
            f.seek(i + len(ru["title"].encode()) + 1)
            f.write(b"\xff")
    r = store_tool(build_dir, store, "-c", "default", "get", "ru-1")
    assert r.returncode == 1 and 'document "ru-1" in collection "default" is damaged' in r.stderr
    assert "not valid UTF-8" in r.stderr, r.stderr
    r = store_tool(build_dir, store, "verify")
    assert r.returncode == 1 and "problems" in r.stdout, r.stdout + r.stderr


def test_old_store_takes_heading_paths(build_dir, tmp_path):
    """Upgraded, the old store's chunks have no heading path (their hits say so) and are found
    as before (the scores move with the collection's statistics); a Markdown document ingested since is chunked at its headings, its chunks carry
    their paths (found by them, given with their hits), and verify passes over the mix, also
    after that document is replaced and deleted."""
    store = tmp_path / "old"
    store.mkdir()
    with gzip.open(FIXTURE / "data.mdb.gz", "rb") as src, open(store / "data.mdb", "wb") as dst:
        shutil.copyfileobj(src, dst)
    r = store_tool(build_dir, store, "-c", "default", "search", "--json", "-k", "5", "KV cache budget")
    assert r.returncode == 0, r.stderr
    old_hits = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    assert old_hits and all(h["heading"] == "" for h in old_hits), old_hits
    src = tmp_path / "src"
    src.mkdir()
    (src / "guide.md").write_text("# Guide\n\nWhat this guide covers.\n\n## Zymurgy\n\n"
                                  "Brewing is a craft. It takes time.\n\n## Storage\n\nKeep it cool.\n")
    r = store_tool(build_dir, store, "-c", "default", "ingest", "--approx-tokens", str(src))
    assert r.returncode == 0, r.stderr
    r = store_tool(build_dir, store, "verify")
    assert r.returncode == 0 and " 0 problems" in r.stdout, r.stdout + r.stderr
    r = store_tool(build_dir, store, "-c", "default", "search", "--json", "-k", "5", "zymurgy")
    hits = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    assert [(h["doc_id"], h["chunk"], h["heading"]) for h in hits] == [("src/guide.md", 1, "Zymurgy")]
    assert hits[0]["text"].startswith("## Zymurgy\n") and hits[0]["text"].endswith("It takes time.")
    r = store_tool(build_dir, store, "-c", "default", "search", "--json", "-k", "5", "KV cache budget")
    again = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    key = ("doc_id", "chunk", "byte_start", "byte_end", "heading", "text")
    assert [again[0][k] for k in key] == [old_hits[0][k] for k in key]
    assert all(h["heading"] == "" for h in again)
    (src / "guide.md").write_text("# Guide\n\n## Cellar\n\nKeep it cool.\n")
    r = store_tool(build_dir, store, "-c", "default", "ingest", "--approx-tokens", str(src))
    assert r.returncode == 0, r.stderr
    r = store_tool(build_dir, store, "-c", "default", "delete", "src/guide.md")
    assert r.returncode == 0, r.stderr
    r = store_tool(build_dir, store, "verify")
    assert r.returncode == 0 and " 0 problems" in r.stdout and "28 documents" in r.stdout, r.stdout
