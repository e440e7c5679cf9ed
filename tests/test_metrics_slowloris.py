"""The metrics endpoint under slow clients (docs/security.md#the-metrics-endpoint).

- A connection that trickles header bytes, so that it is never idle, is closed once its
  request has taken the deadline (5 s), not kept open for as long as bytes keep coming.
- A slowloris of 250 connections (200 trickling header bytes, 50 silent; from 127.0.0.1, the
  probes' own address, and from other loopback addresses), which reconnect when the server
  drops them, does not stop /readyz and /healthz: probed every second for 16 s, from 127.0.0.1
  and from one of the attackers' addresses, every probe is answered 200 within 2 s. The
  daemon's open descriptors stay within the connection limit meanwhile."""
import http.client
import os
import random
import selectors
import socket
import threading
import time

import pytest

from daemon_util import Daemon, fast_model, http_get

DEADLINE_S = 5.0             # METRICS_REQUEST_DEADLINE_S in daemon/metrics.c
MAX_CONNECTIONS = 128        # METRICS_MAX_CONNECTIONS


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slowloris")
    d = Daemon(tmp, fast_model(tmp), workers=1)
    with d:
        yield d
        d.stop()


def metrics_addr(d):
    host, port = d.metrics_url.rsplit("/", 1)[-1].rsplit(":", 1)
    return host, int(port)


class Slowloris(threading.Thread):
    """Holds one connection per entry of `slots` ((source address, "trickle" or "silent")),
    sending a few header bytes now and then (never the blank line that ends the headers) on
    trickling ones and nothing on silent ones; a connection the server drops is opened again
    0.3-1.5 s later, as slowloris tools do."""

    def __init__(self, addr, slots):
        super().__init__(daemon=True)
        self.addr, self.slots = addr, slots
        self.stop = threading.Event()
        self.connects = self.dropped = 0
        self.lock = threading.Lock()
        self.open_now = 0

    def _open(self, src, sel, state):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.bind((src, 0))
        s.connect_ex(self.addr)
        state["sock"], state["sent"] = s, 0
        state["next"] = time.monotonic() + random.uniform(0.0, 1.0)
        sel.register(s, selectors.EVENT_READ, state)
        self.connects += 1

    def _close(self, sel, state):
        sel.unregister(state["sock"])
        state["sock"].close()
        state["sock"] = None
        state["reopen"] = time.monotonic() + random.uniform(0.3, 1.5)
        self.dropped += 1

    def run(self):
        sel = selectors.DefaultSelector()
        states = [{"src": src, "kind": kind, "sock": None, "reopen": 0.0}
                  for src, kind in self.slots]
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                for st in states:
                    if st["sock"] is None:
                        if now >= st["reopen"]:
                            self._open(st["src"], sel, st)
                        continue
                    if st["kind"] == "trickle" and now >= st["next"]:
                        chunk = (b"GET /readyz HTTP/1.1\r\nHost: x\r\nX-a: " if st["sent"] == 0
                                 else b"bbbbbb")
                        try:
                            st["sock"].send(chunk)
                            st["sent"] += 1
                        except (BlockingIOError, InterruptedError):
                            pass          # still connecting
                        except OSError:
                            self._close(sel, st)
                            continue
                        st["next"] = now + random.uniform(0.5, 1.5)
                for key, _ in sel.select(0.05):
                    st = key.data
                    try:
                        data = st["sock"].recv(4096)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        data = b""
                    self._close(sel, st)    # closed, or answered with an error: let go
                with self.lock:
                    self.open_now = sum(1 for st in states if st["sock"] is not None)
        finally:
            for st in states:
                if st["sock"] is not None:
                    st["sock"].close()
            sel.close()


def probe(d, path, src):
    """(status, seconds) of one GET from source address src; status 0 when nothing answered."""
    host, port = metrics_addr(d)
    t0 = time.monotonic()
    if src == "127.0.0.1":
        status, _ = http_get(d.metrics_url + path, timeout=2.0)
        return status, time.monotonic() - t0
    try:
        c = http.client.HTTPConnection(host, port, timeout=2.0, source_address=(src, 0))
        c.request("GET", path)
        status = c.getresponse().status
        c.close()
    except (OSError, http.client.HTTPException):
        status = 0
    return status, time.monotonic() - t0


def test_trickled_request_closed_at_deadline(daemon):
    host, port = metrics_addr(daemon)
    s = socket.create_connection((host, port), timeout=1.0, source_address=("127.0.0.9", 0))
    t0 = time.monotonic()
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-a: ")
    closed_after = None
    while time.monotonic() - t0 < DEADLINE_S + 4.0:
        try:
            s.send(b"b")
            s.settimeout(0.3)
            if s.recv(4096) == b"":
                closed_after = time.monotonic() - t0
                break
        except socket.timeout:
            continue
        except OSError:
            closed_after = time.monotonic() - t0
            break
    s.close()
    assert closed_after is not None, (
        "a connection trickling one byte every 0.3 s was still open after %.0f s"
        % (DEADLINE_S + 4.0))
    print("trickled request closed after %.2f s (deadline %.1f s)" % (closed_after, DEADLINE_S))
    assert DEADLINE_S - 1.0 <= closed_after <= DEADLINE_S + 2.0, closed_after


def test_probes_answer_during_slowloris(daemon):
    pid = daemon.proc.pid
    fds_before = len(os.listdir("/proc/%d/fd" % pid))
    slots = [("127.0.0.1", "trickle")] * 100
    slots += [("127.0.0.%d" % (2 + i % 4), "trickle") for i in range(100)]
    slots += [("127.0.0.%d" % (6 + i % 2), "silent") for i in range(50)]
    attack = Slowloris(metrics_addr(daemon), slots)
    attack.start()
    failures, probes, most_fds, least_open = [], 0, 0, len(slots)
    try:
        time.sleep(1.5)                     # let the attack take every slot first
        end = time.monotonic() + 16.0
        while time.monotonic() < end:
            t0 = time.monotonic()
            for path, src in (("/readyz", "127.0.0.1"), ("/healthz", "127.0.0.1"),
                              ("/readyz", "127.0.0.2"), ("/healthz", "127.0.0.6")):
                status, took = probe(daemon, path, src)
                probes += 1
                if status != 200:
                    failures.append("%s from %s: status %d after %.2f s" % (path, src, status, took))
            most_fds = max(most_fds, len(os.listdir("/proc/%d/fd" % pid)))
            with attack.lock:
                least_open = min(least_open, attack.open_now)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
    finally:
        attack.stop.set()
        attack.join(10)
    print("%d probes, %d failed; attack: %d connects, %d dropped by the server, at least %d "
          "open at a time; daemon fds %d before, at most %d during"
          % (probes, len(failures), attack.connects, attack.dropped, least_open, fds_before,
             most_fds))
    assert attack.connects >= len(slots)
    assert not failures, "\n".join(failures)
    # more than the 64 connections that used to block the endpoint
    assert least_open > 64, "the attack did not hold connections: %d" % least_open
    # open connections stay within the limit (twice it: dropped ones not yet reaped)
    assert most_fds <= fds_before + 2 * MAX_CONNECTIONS + 8, (fds_before, most_fds)
    assert http_get(daemon.metrics_url + "/readyz")[0] == 200
