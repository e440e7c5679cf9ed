"""Helpers for the diffragd end-to-end tests: tiny models, a daemon on loopback, a client."""
import http.client
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import msgpack
import pytest
import zmq

from conftest import BUILD, ROOT, asan_built

DIFFRAGD = BUILD / "diffragd"


# Three short documents the daemon tests ask about.
SAMPLE_DOCS = [
    {"id": "rhine", "title": "Rhine", "text": "The Rhine is a European river that begins in the "
     "Swiss canton of Graubünden and flows into the North Sea. It is about 1,230 km long."},
    {"id": "paris", "title": "Paris", "text": "Paris is the capital and most populous city of "
     "France, with an estimated population of 2,102,650 residents."},
    {"id": "oxygen", "title": "Oxygen", "text": "Oxygen is a chemical element with symbol O and "
     "atomic number 8. It is a highly reactive nonmetal and oxidizing agent."},
]


def sanitized():
    """Whether the diffragd under test is built with AddressSanitizer (BUILD=build/asan)."""
    return asan_built(DIFFRAGD)


_recent_ports = []


def free_port():
    """A loopback port nothing listens on now, and not one this process handed out lately: the
    kernel may give the same free port to two binds in a row, and a daemon whose client and
    metrics ports coincide would answer its own readiness probe with ZeroMQ's greeting. In a
    parallel run (pytest-xdist) each worker takes only the ports whose half's remainder by the
    number of workers is its own number (Linux gives bind() odd ports), so that two workers
    never hand out the same port."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    me = int((os.environ.get("PYTEST_XDIST_WORKER") or "gw0").removeprefix("gw") or 0)
    for _ in range(100000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if (port >> 1) % workers == me % workers and port not in _recent_ports:
            _recent_ports.append(port)
            del _recent_ports[:-256]
            return port
    raise RuntimeError("free_port: no free loopback port for worker %d of %d" % (me, workers))


def gen_model(path, *args):
    """A tiny random llama (tools/gen-tiny-model); cached by path. Its context_length is 8192
    unless args give --ctx: diffragd serves no more than a model's context (max_context_tokens
    0 chooses it minus max_tokens), and gen-tiny-model writes 2048 by default."""
    path = pathlib.Path(path)
    args = [str(a) for a in args]
    if "--ctx" not in args:
        args += ["--ctx", "8192"]
    if not path.exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "gen-tiny-model"), str(path),
                        "--arch", "llama", *args],
                       check=True, capture_output=True, text=True)
    return path


def fast_model(dirpath):
    """Thousands of tokens per second: for protocol, load and malformed-input tests."""
    return gen_model(pathlib.Path(dirpath) / "tiny-fast.gguf", "--seed", 7)


def slow_model(dirpath):
    """Several milliseconds per decode step on one thread (prefill a few hundred tokens per
    second): long enough to cancel, drain or kill a worker mid-generation."""
    return gen_model(pathlib.Path(dirpath) / "tiny-slow.gguf", "--layers", 12, "--dim", 512,
                     "--heads", 8, "--ffn", 2048, "--vocab", 512, "--ctx", 8192, "--seed", 3,
                     "--dtype", "q8_0")


def http_get(url, timeout=2.0):
    """(status, body text); status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, socket.timeout,
            http.client.HTTPException):
        # HTTPException: something that is not an HTTP server holds the port (see free_port)
        return 0, ""


class Client:
    """A DEALER client: one msgpack map per message, replies matched by the caller."""

    def __init__(self, ctx, endpoint, kind=zmq.DEALER):
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.kind = kind

    def send(self, msg):
        self.sock.send(msg if isinstance(msg, bytes) else msgpack.packb(msg))

    def send_frames(self, frames):
        self.sock.send_multipart(frames)

    def recv(self, timeout=10.0):
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("no reply within %.1f s" % timeout)
        frames = self.sock.recv_multipart()
        # a request sent with an empty delimiter frame (REQ style) is answered the same way
        assert len(frames) == 1 or (len(frames) == 2 and frames[0] == b""), frames
        return msgpack.unpackb(frames[-1], raw=False)

    def poll(self, timeout):
        return bool(self.sock.poll(int(timeout * 1000)))

    def call(self, msg, timeout=30.0):
        """Send and collect every message up to the final reply: (deltas, final)."""
        self.send(msg)
        deltas = []
        while True:
            r = self.recv(timeout)
            if "delta" in r and "ok" not in r:
                deltas.append(r)
                continue
            return deltas, r

    def close(self):
        self.sock.close(0)


