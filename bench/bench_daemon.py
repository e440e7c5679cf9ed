#!/usr/bin/env python3
"""`make bench-daemon`: diffragd's own costs on this machine, with a tiny random model so the
engine barely counts.

1. ping round trips per second and p50/p99 latency with 1, 8 and 32 concurrent clients (each
   client keeps one request in flight; clients are spread over two processes);
2. the daemon's overhead on a query: everything except engine time (prefill + decode as the
   worker measured them), both as the daemon sees it (total_ms minus engine time: decoding,
   validation, retrieval and context assembly, queueing, the hops to the worker and back,
   encoding) and as a client on the same machine sees it (round trip minus engine time).
"""
import argparse
import multiprocessing as mp
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import msgpack  # noqa: E402
import zmq  # noqa: E402

from daemon_util import Daemon, fast_model, query  # noqa: E402

PING = msgpack.packb({"v": 1, "op": "ping"})


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100.0 * len(xs)))]


def ping_clients(endpoint, n_sockets, seconds, out):
    ctx = zmq.Context()
    socks = []
    poller = zmq.Poller()
    for _ in range(n_sockets):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        poller.register(s, zmq.POLLIN)
        socks.append(s)
    # warm up the connections
    for s in socks:
        s.send(PING)
    for s in socks:
        s.recv()
    lat = []
    sent = {}
    end = time.perf_counter() + seconds
    for s in socks:
        sent[s] = time.perf_counter()
        s.send(PING)
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        for s, _ in poller.poll(100):
            s.recv()
            t = time.perf_counter()
            lat.append(t - sent[s])
            if t < end:
                sent[s] = t
                s.send(PING)
    for s in socks:
        s.close(0)
    ctx.term()
    out.put(lat)


def bench_ping(endpoint, n_clients, seconds):
    procs = min(2, n_clients)
    q = mp.Queue()
    share = [n_clients // procs + (1 if i < n_clients % procs else 0) for i in range(procs)]
    ps = [mp.Process(target=ping_clients, args=(endpoint, k, seconds, q)) for k in share]
    for p in ps:
        p.start()
    lat = []
    for _ in ps:
        lat += q.get()
    for p in ps:
        p.join()
    return len(lat) / seconds, pct(lat, 50) * 1e3, pct(lat, 99) * 1e3


def bench_query(d, n):
    c = d.client()
    doc = [{"id": "a", "title": "Rhine", "text": "The Rhine is a European river that flows from "
            "the Alps to the North Sea; it is about 1,230 km long."}]
    server, client = [], []
    for i in range(n + 10):
        t0 = time.perf_counter()
        _, r = c.call(query("How long is the Rhine?", doc, id=i, max_tokens=1))
        rt = (time.perf_counter() - t0) * 1e3
        t = r["timings"]
        engine = t["prefill_ms"] + t["decode_ms"]
        if i >= 10:   # warm-up
            server.append(t["total_ms"] - engine)
            client.append(rt - engine)
    return server, client


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="per ping measurement")
    ap.add_argument("--queries", type=int, default=300)
    a = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-daemon-"))
    model = fast_model(tmp)
    with Daemon(tmp, model, workers=2, threads=1, log_level="warn", max_queue=1024) as d:
        print("diffragd bench: tiny model %s, 2 workers, loopback TCP, %d cores"
              % (model.name, mp.cpu_count()))
        print("%-8s %12s %10s %10s" % ("clients", "pings/s", "p50 ms", "p99 ms"))
        for n in (1, 8, 32):
            rps, p50, p99 = bench_ping(d.endpoint, n, a.seconds)
            print("%-8d %12.0f %10.3f %10.3f" % (n, rps, p50, p99))
        server, client = bench_query(d, a.queries)
        print("query overhead (everything but prefill + decode), %d queries, 1 inline document:"
              % a.queries)
        print("  daemon side: p50 %.3f ms  p99 %.3f ms  mean %.3f ms"
              % (pct(server, 50), pct(server, 99), statistics.mean(server)))
        print("  client side: p50 %.3f ms  p99 %.3f ms  (adds the client's own socket and "
              "msgpack work)" % (pct(client, 50), pct(client, 99)))
        ok = pct(server, 50) <= 1.0
        print("daemon overhead p50 <= 1 ms: %s" % ("yes" if ok else "NO"))
        assert d.stop() == 0
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
