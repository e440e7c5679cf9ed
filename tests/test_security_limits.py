"""Security defaults and limits of diffragd.

- Defaults bind to loopback: the embedded configuration listens on 127.0.0.1 (clients, metrics)
  with no worker endpoint, and a daemon started on it has no listening socket on any other
  address (checked in /proc) and cannot be reached on the host's other addresses.
- Every size limit is enforced before allocating: thousands of small messages that claim
  huge sizes (4 GiB strings and binaries, arrays and maps of 2^32-1 entries, counts above
  max_docs / max_stop / top_k, nesting 60 000 deep) and a raw ZMTP frame header announcing
  1 TiB are refused with the right codes (or, for the frame, the connection dropped), while
  the daemon's resident memory stays within a few MiB.
- No request names a path: collection names and document ids that look like paths
  ("../../x", "/etc/passwd") are stored as names; the data directory holds only LMDB's two
  files, nothing appears outside it, and the daemon holds no file open elsewhere."""
import os
import pathlib
import socket
import struct
import subprocess
import time

import msgpack
import pytest

from daemon_util import DIFFRAGD, Daemon, fast_model, free_port, http_get, sanitized


def rss_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fast_model(tmp_path_factory.mktemp("models"))


def listening_addresses(pid):
    """(address, port) of every TCP socket of pid in LISTEN state."""
    inodes = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            link = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table, fam in (("tcp", 4), ("tcp6", 6)):
        with open("/proc/%d/net/%s" % (pid, table)) as f:
            next(f)
            for line in f:
                parts = line.split()
                local, state, inode = parts[1], parts[3], parts[9]
                if state != "0A" or inode not in inodes:
                    continue
                addr, port = local.split(":")
                raw = bytes.fromhex(addr)
                if fam == 4:
                    ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
                else:
                    ip = socket.inet_ntop(socket.AF_INET6,
                                          b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                out.append((ip, int(port, 16)))
    return out


def host_address():
    """An address of this host that is not loopback, or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


def test_defaults_bind_loopback(tmp_path, model):
    r = subprocess.run([str(DIFFRAGD), "--config", "/dev/null", "--print-config"],
                       capture_output=True, text=True, timeout=30)
    cfg = dict(l.split(" = ", 1) for l in r.stdout.splitlines() if " = " in l and not l.startswith("#"))
    print({k: cfg[k] for k in ("listen", "metrics_listen", "http_listen", "worker_listen",
                               "curve_secret_key_file", "http_api_key_file")})
    assert cfg["listen"] == "tcp://127.0.0.1:7400"
    assert cfg["metrics_listen"] == "127.0.0.1:9400"
    assert cfg["http_listen"] == "127.0.0.1:7480" and cfg["http_allow_remote"] == "0"
    assert cfg["worker_listen"] == '""' and cfg["curve_secret_key_file"] == '""'
    # the same hosts, on ports of the test's own (another daemon may hold 7400/9400/7480)
    port, mport, hport = free_port(), free_port(), free_port()
    d = Daemon(tmp_path, model, workers=1, threads=1, listen="tcp://127.0.0.1:%d" % port,
               metrics_listen="127.0.0.1:%d" % mport, http_listen="127.0.0.1:%d" % hport)
    d.endpoint, d.metrics_url = "tcp://127.0.0.1:%d" % port, "http://127.0.0.1:%d" % mport
    with d:
        addrs = listening_addresses(d.proc.pid)
        print("listening sockets:", addrs)
        assert sorted(p for _, p in addrs) == sorted([port, mport, hport])
        assert all(ip == "127.0.0.1" for ip, _ in addrs), addrs
        ip = host_address()
        print("host address:", ip)
        if ip:
            for p in (port, mport, hport):
                with socket.socket() as s:
                    s.settimeout(2)
                    assert s.connect_ex((ip, p)) != 0, "reachable on %s:%d" % (ip, p)
            assert http_get("http://%s:%d/metrics" % (ip, mport), 1)[0] == 0
        assert d.stop() == 0


MAX_MSG = 64 * 1024


def claims():
    """(name, message, expected code) for messages far smaller than what they claim."""
    head = b"\x82\xa1v\x01\xa2op"           # {"v": 1, "op": ...
    q = msgpack.packb
    base = {"v": 1, "op": "query", "question": "q?", "docs": [{"text": "t"}]}

    def with_(**kw):
        m = dict(base)
        m.update(kw)
        return q(m)

    return [
        ("map of 2^32-1 pairs", b"\xdf\xff\xff\xff\xff" + q("v") + q(1), "bad_request"),
        ("array of 2^32-1 docs",
         b"\x84\xa1v\x01\xa2op\xa6ingest\xaacollection\xa1c\xa4docs\xdd\xff\xff\xff\xff", "bad_request"),
        ("string of 4 GiB", head + b"\xdb\xff\xff\xff\xff" + b"ping", "bad_request"),
        ("binary of 4 GiB", b"\x83\xa1v\x01\xa2op\xa4ping\xa1x\xc6\xff\xff\xff\xff", "bad_request"),
        ("ext of 4 GiB", b"\x83\xa1v\x01\xa2op\xa4ping\xa1x\xc9\xff\xff\xff\xff\x01", "bad_request"),
        ("nesting 60000 deep", b"\x83\xa1v\x01\xa2op\xa4ping\xa1x" + b"\x91" * 60000 + b"\xc0",
         "bad_request"),
        ("docs above max_docs", with_(docs=[{"text": "t%d" % i} for i in range(5)]), "too_large"),
        ("ids above max_docs", q({"v": 1, "op": "delete", "collection": "c",
                                  "ids": ["i%d" % i for i in range(5000)]}), "too_large"),
        ("stop above max_stop", with_(stop=["s%d" % i for i in range(1000)]), "too_large"),
        ("top_k 2^63", with_(top_k=2**63), "too_large"),
        ("max_tokens 2^40", with_(max_tokens=2**40), "too_large"),
        ("max_context_tokens 2^40", with_(max_context_tokens=2**40), "too_large"),
        ("list limit 2^32", q({"v": 1, "op": "list", "collection": "c", "limit": 2**32}), "too_large"),
        ("question over its cap", with_(question="x" * 5000), "too_large"),
        ("message over max_message_bytes", with_(question="q", docs=[{"text": "y" * (MAX_MSG + 10)}]),
         "too_large"),
        ("60 KB meta, stored (a real ingest)", q({"v": 1, "op": "ingest", "collection": "c",
                                 "docs": [{"id": "a", "text": "t", "meta": {"m": "z" * 60000}}]}),
         "ok"),
    ]


def zmtp_oversize_frame(port, size):
    """Speaks ZMTP 3.0 (NULL mechanism) as a DEALER and announces one frame of `size` bytes.
    Returns True when the daemon closed the connection."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL" + b"\x00" * 16 +
                  b"\x00" + b"\x00" * 31)
        greeting = b""
        while len(greeting) < 64:
            chunk = s.recv(64 - len(greeting))
            if not chunk:
                return True
            greeting += chunk
        body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        s.sendall(b"\x04" + bytes([len(body)]) + body)
        s.sendall(b"\x02" + struct.pack(">Q", size) + b"x" * 1024)
        s.settimeout(5)
        try:
            while True:
                data = s.recv(65536)
                if not data:
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False
    finally:
        s.close()


