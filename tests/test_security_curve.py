"""CurveZMQ on the client socket (docs/security.md). The daemon's secret key comes from a key
file, and its ZAP handler admits only the client public keys listed in curve_allowed_keys.

- a client with an allowed key is served (ping, ingest, streamed query);
- a client with a key not in the list, a plain (non-CURVE) client, and a client that has the
  wrong server key get no reply at all: their handshakes fail (seen on the socket monitor as
  HANDSHAKE_FAILED_AUTH / _PROTOCOL / no handshake), and refusals are counted in /metrics;
- traffic is encrypted: a relay between an allowed client and the daemon never sees the
  question or the answer in clear (it does for a plain daemon);
- SIGHUP re-reads the allowed keys: a key added to the file is admitted, one removed is
  refused, without a restart; a directory of *.pub files works as the list;
- bad key material stops the daemon before it is ready: no key in the secret file, a line
  that is not a key in the allowed list, allowed keys without a secret key."""
import os
import signal
import socket
import subprocess
import threading
import time

import pytest
import zmq

from daemon_util import DIFFRAGD, Daemon, fast_model, query

DOCS = [{"id": "a", "text": "The Rhine flows from the Alps to the North Sea."},
        {"id": "b", "text": "Paris is the capital of France."}]
SECRET_QUESTION = "Where does the zebrafish quartermaster sleep?"
HANDSHAKE_ENDS = {zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                  zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}


def write_key(path, z85, mode=0o600, comment=True):
    text = ("# CurveZMQ key\n\n" if comment else "") + z85.decode() + "\n"
    path.write_text(text)
    os.chmod(path, mode)
    return path


class CurveClient:
    def __init__(self, ctx, endpoint, server_public=None, keys=None):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a refused client may have no connection to queue on: never block the test in send
        self.sock.setsockopt(zmq.SNDTIMEO, 2000)
        if server_public is not None:
            pub, sec = keys if keys else zmq.curve_keypair()
            self.sock.curve_serverkey = server_public
            self.sock.curve_publickey = pub
            self.sock.curve_secretkey = sec
        self.monitor = self.sock.get_monitor_socket()
        self.seen = []
        self.sock.connect(endpoint)

    def drain(self):
        """Reads the monitor's pending events (an unread monitor can stall libzmq's I/O thread)."""
        from zmq.utils.monitor import recv_monitor_message
        while self.monitor.poll(0):
            self.seen.append(recv_monitor_message(self.monitor)["event"])

    def events(self, wait=0.0):
        end = time.time() + wait
        while True:
            self.drain()
            left = end - time.time()
            if left <= 0 or not self.monitor.poll(int(left * 1000)):
                self.drain()
                return list(self.seen)

    def handshake(self, timeout=20.0):
        """Waits until the socket's first handshake ends; returns the events seen so far."""
        end = time.time() + timeout
        while not HANDSHAKE_ENDS & set(self.seen) and time.time() < end:
            self.events(0.05)
        return self.events()

    def refused(self, msg):
        """Sends msg to a daemon expected to refuse this client: waits for the handshake to end
        (a condition, not a time), then half a second more for a reply that must not come.
        Returns (reply or None, monitor events)."""
        import msgpack
        try:
            self.sock.send(msgpack.packb(msg))
        except zmq.Again:
            pass
        ev = self.handshake()
        r = msgpack.unpackb(self.sock.recv(), raw=False) if self.sock.poll(500) else None
        return r, ev + self.events()

    def call(self, msg, timeout=10.0):
        import msgpack
        deltas = []
        try:
            self.sock.send(msgpack.packb(msg))
        except zmq.Again:
            return deltas, None
        end = time.time() + timeout
        while True:
            self.drain()
            left = end - time.time()
            if left <= 0:
                return deltas, None
            if not self.sock.poll(int(min(left, 0.1) * 1000)):
                continue
            r = msgpack.unpackb(self.sock.recv(), raw=False)
            if "ok" in r:
                return deltas, r
            deltas.append(r)

    def close(self):
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fast_model(tmp_path_factory.mktemp("models"))


def curve_daemon(tmp_path, model, allowed, **keys):
    server_pub, server_sec = zmq.curve_keypair()
    key_file = write_key(tmp_path / "server.key", server_sec)
    opts = dict(workers=1, threads=1)
    opts.update(keys)
    d = Daemon(tmp_path, model, curve_secret_key_file=key_file, curve_allowed_keys=allowed, **opts)
    return d, server_pub


