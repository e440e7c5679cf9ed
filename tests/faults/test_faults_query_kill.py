"""SIGKILL of diffragd while eight clients stream queries, five times; each time a new daemon
starts on the same endpoint and the clients' sockets reconnect. Every message a client receives
must belong to a request that client sent: its id, citations naming only that request's own
inline documents, streamed deltas adding up to the answer, at most one final reply per id.
Requests caught by a kill end in a timeout (or an error); after each restart the pool serves
every client again."""
import random
import signal
import threading
import time

import zmq

from daemon_util import Client, Daemon, fast_model, query

CLIENTS = 8
KILLS = 5
WAIT_S = 3.0


class Asker(threading.Thread):
    def __init__(self, k, ctx, endpoint, seed):
        super().__init__(daemon=True)
        self.k = k
        self.client = Client(ctx, endpoint)
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.sent = {}          # id -> (doc ids, stream)
        self.final = {}         # id -> final reply
        self.deltas = {}        # id -> [text]
        self.timeouts = 0
        self.late = 0
        self.errors = []
        self.ok_at = []         # times of successful replies

    def take(self, m):
        """Checks one received message; returns its id when it was a final reply."""
        rid = m.get("id")
        if rid not in self.sent:
            self.errors.append(("message for a request this client never sent", m))
            return None
        if rid in self.final:
            self.errors.append(("message after the final reply", m))
            return None
        if "ok" not in m:
            if not self.sent[rid][1]:
                self.errors.append(("delta for a request that did not stream", m))
            self.deltas.setdefault(rid, []).append(m["delta"])
            return None
        self.final[rid] = m
        if m["ok"]:
            docs, stream = self.sent[rid]
            cited = {c["doc_id"] for c in m["citations"]}
            if not cited or not cited <= docs:
                self.errors.append(("citations of another request", rid, cited, docs))
            if stream and "".join(self.deltas.get(rid, [])) != m["answer"]:
                self.errors.append(("deltas do not add up to the answer", rid))
            self.ok_at.append(time.time())
        return rid

    def run(self):
        seq = 0
        while not self.stop.is_set():
            seq += 1
            rid = "k%d-%d" % (self.k, seq)
            docs = [{"id": "%s-%s" % (rid, x), "text": "Item %s %s is kept in the %s vault." %
                     (rid, x, self.rng.choice(("north", "south", "river", "harbour")))}
                    for x in "abc"]
            stream = self.rng.random() < 0.5
            self.sent[rid] = ({d["id"] for d in docs}, stream)
            self.client.send(query("Where is item %s b kept?" % rid, docs, id=rid, stream=stream,
                                   max_tokens=self.rng.choice((4, 16, 48))))
            end = time.time() + WAIT_S
            while not self.stop.is_set():
                left = end - time.time()
                if left <= 0:
                    self.timeouts += 1
                    break
                if not self.client.poll(min(left, 0.1)):
                    continue
                got = self.take(self.client.recv(1))
                if got == rid:
                    break
                if got is not None:
                    self.late += 1
        while self.client.poll(0.3):     # stragglers are checked too
            if self.take(self.client.recv(1)) is not None:
                self.late += 1
        self.client.close()


def test_sigkill_during_queries(tmp_path):
    model = fast_model(tmp_path)
    rng = random.Random(99)
    first = Daemon(tmp_path, model, workers=2, threads=1, log_level="warn")
    ctx = zmq.Context()
    askers = [Asker(k, ctx, first.endpoint, k) for k in range(CLIENTS)]
    d = first.start()
    daemons = [d]
    try:
        for a in askers:
            a.start()
        recoveries = []
        for cycle in range(KILLS):
            time.sleep(rng.uniform(0.3, 1.0))
            d.send_signal(signal.SIGKILL)
            d.proc.wait()
            t_kill = time.time()
            time.sleep(rng.uniform(0.05, 0.5))
            d = Daemon(tmp_path, model, workers=2, threads=1, log_level="warn")
            d.argv, d.endpoint, d.metrics_url = first.argv, first.endpoint, first.metrics_url
            daemons.append(d)
            d.start()
            # the pool serves every client again
            end = time.time() + 30
            while time.time() < end and not all(any(t > t_kill for t in a.ok_at) for a in askers):
                time.sleep(0.05)
            served = [a.k for a in askers if any(t > t_kill for t in a.ok_at)]
            assert len(served) == CLIENTS, ("after kill %d only clients %s were served again"
                                            % (cycle, served))
            recoveries.append(max(min(t for t in a.ok_at if t > t_kill) for a in askers) - t_kill)
        time.sleep(0.5)
        for a in askers:
            a.stop.set()
        for a in askers:
            a.join(30)
            assert not a.is_alive()
        errors = [e for a in askers for e in a.errors]
        assert not errors, errors[:5]
        sent = sum(len(a.sent) for a in askers)
        ok = sum(1 for a in askers for r in a.final.values() if r["ok"])
        failed = [r["error"]["code"] for a in askers for r in a.final.values() if not r["ok"]]
        timeouts = sum(a.timeouts for a in askers)
        late = sum(a.late for a in askers)
        print("\n%d kills: %d requests, %d answered ok, %d error replies %s, %d timed out, "
              "%d answered late; every client served again within %.2f s of a kill (max)"
              % (KILLS, sent, ok, len(failed), sorted(set(failed)), timeouts, late,
                 max(recoveries)))
        assert ok > sent // 2
        assert set(failed) <= {"internal", "shutting_down"}, failed
        assert d.stop() == 0
    finally:
        for x in daemons:
            x.__exit__(None, None, None)
        for a in askers:
            a.stop.set()
        ctx.destroy(0)