def sanitizer_env():
    """A daemon built with AddressSanitizer keeps freed blocks in a quarantine (256 MiB by
    default) before reusing them, so its RSS grows with any traffic: turned off here, the RSS
    comparison measures what the daemon itself holds."""
    if not sanitized():
        return None
    opts = os.environ.get("ASAN_OPTIONS")
    return {"ASAN_OPTIONS": (opts + ":" if opts else "") +
            "quarantine_size_mb=0:thread_local_quarantine_size_kb=0"}


def test_limits_before_allocation(tmp_path, model):
    d = Daemon(tmp_path, model, workers=1, threads=1, max_message_bytes=MAX_MSG, max_docs=4,
               max_question_bytes=200, max_stop=4, max_top_k=50, max_tokens=64,
               max_context_tokens=1024, log_level="warn", env=sanitizer_env())
    cases = claims()
    with d:
        c = d.client()
        _, r = c.call({"v": 1, "op": "ping"})
        assert r["ok"]
        # warm up the allocator with the same traffic before the baseline
        for name, msg, want in cases:
            c.send(msg)
            c.recv(10)
        rss0 = rss_kib(d.proc.pid)
        rounds = 40
        wrong = []
        t0 = time.time()
        for _ in range(rounds):
            for name, msg, want in cases:
                c.send(msg)
                r = c.recv(10)
                got = "ok" if r.get("ok") else r["error"]["code"]
                if got != want:
                    wrong.append((name, want, r))
        claimed = sum(len(m) for _, m, _ in cases) * rounds
        assert not wrong, wrong[:3]
        dropped = [zmtp_oversize_frame(d.port, size) for size in (1 << 40, 1 << 33, 4 * MAX_MSG + 65537)]
        _, r = c.call({"v": 1, "op": "ping"})
        assert r["ok"], r
        rss1 = rss_kib(d.proc.pid)
        print("%d small messages claiming up to 4 GiB each (%.1f MiB sent) in %.1f s, then 3 raw "
              "frames announcing 1 TiB, 8 GiB, 4 x max + 64 KiB + 1: RSS %.1f -> %.1f MiB; "
              "connections dropped %s" % (rounds * len(cases), claimed / 2**20, time.time() - t0,
                                          rss0 / 1024, rss1 / 1024, dropped))
        assert all(dropped), dropped
        assert rss1 - rss0 < 8 * 1024, (rss0, rss1)
        assert d.stop() == 0