def test_allowed_and_refused_clients(tmp_path, model):
    a_pub, a_sec = zmq.curve_keypair()
    b_pub, b_sec = zmq.curve_keypair()
    allowed = tmp_path / "clients.keys"
    allowed.write_text("# clients allowed to ask\n%s alice\n\n" % a_pub.decode())
    d, server_pub = curve_daemon(tmp_path, model, allowed)
    ctx = zmq.Context()
    clients = []
    try:
        d.start()
        log = d.log_text()
        assert "CurveZMQ on the client socket" in log and server_pub.decode() in log, log[-2000:]
        assert "allowed client keys loaded\" keys=1" in log

        alice = CurveClient(ctx, d.endpoint, server_pub, (a_pub, a_sec))
        clients.append(alice)
        _, r = alice.call({"v": 1, "op": "ping", "id": 1})
        assert r and r["pong"] is True, r
        _, r = alice.call({"v": 1, "op": "ingest", "collection": "c", "docs": DOCS, "id": 2})
        assert r and r["ok"], r
        deltas, r = alice.call(query("Where does the Rhine flow?", collection="c", stream=True,
                                     max_tokens=8, id=3))
        assert r and r["ok"] and "".join(x["delta"] for x in deltas) == r["answer"], r
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED in alice.events(0.2)

        outcomes = {}
        for name, cl in (("unlisted key", CurveClient(ctx, d.endpoint, server_pub, (b_pub, b_sec))),
                         ("plain client", CurveClient(ctx, d.endpoint)),
                         ("wrong server key", CurveClient(ctx, d.endpoint, zmq.curve_keypair()[0]))):
            clients.append(cl)
            r, ev = cl.refused({"v": 1, "op": "ping", "id": name})
            outcomes[name] = (r, ev)
            print("%-17s reply %s, monitor events %s" % (name, r, sorted(set(ev))))
            assert r is None, (name, r)
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in ev, (name, ev)
        assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in outcomes["unlisted key"][1]
        assert {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL} & \
            set(outcomes["plain client"][1])
        refused = d.metric("diffrag_auth_handshakes_total", result="refused")
        allowed_n = d.metric("diffrag_auth_handshakes_total", result="allowed")
        print("handshakes: %d allowed, %d refused" % (allowed_n, refused))
        assert allowed_n >= 1 and refused >= 1
        assert "client refused by CurveZMQ authentication" in d.log_text()
        # only requests of alice reached the protocol layer
        assert d.metric("diffrag_requests_total", op="ping", code="ok") == 1

        # SIGHUP: bob is added, alice removed; new connections see the new list
        allowed.write_text("%s bob\n" % b_pub.decode())
        d.send_signal(signal.SIGHUP)
        end = time.time() + 10
        while "allowed client keys reloaded" not in d.log_text() and time.time() < end:
            time.sleep(0.05)
        bob = CurveClient(ctx, d.endpoint, server_pub, (b_pub, b_sec))
        alice2 = CurveClient(ctx, d.endpoint, server_pub, (a_pub, a_sec))
        clients += [bob, alice2]
        _, r = bob.call({"v": 1, "op": "ping", "id": "bob"})
        assert r and r["ok"], r
        r, ev = alice2.refused({"v": 1, "op": "ping", "id": "alice again"})
        assert r is None and zmq.EVENT_HANDSHAKE_FAILED_AUTH in ev, (r, ev)
        # a broken list on reload keeps the keys in force
        allowed.write_text("not a key\n")
        d.send_signal(signal.SIGHUP)
        end = time.time() + 10
        while "allowed client keys not reloaded" not in d.log_text() and time.time() < end:
            time.sleep(0.05)
        bob2 = CurveClient(ctx, d.endpoint, server_pub, (b_pub, b_sec))
        clients.append(bob2)
        _, r = bob2.call({"v": 1, "op": "ping", "id": "bob2"})
        assert r and r["ok"], r
        assert d.stop() == 0
    finally:
        for c in clients:
            c.close()
        ctx.destroy(0)
        d.__exit__(None, None, None)


