"""SIGKILL of diffragd during ingests, 100 trials over one data directory. Four clients ingest
and delete batches of documents (each client owns its ids, so its operations are ordered); the
daemon is killed after a random number of acknowledged documents, at a random point of the
commit in progress. After each kill `diffrag-store verify` must pass and the
exported store must show, for every id, the last acknowledged state (or the state the one
unacknowledged operation of its client would have left: it may have committed before the kill).
Text and title are compared whole. Each restarted daemon must report the same documents
(stats) and serve them (get, a query)."""
import random
import signal
import threading
import time

import pytest

from daemon_util import Daemon, fast_model, query
from faults_util import store_export, store_verify

TRIALS = 100
CLIENTS = 4
IDS_PER_CLIENT = 40
COLL = "crash"
WORDS = ("river mountain harbour castle meadow lantern copper violet thunder orchard glacier "
         "alpha beta gamma delta falcon ember willow quartz saffron").split()


def doc_text(rng, doc_id, version):
    n = rng.choice((3, 10, 40, 200, 600))
    body = " ".join(rng.choice(WORDS) for _ in range(n * 8))
    return "Version %d of %s. %s." % (version, doc_id, body)


class Writer(threading.Thread):
    """One client: sequential ingest/delete batches over its own ids. `allowed` maps each of its
    ids to the states the store may show: None (absent) or a version number."""

    def __init__(self, k, rng, allowed, versions, counter):
        super().__init__(daemon=True)
        self.k, self.rng, self.allowed, self.versions, self.counter = k, rng, allowed, versions, counter
        self.ids = ["c%d-%03d" % (k, i) for i in range(IDS_PER_CLIENT)]
        self.stop = threading.Event()
        self.acked = 0
        self.errors = []
        self.sock = None
        self.pending = {}     # the operation without a reply when the daemon died

    def run(self):
        seq = 0
        while not self.stop.is_set():
            seq += 1
            ids = self.rng.sample(self.ids, self.rng.choice((1, 1, 2, 3, 5)))
            if self.rng.random() < 0.15:
                effect = {i: None for i in ids}
                msg = {"v": 1, "op": "delete", "collection": COLL, "ids": ids, "id": seq}
            else:
                docs, effect = [], {}
                for i in ids:
                    ver = next(self.counter)
                    title = "T%d" % ver
                    text = doc_text(self.rng, i, ver)
                    self.versions[(i, ver)] = (title, text)
                    docs.append({"id": i, "title": title, "text": text})
                    effect[i] = ver
                msg = {"v": 1, "op": "ingest", "collection": COLL, "docs": docs, "id": seq}
            # until the reply comes, either outcome is allowed
            for i, v in effect.items():
                self.allowed[i] = self.allowed[i] | {v}
            self.sock.send(msg)
            reply = None
            while reply is None:
                if self.sock.poll(0.05):
                    reply = self.sock.recv(1)
                elif self.stop.is_set():
                    # the daemon is dead; a reply it sent before dying may still be queued here
                    if self.sock.poll(0.2):
                        reply = self.sock.recv(1)
                    break
            if reply is None:
                self.pending = effect
                return
            if reply.get("id") != seq:
                self.errors.append(("reply to another request", seq, reply))
                return
            if reply["ok"]:
                self.acked += len(effect)
                for i, v in effect.items():
                    self.allowed[i] = {v}
            else:
                # a refused batch leaves the store unchanged
                self.errors.append(("refused", reply["error"]))
                for i, v in effect.items():
                    self.allowed[i].discard(v)


def check_store(data_dir, allowed, versions, trial):
    store_verify(data_dir, COLL)
    visible = store_export(data_dir, COLL)
    seen = {}
    for doc_id, (title, text) in visible.items():
        assert doc_id in allowed, "trial %d: unknown document %r" % (trial, doc_id)
        ver = int(text.split(" ", 2)[1])
        assert versions.get((doc_id, ver)) == (title, text), \
            "trial %d: %s shows a title/text that was never written whole" % (trial, doc_id)
        seen[doc_id] = ver
    for doc_id, states in allowed.items():
        got = seen.get(doc_id)
        assert got in states, ("trial %d: %s shows %r; allowed %r (acknowledged writes must be "
                               "present and whole)" % (trial, doc_id, got, sorted(states, key=str)))
        allowed[doc_id] = {got}
    return visible


def test_sigkill_during_ingest(tmp_path):
    model = fast_model(tmp_path)
    data_dir = tmp_path / "store"
    rng = random.Random(20240914)
    allowed = {"c%d-%03d" % (k, i): {None} for k in range(CLIENTS) for i in range(IDS_PER_CLIENT)}
    versions = {}
    counter = iter(range(1, 10**9))
    visible = {}
    totals = {"acked": 0, "in_doubt_committed": 0, "start_s": 0.0, "check_s": 0.0}
    t_all = time.time()
    for trial in range(TRIALS):
        t0 = time.time()
        d = Daemon(tmp_path, model, workers=1, threads=1, data_dir=data_dir, log_level="warn")
        with d:
            totals["start_s"] += time.time() - t0
            c = d.client()
            # the restarted daemon reports and serves what the store held at the kill
            _, st = c.call({"v": 1, "op": "stats", "collection": COLL, "id": "s"})
            if visible:
                assert st["ok"] and st["docs"] == len(visible), (trial, st, len(visible))
                for doc_id in rng.sample(sorted(visible), min(3, len(visible))):
                    _, g = c.call({"v": 1, "op": "get", "collection": COLL, "doc_id": doc_id})
                    assert g["ok"] and (g["doc"]["title"], g["doc"]["text"]) == visible[doc_id], g
                if trial % 10 == 0:
                    _, q = c.call(query("Which version mentions the harbour?", collection=COLL,
                                        max_tokens=2, id="q"))
                    assert q["ok"] and q["citations"], q
            writers = []
            for k in range(CLIENTS):
                w = Writer(k, random.Random(rng.random()), allowed, versions, counter)
                w.sock = d.client()
                writers.append(w)
            for w in writers:
                w.start()
            # kill once the clients have had a random number of documents acknowledged (a
            # condition rather than a time, so a slow machine still kills mid-stream), then a
            # little later, so the kill lands anywhere in a commit
            target = rng.randrange(0, 80)
            end = time.time() + 30
            while sum(w.acked for w in writers) < target and time.time() < end:
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.05))
            d.send_signal(signal.SIGKILL)
            d.proc.wait()
            for w in writers:
                w.stop.set()
            for w in writers:
                w.join(10)
                assert not w.is_alive()
                assert not w.errors, w.errors
                totals["acked"] += w.acked
        t1 = time.time()
        visible = check_store(data_dir, allowed, versions, trial)
        totals["check_s"] += time.time() - t1
        # unacknowledged operations that nevertheless committed before the kill
        totals["in_doubt_committed"] += sum(
            1 for w in writers if w.pending and all(allowed[i] == {v} for i, v in w.pending.items()))
    print("\n%d SIGKILLs in %.1f s: %d acknowledged writes checked; %d unacknowledged batches "
          "found committed; final store %d docs; daemon start %.2f s, verify+export %.2f s "
          "per trial" % (TRIALS, time.time() - t_all, totals["acked"], totals["in_doubt_committed"],
                         len(visible), totals["start_s"] / TRIALS, totals["check_s"] / TRIALS))
    assert totals["acked"] > 20 * TRIALS, "too few acknowledged writes: the kills came too early"
