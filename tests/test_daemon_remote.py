"""Remote workers (`diffragd --worker --connect tcp://...`) join the broker's pool over TCP with
heartbeats. A worker killed with SIGKILL mid-request: the client gets an error reply within the
heartbeat timeout (or, when nothing was streamed yet and another worker is there, the request
is retried once and succeeds); a worker that (re)connects serves again; workers rejoin a
restarted broker."""
import signal
import subprocess
import time

import pytest

from daemon_util import DIFFRAGD, Daemon, free_port, http_get, query, slow_model

HB_MS = 200
LIVENESS = 3
DOCS = [{"id": "a", "text": "The Rhine flows from the Alps to the North Sea."},
        {"id": "b", "text": "Paris is the capital of France."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return slow_model(tmp_path_factory.mktemp("models"))


def start_worker(tmp_path, model, endpoint, name):
    log = open(tmp_path / ("worker-%s.log" % name), "wb")
    p = subprocess.Popen([str(DIFFRAGD), "--config", "/dev/null", "--worker", "--connect", endpoint,
                          "--model", str(model), "--workers", "1", "--threads", "1",
                          "--max-tokens", "4096", "--heartbeat-ms", str(HB_MS),
                          "--heartbeat-liveness", str(LIVENESS)], stdout=log,
                         stderr=subprocess.STDOUT)
    p.log_path = tmp_path / ("worker-%s.log" % name)
    return p


def n_workers(d):
    return d.metric("diffrag_workers", state="idle") + d.metric("diffrag_workers", state="busy")


def wait_workers(d, n, timeout=30):
    end = time.time() + timeout
    while time.time() < end:
        if n_workers(d) == n:
            return
        time.sleep(0.05)
    raise AssertionError("expected %d workers, have %d:\n%s" % (n, n_workers(d),
                                                                d.log_text()[-1500:]))


def cpu_ticks(pid):
    fields = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def broker(tmp_path, model, wport):
    return Daemon(tmp_path, model, workers=0, worker_listen="tcp://127.0.0.1:%d" % wport,
                  heartbeat_ms=HB_MS, heartbeat_liveness=LIVENESS, max_tokens=4096)


def test_remote_worker_killed_mid_request(tmp_path, model):
    wport = free_port()
    endpoint = "tcp://127.0.0.1:%d" % wport
    workers = []
    d = broker(tmp_path, model, wport)
    try:
        d.start(wait_ready=False)
        c = d.client()
        _, r = c.call({"v": 1, "op": "ping", "id": 1}, timeout=30)
        assert r["pong"] is True
        # the broker loads only the tokenizer, yet names the model as a worker loading the
        # same file does: by the file (tiny-slow.gguf; q8_0 weights, no general.file_type)
        assert (r["model"], r["architecture"], r["quantization"]) == \
            ("tiny-slow", "llama", "Q8_0"), r
        status, why = http_get(d.metrics_url + "/readyz")
        assert status == 503 and "no worker" in why, (status, why)
        w1 = start_worker(tmp_path, model, endpoint, "1")
        workers.append(w1)
        d.wait_ready()
        assert 'msg="worker ready" model="tiny-slow"' in d.log_text(), d.log_text()[-1500:]
        _, r = c.call(query("capital?", DOCS, id="warm", max_tokens=3), timeout=60)
        assert r["ok"], r

        # streaming request, worker SIGKILLed after the first delta: an error reply, in time
        c.send(query("Tell me about the Rhine.", DOCS, id="doomed", stream=True, max_tokens=3000))
        first = c.recv(60)
        assert "delta" in first, first
        t_kill = time.time()
        w1.send_signal(signal.SIGKILL)
        w1.wait()
        final = None
        while final is None:
            m = c.recv(10)
            if "ok" in m:
                final = m
        waited_ms = (time.time() - t_kill) * 1e3
        timeout_ms = HB_MS * LIVENESS
        print("killed worker: error %r after %.0f ms (heartbeat timeout %d ms)"
              % (final.get("error"), waited_ms, timeout_ms))
        assert final["id"] == "doomed" and final["ok"] is False, final
        assert final["error"]["code"] == "internal" and "lost" in final["error"]["message"]
        # counted from the last message heard (a delta just before the kill)
        assert waited_ms < timeout_ms + HB_MS, waited_ms
        assert http_get(d.metrics_url + "/readyz")[0] == 503
        assert d.metric("diffrag_worker_lost_total") == 1

        # a new worker process joins and the pool serves again
        w2 = start_worker(tmp_path, model, endpoint, "2")
        workers.append(w2)
        d.wait_ready()
        _, r = c.call(query("capital?", DOCS, id="again", max_tokens=5), timeout=60)
        assert r["ok"] and r["usage"]["completion_tokens"] >= 1, r

        # nothing streamed yet and another worker alive: the request is retried once
        w3 = start_worker(tmp_path, model, endpoint, "3")
        workers.append(w3)
        wait_workers(d, 2)
        c.send(query("Tell me about Paris.", DOCS, id="retry-me", max_tokens=1500))
        time.sleep(0.4)
        ticks = {w.pid: cpu_ticks(w.pid) for w in (w2, w3)}
        time.sleep(0.3)
        busy = max((w2, w3), key=lambda w: cpu_ticks(w.pid) - ticks[w.pid])
        busy.send_signal(signal.SIGKILL)
        busy.wait()
        # the retry runs all 1,500 tokens: about 60 s on a slow core under ASan
        r = c.recv(300)
        print("retried request:", r.get("finish_reason"), r.get("usage"))
        assert r["id"] == "retry-me" and r["ok"] is True, r
        assert "retried=1" in d.log_text()

        # a worker that leaves on SIGTERM says goodbye and exits 0
        other = w3 if busy is w2 else w2
        wait_workers(d, 1)
        other.send_signal(signal.SIGTERM)
        assert other.wait(30) == 0
        wait_workers(d, 0)
        assert "worker left" in d.log_text()
        assert d.stop() == 0
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        d.__exit__(None, None, None)


def test_workers_rejoin_a_restarted_broker(tmp_path, model):
    wport = free_port()
    endpoint = "tcp://127.0.0.1:%d" % wport
    w = start_worker(tmp_path, model, endpoint, "r")
    try:
        (tmp_path / "b1").mkdir()
        d1 = broker(tmp_path / "b1", model, wport)
        with d1:
            _, r = d1.client().call(query("capital?", DOCS, id=1, max_tokens=2), timeout=60)
            assert r["ok"], r
            assert d1.stop() == 0
        t0 = time.time()
        (tmp_path / "b2").mkdir()
        d2 = broker(tmp_path / "b2", model, wport)
        with d2:
            rejoin = time.time() - t0
            _, r = d2.client().call(query("capital?", DOCS, id=2, max_tokens=2), timeout=60)
            print("worker rejoined the restarted broker %.2f s after the first stopped" % rejoin)
            assert r["ok"], r
            assert d2.stop() == 0
        w.send_signal(signal.SIGTERM)
        assert w.wait(30) == 0
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