class Daemon:
    """diffragd on loopback with its own ports, data directory and log file."""

    def __init__(self, tmp_path, model, workers=2, threads=1, env=None, args=(), **keys):
        self.tmp = pathlib.Path(tmp_path)
        self.port = free_port()
        self.metrics_port = free_port()
        self.http_port = free_port()
        self.endpoint = "tcp://127.0.0.1:%d" % self.port
        self.metrics_url = "http://127.0.0.1:%d" % self.metrics_port
        self.http_url = "http://127.0.0.1:%d" % self.http_port
        self.data_dir = self.tmp / ("store-%d" % self.port)
        self.log_path = self.tmp / ("diffragd-%d.log" % self.port)
        opts = {"model": model, "data_dir": self.data_dir, "listen": self.endpoint,
                "metrics_listen": "127.0.0.1:%d" % self.metrics_port,
                "http_listen": "127.0.0.1:%d" % self.http_port, "workers": workers,
                "threads": threads, "log_level": "info"}
        opts.update(keys)
        self.argv = [str(DIFFRAGD), "--config", "/dev/null"]
        for k, v in opts.items():
            self.argv += ["--" + k, str(v)]
        self.argv += list(args)
        self.env = dict(os.environ, **(env or {}))
        self.proc = None
        self.ctx = zmq.Context()
        self.clients = []

    def start(self, wait_ready=True, timeout=60.0):
        for attempt in range(3):
            self.log = open(self.log_path, "wb")
            self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT,
                                         env=self.env)
            if not wait_ready:
                return self
            try:
                self.wait_ready(timeout)
                return self
            except AssertionError:
                # free_port() lets its port go before diffragd binds it, and another socket of
                # this machine (a client's outgoing one) can take it meanwhile: new ports, again
                if (attempt == 2 or self.proc.poll() is None
                        or "Address already in use" not in self.log_text()
                        or not self._new_ports()):
                    raise
                self.log.close()
        return self

    def _new_ports(self):
        """Fresh ports for the listen endpoints this object chose; False if the caller chose them."""
        i, j = self.argv.index("--listen") + 1, self.argv.index("--metrics_listen") + 1
        h = self.argv.index("--http_listen") + 1
        if (self.argv[i] != self.endpoint
                or self.argv[j] != "127.0.0.1:%d" % self.metrics_port
                or self.argv[h] not in ("", "127.0.0.1:%d" % self.http_port)):
            return False
        self.port, self.metrics_port = free_port(), free_port()
        self.endpoint = "tcp://127.0.0.1:%d" % self.port
        self.metrics_url = "http://127.0.0.1:%d" % self.metrics_port
        self.argv[i], self.argv[j] = self.endpoint, "127.0.0.1:%d" % self.metrics_port
        if self.argv[h]:
            self.http_port = free_port()
            self.http_url = "http://127.0.0.1:%d" % self.http_port
            self.argv[h] = "127.0.0.1:%d" % self.http_port
        return True

    def wait_ready(self, timeout=60.0):
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise AssertionError("diffragd exited %d:\n%s" % (self.proc.returncode,
                                                                  self.log_text()[-3000:]))
            if http_get(self.metrics_url + "/readyz", 0.5)[0] == 200:
                return
            time.sleep(0.05)
        raise AssertionError("diffragd not ready after %.0f s:\n%s" % (timeout,
                                                                       self.log_text()[-3000:]))

    def client(self, kind=zmq.DEALER):
        c = Client(self.ctx, self.endpoint, kind)
        self.clients.append(c)
        return c

    def metrics(self):
        status, body = http_get(self.metrics_url + "/metrics")
        assert status == 200, status
        return body

    def metric(self, name, **labels):
        """Value of one sample of /metrics (0 when absent)."""
        want = ",".join('%s="%s"' % kv for kv in labels.items())
        key = name + ("{%s}" % want if labels else "")
        for line in self.metrics().splitlines():
            if line.startswith("#"):
                continue
            k, _, v = line.rpartition(" ")
            if k == key:
                return float(v)
        return 0.0

    def log_text(self):
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def send_signal(self, sig):
        self.proc.send_signal(sig)

    def stop(self, sig=signal.SIGTERM, timeout=30.0):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("diffragd did not stop within %.0f s" % timeout)
        for c in self.clients:
            c.close()
        self.clients = []
        if not self.ctx.closed:
            self.ctx.term()
        if not self.log.closed:
            self.log.close()
        return self.proc.returncode

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for c in self.clients:
            c.close()
        self.clients = []
        if not self.ctx.closed:
            self.ctx.term()
        if not self.log.closed:
            self.log.close()


def squad_article(squad_dir, nth=0):
    """The nth SQuAD article (file order) with at least 4 paragraphs and 2 answerable
    questions: its first 6 paragraphs and the first two of those questions."""
    passages = [json.loads(l) for l in open(squad_dir / "passages.jsonl")]
    questions = [json.loads(l) for l in open(squad_dir / "questions.jsonl")]
    by_title = {}
    for p in passages:
        by_title.setdefault(p["title"], []).append(p)
    seen = 0
    for ps in by_title.values():
        ids = {p["id"] for p in ps}
        qs = [q for q in questions if q["gold_passage_id"] in ids and not q["is_impossible"]]
        if len(ps) >= 4 and len(qs) >= 2:
            if seen == nth:
                return ps[:6], [qs[0]["question"], qs[1]["question"]]
            seen += 1
    pytest.fail("no SQuAD article %d with 4 paragraphs and 2 answerable questions" % nth)


def query(question, docs=None, **kw):
    m = {"v": 1, "op": "query", "question": question}
    if docs is not None:
        m["docs"] = docs
    m.update(kw)
    return m