class Relay(threading.Thread):
    """A TCP relay that records every byte passing through it in both directions."""

    def __init__(self, target_port):
        super().__init__(daemon=True)
        self.target = target_port
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen()
        self.port = self.srv.getsockname()[1]
        self.seen = bytearray()
        self.lock = threading.Lock()

    def pipe(self, a, b):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                with self.lock:
                    self.seen += data
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def run(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self.pipe, args=(c, u), daemon=True).start()
            threading.Thread(target=self.pipe, args=(u, c), daemon=True).start()


def relayed_answer(d, server_pub, keys):
    relay = Relay(d.port)
    relay.start()
    ctx = zmq.Context()
    cl = CurveClient(ctx, "tcp://127.0.0.1:%d" % relay.port, server_pub, keys)
    try:
        _, r = cl.call(query(SECRET_QUESTION, DOCS, max_tokens=8, id="q"), timeout=30)
        assert r and r["ok"], r
        time.sleep(0.2)
        with relay.lock:
            return r, bytes(relay.seen)
    finally:
        cl.close()
        ctx.destroy(0)
        relay.srv.close()


def test_traffic_is_encrypted(tmp_path, model):
    keys = zmq.curve_keypair()
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    write_key(allowed / "alice.pub", keys[0], mode=0o644)
    (allowed / "README").write_text("not a key file: ignored (only *.pub are read)\n")
    d, server_pub = curve_daemon(tmp_path, model, allowed)
    with d:
        r, wire = relayed_answer(d, server_pub, keys)
        print("CurveZMQ: %d bytes relayed, question in clear: %s"
              % (len(wire), SECRET_QUESTION.encode() in wire))
        assert SECRET_QUESTION.encode() not in wire and b"North Sea" not in wire
        assert r["answer"].encode() not in wire or len(r["answer"]) < 4
        assert d.stop() == 0
    plain = Daemon(tmp_path, model, workers=1, threads=1)
    with plain:
        r, wire = relayed_answer(plain, None, None)
        assert SECRET_QUESTION.encode() in wire, "the relay does not see traffic"
        assert plain.stop() == 0