def test_no_path_outside_the_data_dir(tmp_path, model):
    names = ["../../escape", "/etc/passwd", "a/../../b", "..", ".", "~root", "x\\y", "data.mdb",
             "lock.mdb", "%2e%2e%2fup", "\u2024\u2024/dots"]
    before = set(p for p in tmp_path.rglob("*"))
    d = Daemon(tmp_path, model, workers=1, threads=1)
    with d:
        c = d.client()
        for n in names:
            _, r = c.call({"v": 1, "op": "ingest", "collection": n,
                           "docs": [{"id": "../../../etc/shadow", "text": "kept as a name: " + n},
                                    {"id": "/dev/null", "title": "../t", "text": "also a name"}]})
            assert r["ok"], (n, r)
        _, r = c.call({"v": 1, "op": "list"})
        assert sorted(r["collections"], key=lambda s: s.encode()) == sorted(names, key=lambda s: s.encode())
        for n in names:
            _, g = c.call({"v": 1, "op": "get", "collection": n, "doc_id": "../../../etc/shadow"})
            assert g["ok"] and g["doc"]["id"] == "../../../etc/shadow" and n in g["doc"]["text"], g
        files = sorted(p.name for p in d.data_dir.iterdir())
        print("data directory:", files)
        assert files == ["data.mdb", "lock.mdb"]
        allowed = {str(d.data_dir / "data.mdb"), str(d.data_dir / "lock.mdb"), str(model),
                   str(d.log_path), "/dev/null"}
        opened = set()
        for fd in os.listdir("/proc/%d/fd" % d.proc.pid):
            try:
                link = os.readlink("/proc/%d/fd/%s" % (d.proc.pid, fd))
            except OSError:
                continue
            if link.startswith("/"):
                opened.add(link)
        print("files the daemon holds open:", sorted(opened))
        assert opened <= allowed, opened - allowed
        assert d.stop() == 0
    after = set(p for p in tmp_path.rglob("*"))
    new = sorted(str(p.relative_to(tmp_path)) for p in after - before)
    assert all(n.startswith(d.data_dir.name) or n == d.log_path.name for n in new), new
    assert not pathlib.Path(tmp_path.parent / "escape").exists()
