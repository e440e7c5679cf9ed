"""A data directory that runs out of space: diffragd's store lives on a 3 MiB tmpfs the test
mounts. Ingests go on until one fails; that one must get an error naming the full data
directory, every document acknowledged before it must be present and whole, `diffrag-store
verify` must pass while the daemon runs, reads (get, list, a query over the collection) must
still be served, and the daemon must stop cleanly and start again on the full filesystem.
Copied to a larger filesystem, the store takes deletes and ingests again."""
import os
import random
import shutil

import pytest

from daemon_util import Daemon, fast_model, query
from faults_util import can_mount, mount_tmpfs, store_export, store_verify, umount

COLL = "full"


def fill(c, rng):
    """Ingests documents of 20-60 KiB until one is refused; returns (acked {id: text}, error)."""
    acked = {}
    for i in range(10000):
        text = " ".join(rng.choice(("ember", "harbour", "quartz", "willow", "saffron", "%d" % i))
                        for _ in range(rng.randrange(3000, 9000)))
        _, r = c.call({"v": 1, "op": "ingest", "collection": COLL, "id": i,
                       "docs": [{"id": "d%05d" % i, "text": text}]})
        if not r["ok"]:
            return acked, r
        acked["d%05d" % i] = text
    raise AssertionError("a 3 MiB filesystem never filled")


def test_data_dir_out_of_space(tmp_path):
    if not can_mount():
        pytest.skip("not root: cannot mount a small filesystem for the data directory")
    mnt = tmp_path / "small"
    why = mount_tmpfs(mnt, "3m")
    if why:
        pytest.skip(why)
    model = fast_model(tmp_path)
    data_dir = mnt / "store"
    rng = random.Random(5)
    try:
        d = Daemon(tmp_path, model, workers=1, threads=1, data_dir=data_dir)
        with d:
            c = d.client()
            acked, refused = fill(c, rng)
            err = refused["error"]
            st = os.statvfs(mnt)
            print("\n%d documents acknowledged, then: %s (%s); %d KiB free"
                  % (len(acked), err["code"], err["message"], st.f_bavail * st.f_frsize // 1024))
            assert len(acked) >= 5
            assert err["code"] == "internal" and "no space left in the data directory" in err["message"]
            assert "data directory full" in d.log_text()
            # the store is consistent and holds exactly what was acknowledged
            store_verify(data_dir, COLL)
            assert {k: v[1] for k, v in store_export(data_dir, COLL).items()} == acked
            # reads are served from the full store
            some = sorted(acked)[len(acked) // 2]
            _, g = c.call({"v": 1, "op": "get", "collection": COLL, "doc_id": some})
            assert g["ok"] and g["doc"]["text"] == acked[some], g
            _, ls = c.call({"v": 1, "op": "list", "collection": COLL, "limit": 1000})
            assert ls["ok"] and [x["id"] for x in ls["docs"]] == sorted(acked)
            _, q = c.call(query("Where is the harbour?", collection=COLL, max_tokens=2))
            assert q["ok"] and q["citations"], q
            _, s = c.call({"v": 1, "op": "stats", "collection": COLL})
            assert s["ok"] and s["docs"] == len(acked)
            # a second large batch is refused the same way, and changes nothing
            _, r = c.call({"v": 1, "op": "ingest", "collection": COLL,
                           "docs": [{"id": "big", "text": "word " * 200000}]})
            assert not r["ok"] and "no space left" in r["error"]["message"], r
            assert d.stop() == 0
        # the daemon starts on the full filesystem and serves what it holds
        d = Daemon(tmp_path, model, workers=1, threads=1, data_dir=data_dir)
        with d:
            c = d.client()
            _, s = c.call({"v": 1, "op": "stats", "collection": COLL})
            assert s["ok"] and s["docs"] == len(acked), s
            assert d.stop() == 0
        # room again: the store moved to a larger filesystem takes writes
        bigger = tmp_path / "bigger"
        why = mount_tmpfs(bigger, "64m")
        assert why is None, why
        try:
            shutil.copytree(data_dir, bigger / "store")
            d = Daemon(tmp_path, model, workers=1, threads=1, data_dir=bigger / "store")
            with d:
                c = d.client()
                _, r = c.call({"v": 1, "op": "delete", "collection": COLL, "ids": sorted(acked)[:3]})
                assert r["ok"] and r["deleted"] == 3, r
                _, r = c.call({"v": 1, "op": "ingest", "collection": COLL,
                               "docs": [{"id": "after", "text": "written after the move"}]})
                assert r["ok"], r
                assert d.stop() == 0
            store_verify(bigger / "store", COLL)
        finally:
            umount(bigger)
    finally:
        umount(mnt)


def test_chunk_kv_records_on_a_full_disk(tmp_path):
    """With kv_reuse on, each question over stored documents writes its chunks' KV records to
    the store. On a full data directory that write fails: the log says the disk is full and
    what to do (not a bare "commit: Input/output error"), the answers are still given, and the
    store stays consistent."""
    if not can_mount():
        pytest.skip("not root: cannot mount a small filesystem for the data directory")
    mnt = tmp_path / "small"
    why = mount_tmpfs(mnt, "2m")
    if why:
        pytest.skip(why)
    model = fast_model(tmp_path)
    data_dir = mnt / "store"
    rng = random.Random(7)
    try:
        d = Daemon(tmp_path, model, workers=1, threads=1, data_dir=data_dir, kv_reuse=1,
                   kv_reuse_recompute=0.15, relevance_floor=0, max_context_tokens=2048)
        with d:
            c = d.client()
            acked, refused = fill(c, rng)
            assert len(acked) >= 3 and "no space left" in refused["error"]["message"], refused
            for i, q in enumerate(("Where is the harbour?", "What is the quartz?",
                                   "Which willow?")):
                _, r = c.call(query(q, collection=COLL, max_tokens=2, top_k=8, id=i))
                assert r["ok"] and r["citations"], r
            assert d.stop() == 0
            lines = [ln for ln in d.log_text().splitlines()
                     if "cannot write chunk KV records" in ln]
            print("\n".join(lines))
            assert lines, d.log_text()[-3000:]
            assert all("no space left in the data directory (the disk is full" in ln and
                       "free space on it, or move the store to a larger filesystem" in ln
                       for ln in lines), lines
            assert not any("commit: Input/output error\"" in ln for ln in lines), lines
        store_verify(data_dir, COLL)
    finally:
        umount(mnt)
