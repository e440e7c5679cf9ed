"""Workers that fail mid-request.

In-process: fault injection (DIFFRAGD_FAULTS) ends a worker's compute thread on every 5th job
and fails every 7th as if the engine had. Each such request gets an `internal` error naming
the failure, every other request succeeds, and the pool keeps both workers: the I/O thread
answers for the dead thread and starts a new one over a fresh engine context.

Remote: two `diffragd --worker` processes under a supervisor that restarts them (as systemd's
Restart=on-failure does) are killed mid-request with SIGSEGV, SIGABRT, SIGBUS and SIGKILL while
four clients query. Every request gets exactly one final reply (success, possibly after the
broker's one retry, or `internal` "lost"), and after each crash the pool is back to two workers
and serves."""
import os
import random
import resource
import signal
import subprocess
import threading
import time

import pytest

from daemon_util import DIFFRAGD, Daemon, fast_model, free_port, query, slow_model

DOCS = [{"id": "a", "text": "The Rhine flows from the Alps to the North Sea."},
        {"id": "b", "text": "Paris is the capital of France."}]


def n_workers(d):
    return d.metric("diffrag_workers", state="idle") + d.metric("diffrag_workers", state="busy")


def wait_workers(d, n, timeout=30):
    end = time.time() + timeout
    while time.time() < end:
        if n_workers(d) == n:
            return time.time()
        time.sleep(0.02)
    raise AssertionError("expected %d workers, have %d:\n%s" % (n, n_workers(d), d.log_text()[-2000:]))


class Querier(threading.Thread):
    """Sends queries one after another; records every final reply and checks that each
    message belongs to the request in flight."""

    def __init__(self, d, k, n, max_tokens, seed):
        super().__init__(daemon=True)
        self.c = d.client()
        self.k, self.n, self.max_tokens = k, n, max_tokens
        self.rng = random.Random(seed)
        self.replies = {}
        self.errors = []
        self.stop = threading.Event()

    def run(self):
        for i in range(self.n):
            if self.stop.is_set():
                break
            rid = "q%d-%d" % (self.k, i)
            stream = self.rng.random() < 0.5
            try:
                deltas, r = self.c.call(query("Where does the Rhine flow?", DOCS, id=rid,
                                              stream=stream, max_tokens=self.max_tokens), timeout=60)
            except TimeoutError as e:
                self.errors.append((rid, "no reply: %s" % e))
                return
            if r.get("id") != rid or any(x.get("id") != rid for x in deltas):
                self.errors.append((rid, "reply to another request", r))
            if rid in self.replies:
                self.errors.append((rid, "two final replies"))
            if r["ok"] and stream and "".join(x["delta"] for x in deltas) != r["answer"]:
                self.errors.append((rid, "deltas do not add up"))
            self.replies[rid] = r
        if self.c.poll(0.3):
            self.errors.append(("stray message", self.c.recv(1)))


def test_worker_thread_failures(tmp_path):
    model = fast_model(tmp_path)
    d = Daemon(tmp_path, model, workers=2, threads=1, log_level="info",
               env={"DIFFRAGD_FAULTS": "worker_thread_exit=5,worker_engine_error=7"})
    with d:
        qs = [Querier(d, k, 25, 8, k) for k in range(4)]
        for q in qs:
            q.start()
        for q in qs:
            q.join(120)
            assert not q.is_alive()
        errors = [e for q in qs for e in q.errors]
        assert not errors, errors[:5]
        replies = [r for q in qs for r in q.replies.values()]
        failed = [r["error"] for r in replies if not r["ok"]]
        # the I/O thread answers for a dead thread before it builds the new engine, so the
        # last failure's reply can reach its client before that restart is logged
        end = time.time() + 30
        while True:
            log = d.log_text()
            exits = log.count("compute thread exits (injected fault)")
            restarts = log.count("worker compute thread restarted")
            if restarts >= exits or time.time() > end:
                break
            time.sleep(0.05)
        wait_workers(d, 2)
        thread_msgs = sum("compute thread failed" in e["message"] for e in failed)
        engine_msgs = sum("engine failed" in e["message"] for e in failed)
        print("\n%d queries: %d ok, %d failed (%d compute-thread exits, %d engine failures); "
              "%d threads restarted; workers now %d"
              % (len(replies), len(replies) - len(failed), len(failed), thread_msgs, engine_msgs,
                 restarts, n_workers(d)))
        assert len(replies) == 100
        assert all(e["code"] == "internal" for e in failed), failed
        # a compute thread that fails takes every request its worker was batching with it
        assert exits >= 10 and exits == restarts and thread_msgs >= exits, \
            (exits, thread_msgs, restarts)
        assert engine_msgs >= 5 and thread_msgs + engine_msgs == len(failed)
        assert n_workers(d) == 2
        assert d.metric("diffrag_requests_total", op="query", code="internal") == len(failed)
        assert d.stop() == 0


