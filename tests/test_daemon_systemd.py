"""diffragd under a service manager: the test binds its own NOTIFY_SOCKET and checks READY=1
(only once /readyz holds), WATCHDOG=1 pings, STATUS= lines, RELOADING=1 ... READY=1 around a
SIGHUP that changes limits, and STOPPING=1 on SIGTERM with the in-flight request still answered
and exit status 0. Also `make install-daemon` and `systemd-analyze verify` on the unit."""
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest

from conftest import BUILD, ROOT, run_make
from daemon_util import Daemon, http_get, query, slow_model

DOCS = [{"id": "a", "text": "The Rhine flows from the Alps to the North Sea."},
        {"id": "b", "text": "Paris is the capital of France."},
        {"id": "c", "text": "Oxygen has atomic number 8."}]


class NotifyListener:
    """A unix datagram socket standing in for systemd's notification socket. On READY=1 it
    asks /readyz at once, so the test can tell whether readiness came first."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.path = path
        self.msgs = []          # (time, text)
        self.readyz_at_ready = []
        self.metrics_url = None
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop:
            try:
                data = self.sock.recv(4096).decode()
            except socket.timeout:
                continue
            if "READY=1" in data and self.metrics_url:
                self.readyz_at_ready.append(http_get(self.metrics_url + "/readyz")[0])
            self.msgs.append((time.time(), data))

    def lines(self, prefix):
        return [(t, l) for t, m in self.msgs for l in m.split("\n") if l.startswith(prefix)]

    def wait_for(self, line, timeout=60.0, after=0.0):
        end = time.time() + timeout
        while time.time() < end:
            hits = [t for t, l in self.lines(line) if l == line and t >= after]
            if hits:
                return hits[0]
            time.sleep(0.02)
        raise AssertionError("no %s within %.0f s; got %s" % (line, timeout, self.msgs[-10:]))

    def close(self):
        self.stop = True
        self.thread.join(2)
        self.sock.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return slow_model(tmp_path_factory.mktemp("models"))


def test_notify_ready_watchdog_reload_and_drain(tmp_path, model):
    listener = NotifyListener(tmp_path / "notify.sock")
    conf = tmp_path / "diffragd.conf"
    conf.write_text("max_docs = 8\nmax_queue = 16\n")
    d = Daemon(tmp_path, model, workers=1, drain_timeout=20,
               env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "400000"})
    d.argv[d.argv.index("/dev/null")] = str(conf)
    listener.metrics_url = d.metrics_url
    try:
        t_start = time.time()
        d.start(wait_ready=False)
        t_ready = listener.wait_for("READY=1")
        print("READY=1 after %.2f s; /readyz at that moment: %s" % (t_ready - t_start,
                                                                    listener.readyz_at_ready))
        assert listener.readyz_at_ready[0] == 200
        assert http_get(d.metrics_url + "/readyz")[0] == 200
        time.sleep(1.0)
        pings = [t for t, _ in listener.lines("WATCHDOG=1") if t > t_ready]
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        print("WATCHDOG=1: %d pings in 1 s (WATCHDOG_USEC 0.4 s), largest gap %.3f s"
              % (len(pings), max(gaps)))
        # every half period, so a ping is never later than the watchdog allows
        assert len(pings) >= 4 and max(gaps) < 0.4
        assert any("serving" in l for _, l in listener.lines("STATUS="))

        # SIGHUP: a lower max_docs applies without a restart
        c = d.client()
        _, r = c.call(query("capital?", DOCS, id="before", max_tokens=2), timeout=60)
        assert r["ok"], r
        # (keys given on the command line, like workers and log_level here, keep overriding)
        conf.write_text("max_docs = 2\nmax_queue = 16\ntop_k = 3\nheartbeat_ms = 500\n"
                        "workers = 3\nlog_level = debug\n")
        t_hup = time.time()
        d.send_signal(signal.SIGHUP)
        t_reloading = listener.wait_for("RELOADING=1", 10, after=t_hup)
        t_ready2 = listener.wait_for("READY=1", 10, after=t_reloading)
        print("reload: RELOADING=1 then READY=1 after %.1f ms" % ((t_ready2 - t_hup) * 1e3))
        _, r = c.call(query("capital?", DOCS, id="after", max_tokens=2), timeout=60)
        assert r["ok"] is False and r["error"]["code"] == "too_large", r
        log = d.log_text()
        assert 'changed="max_docs,top_k" needs_restart="heartbeat_ms"' in log, log[-800:]
        # a broken file leaves the running configuration alone
        conf.write_text("max_docs = lots\n")
        t_hup = time.time()
        d.send_signal(signal.SIGHUP)
        listener.wait_for("READY=1", 10, after=listener.wait_for("RELOADING=1", 10, after=t_hup))
        assert "reload failed" in d.log_text()
        _, r = c.call(query("capital?", DOCS[:2], id="still", max_tokens=2), timeout=60)
        assert r["ok"], r

        # SIGTERM with a request in flight: STOPPING=1, new requests refused, the in-flight one
        # answered in full, exit status 0
        c.send(query("Tell me about the Rhine.", DOCS[:2], id="inflight", stream=True,
                     max_tokens=120))
        first = c.recv(60)
        assert first.get("delta") is not None, first
        t_term = time.time()
        d.send_signal(signal.SIGTERM)
        t_stopping = listener.wait_for("STOPPING=1", 10, after=t_term)
        late = d.client()
        _, r = late.call({"v": 1, "op": "ping", "id": "late"}, timeout=10)
        assert r["ok"] is False and r["error"]["code"] == "shutting_down", r
        assert http_get(d.metrics_url + "/readyz") == (503, "draining\n")
        final = None
        while final is None:
            m = c.recv(60)
            if "ok" in m:
                final = m
        assert final["id"] == "inflight" and final["ok"] is True, final
        assert final["finish_reason"] in ("length", "stop"), final
        rc = d.proc.wait(60)
        print("STOPPING=1 %.1f ms after SIGTERM; in-flight request finished with %d tokens "
              "(%s); exit status %d" % ((t_stopping - t_term) * 1e3,
                                        final["usage"]["completion_tokens"],
                                        final["finish_reason"], rc))
        assert rc == 0, d.log_text()[-2000:]
        assert "store=closed" in d.log_text()
    finally:
        d.__exit__(None, None, None)
        listener.close()


def test_drain_timeout_cancels_what_is_left(tmp_path, model):
    with Daemon(tmp_path, model, workers=1, drain_timeout=0.5, max_tokens=4096) as d:
        c = d.client()
        # streamed, so that SIGTERM comes once the request decodes (in flight, not queued: a
        # queued one is refused with shutting_down), however slow the machine
        c.send(query("Rhine?", DOCS, id="long", stream=True, max_tokens=4000))
        first = c.recv(60)
        assert first.get("delta") is not None, first
        t0 = time.time()
        d.send_signal(signal.SIGTERM)
        r = None
        while r is None:
            m = c.recv(30)
            if "ok" in m:
                r = m
        rc = d.proc.wait(30)
        took = time.time() - t0
        print("drain timeout 0.5 s: reply %s after %.2f s, exit %d" % (r.get("finish_reason"),
                                                                     took, rc))
        assert r["id"] == "long" and r["ok"] and r["finish_reason"] == "cancelled", r
        assert rc == 0 and took < 5
        d.stop()


def test_install_and_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze (Debian package systemd) is required"
    prefix, etc, units = tmp_path / "prefix", tmp_path / "etc", tmp_path / "units"
    p = run_make(["make", "-s", "-C", str(ROOT), "BUILD=%s" % BUILD, "-o",
                  "%s/diffragd" % BUILD, "install-daemon", "PREFIX=%s" % prefix,
                  "SYSCONFDIR=%s" % etc, "UNITDIR=%s" % units, "INSTALL_MODEL=no"],
                 capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    unit = units / "diffragd.service"
    assert os.access(prefix / "bin" / "diffragd", os.X_OK)
    assert (etc / "diffrag" / "diffragd.conf").exists()
    assert (prefix / "share" / "doc" / "diffrag" / "protocol.md").exists()
    # the CUDA backend goes where diffragd looks for it (PREFIX/lib beside PREFIX/bin) whenever
    # this build made one (nvcc present; sanitizer builds make none)
    built_cuda = (BUILD / "libdiffrag_cuda.so").exists()
    assert (prefix / "lib" / "libdiffrag_cuda.so").exists() == built_cuda
    text = unit.read_text()
    for needle in ("Type=notify", "ExecReload=/bin/kill -HUP $MAINPID", "WatchdogSec=",
                   "Restart=on-failure", "StateDirectory=diffrag", "ConfigurationDirectory=diffrag",
                   "DynamicUser=yes", "NoNewPrivileges=yes", "ProtectSystem=strict",
                   "ProtectHome=yes", "PrivateTmp=yes", "RestrictAddressFamilies=",
                   "%s/bin/diffragd --config %s/diffrag/diffragd.conf" % (prefix, etc)):
        assert needle in text, needle
    p = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    print("systemd-analyze verify:", p.returncode, p.stdout.strip(), p.stderr.strip())
    assert p.returncode == 0, p.stdout + p.stderr
    # the installed configuration passes --check-config once it names a model that exists
    conf = etc / "diffrag" / "diffragd.conf"
    # it serves the default model from the share directory install-daemon copies it to
    assert ("model = %s/share/diffrag/models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf\n" % prefix
            in conf.read_text())
    p = subprocess.run([str(prefix / "bin" / "diffragd"), "--config", str(conf), "--check-config",
                        "--model", str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