def test_bad_key_material_stops_the_daemon(tmp_path, model):
    pub, sec = zmq.curve_keypair()
    empty = tmp_path / "empty.key"
    empty.write_text("# nothing here\n")
    short = write_key(tmp_path / "short.key", sec[:30])
    good_secret = write_key(tmp_path / "server.key", sec)
    bad_list = tmp_path / "bad.keys"
    bad_list.write_text("%s ok\n%s\n" % (pub.decode(), pub.decode()[:-1] + "~"))
    cases = [
        ({"curve_secret_key_file": tmp_path / "missing.key"}, "No such file"),
        ({"curve_secret_key_file": empty}, "no CurveZMQ key"),
        ({"curve_secret_key_file": short}, "short.key:3: not a CurveZMQ key"),
        ({"curve_secret_key_file": good_secret, "curve_allowed_keys": bad_list},
         "bad.keys:2: not a CurveZMQ public key"),
        ({"curve_secret_key_file": good_secret, "curve_allowed_keys": tmp_path / "nope"},
         "No such file"),
    ]
    for keys, expect in cases:
        d = Daemon(tmp_path, model, workers=1, threads=1, **keys)
        try:
            d.start(wait_ready=False)
            rc = d.proc.wait(30)
            log = d.log_text()
            print("exit %d: %s" % (rc, [l for l in log.splitlines() if "level=error" in l][:1]))
            assert rc != 0 and expect in log, log[-1500:]
            assert "cannot load the CurveZMQ keys" in log
        finally:
            d.__exit__(None, None, None)
    # allowed keys without the daemon's own key is a configuration error (exit 2)
    d = Daemon(tmp_path, model, workers=1, threads=1, curve_allowed_keys=bad_list)
    try:
        d.start(wait_ready=False)
        assert d.proc.wait(30) == 2
        assert "curve_allowed_keys needs curve_secret_key_file" in d.log_text()
    finally:
        d.__exit__(None, None, None)
    # --check-config reads the keys too
    r = subprocess.run([str(DIFFRAGD), "--config", "/dev/null", "--model", str(model),
                        "--curve-secret-key-file", str(short), "--check-config"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "not a CurveZMQ key" in r.stderr, (r.returncode, r.stderr)
    # a secret key others may read is accepted with a warning
    loose = write_key(tmp_path / "loose.key", sec, mode=0o644)
    d = Daemon(tmp_path, model, workers=1, threads=1, curve_secret_key_file=loose)
    with d:
        assert "readable by other users" in d.log_text()
        assert d.stop() == 0


def start_worker(tmp_path, model, endpoint, name, *extra):
    log = open(tmp_path / ("worker-%s.log" % name), "wb")
    p = subprocess.Popen([str(DIFFRAGD), "--config", "/dev/null", "--worker", "--connect", endpoint,
                          "--model", str(model), "--workers", "1", "--threads", "1",
                          "--heartbeat-ms", "200", *map(str, extra)],
                         stdout=log, stderr=subprocess.STDOUT)
    p.log_path = tmp_path / ("worker-%s.log" % name)
    return p


def test_remote_workers_authenticate(tmp_path, model):
    """With CurveZMQ on, a tcp:// worker_listen admits only workers whose keys are listed in
    curve_worker_keys: a listed worker joins and serves; an unlisted key, a plain worker and
    a client key (listed for clients only) never join."""
    from daemon_util import free_port
    w_pub, w_sec = zmq.curve_keypair()
    c_pub, c_sec = zmq.curve_keypair()
    x_pub, x_sec = zmq.curve_keypair()
    (tmp_path / "workers.keys").write_text("%s worker-1\n" % w_pub.decode())
    (tmp_path / "clients.keys").write_text("%s client\n" % c_pub.decode())
    wport = free_port()
    endpoint = "tcp://127.0.0.1:%d" % wport
    d, server_pub = curve_daemon(tmp_path, model, tmp_path / "clients.keys", workers=0,
                                 worker_listen=endpoint, curve_worker_keys=tmp_path / "workers.keys",
                                 heartbeat_ms=200)
    server_file = write_key(tmp_path / "server.pub", server_pub, mode=0o644)
    procs = []
    ctx = zmq.Context()
    try:
        d.start(wait_ready=False)
        for name, sec in (("unlisted", x_sec), ("client-key", c_sec)):
            procs.append(start_worker(tmp_path, model, endpoint, name, "--curve-server-key",
                                      server_file, "--curve-secret-key-file",
                                      write_key(tmp_path / (name + ".key"), sec)))
        procs.append(start_worker(tmp_path, model, endpoint, "plain"))
        # both keyed impostors have been refused at least once (the plain worker fails the
        # handshake before ZAP is asked); none joined meanwhile
        from daemon_util import http_get
        end = time.time() + 30
        while http_get(d.metrics_url + "/healthz")[0] != 200 and time.time() < end:
            time.sleep(0.05)
        while d.metric("diffrag_auth_handshakes_total", result="refused") < 2 and time.time() < end:
            time.sleep(0.05)
        status, why = http_get(d.metrics_url + "/readyz")
        refused = d.metric("diffrag_auth_handshakes_total", result="refused")
        print("three impostor workers: /readyz %d (%s), %d handshakes refused"
              % (status, why.strip(), refused))
        assert status == 503 and "no worker" in why
        assert refused >= 2
        assert "worker refused by CurveZMQ authentication" in d.log_text()
        procs.append(start_worker(tmp_path, model, endpoint, "good", "--curve-server-key",
                                  server_file, "--curve-secret-key-file",
                                  write_key(tmp_path / "good.key", w_sec)))
        d.wait_ready(30)
        cl = CurveClient(ctx, d.endpoint, server_pub, (c_pub, c_sec))
        _, r = cl.call(query("capital?", DOCS, max_tokens=4, id="via-remote"), timeout=30)
        cl.close()
        assert r and r["ok"] and r["usage"]["completion_tokens"] >= 1, r
        # exactly the listed worker is known. With 200 ms heartbeats a loaded machine can let
        # it miss its liveness window and rejoin: read the gauge until it settles (an impostor
        # that had joined would keep it above 1)
        known = lambda: (d.metric("diffrag_workers", state="idle") +
                         d.metric("diffrag_workers", state="busy"))
        end = time.time() + 10
        while known() != 1 and time.time() < end:
            time.sleep(0.1)
        assert known() == 1, d.log_text()[-2000:]
        assert d.stop() == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        ctx.destroy(0)
        d.__exit__(None, None, None)