def no_core():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class Supervisor(threading.Thread):
    """Keeps `n` remote worker processes running, restarting any that exits."""

    def __init__(self, tmp_path, model, endpoint, n, hb_ms, liveness):
        super().__init__(daemon=True)
        self.argv = [str(DIFFRAGD), "--config", "/dev/null", "--worker", "--connect", endpoint,
                     "--model", str(model), "--workers", "1", "--threads", "1",
                     "--max-tokens", "4096", "--heartbeat-ms", str(hb_ms),
                     "--heartbeat-liveness", str(liveness)]
        self.log = open(tmp_path / "workers.log", "ab")
        self.procs = [self.spawn() for _ in range(n)]
        self.exits = []
        self.stop = threading.Event()

    def spawn(self):
        # under AddressSanitizer the signals must still kill the worker, not become a report
        env = dict(os.environ)
        if env.get("ASAN_OPTIONS"):
            env["ASAN_OPTIONS"] += ":handle_segv=0:handle_sigbus=0:handle_abort=0"
        return subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT,
                                preexec_fn=no_core, env=env)

    def run(self):
        while not self.stop.is_set():
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    self.exits.append(p.returncode)
                    self.procs[i] = self.spawn()
            time.sleep(0.05)

    def close(self):
        self.stop.set()
        self.join(5)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.log.close()


def cpu_ticks(pid):
    try:
        fields = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except OSError:
        return 0


def test_remote_worker_crashes(tmp_path):
    model = slow_model(tmp_path)
    hb, live = 200, 3
    wport = free_port()
    d = Daemon(tmp_path, model, workers=0, worker_listen="tcp://127.0.0.1:%d" % wport,
               heartbeat_ms=hb, heartbeat_liveness=live, max_tokens=4096, log_level="info")
    sup = None
    try:
        d.start(wait_ready=False)
        sup = Supervisor(tmp_path, model, "tcp://127.0.0.1:%d" % wport, 2, hb, live)
        sup.start()
        d.wait_ready()
        wait_workers(d, 2)
        qs = [Querier(d, k, 400, 60, k) for k in range(4)]
        for q in qs:
            q.start()
        signals = [signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGKILL] * 2
        back_in = []
        for sig in signals:
            time.sleep(0.5)
            before = {p.pid: cpu_ticks(p.pid) for p in sup.procs}
            time.sleep(0.2)
            victim = max(sup.procs, key=lambda p: cpu_ticks(p.pid) - before.get(p.pid, 0))
            t_kill = time.time()
            victim.send_signal(sig)
            victim.wait()
            time.sleep(hb * live / 1e3)        # the broker notices the loss
            back_in.append(wait_workers(d, 2) - t_kill)
        for q in qs:
            q.stop.set()
        for q in qs:
            q.join(120)
            assert not q.is_alive()
        errors = [e for q in qs for e in q.errors]
        assert not errors, errors[:5]
        replies = [r for q in qs for r in q.replies.values()]
        failed = [r["error"] for r in replies if not r["ok"]]
        log = d.log_text()
        retried = log.count("retried=1")
        print("\n%d crashes (%s): worker exits %s; %d queries, %d ok (%d after a retry), %d "
              "failed %s; pool back to 2 workers %.2f s after a crash (max)"
              % (len(signals), ",".join(signal.Signals(s).name for s in signals), sup.exits,
                 len(replies), len(replies) - len(failed), retried, len(failed),
                 sorted({e["code"] for e in failed}), max(back_in)))
        assert sorted(sup.exits) == sorted(-s for s in signals)
        assert all(e["code"] == "internal" and "lost" in e["message"] for e in failed), failed
        assert len(failed) + retried >= len(signals) // 2, "the kills hit no request"
        assert d.metric("diffrag_worker_lost_total") == len(signals)
        # the recovered pool serves
        _, r = d.client().call(query("capital?", DOCS, id="after", max_tokens=4), timeout=60)
        assert r["ok"], r
        assert d.stop() == 0
    finally:
        if sup:
            sup.close()
        d.__exit__(None, None, None)
