#!/usr/bin/env python3
"""`make soak`: diffragd under sustained load with a tiny random model.

64 clients (DEALER sockets spread over client processes, each keeping one request in flight)
send a mix of requests for --seconds: inline-document queries (a third streamed), queries over
a stored collection, ingests replacing documents of that collection, get, list, stats and
ping. The daemon runs with a small max_queue, so part of the load is answered `overloaded`.

Checked (exit status 1 when one fails):
- no reply lost: every request gets its final reply within --timeout;
- none duplicated or misdirected: every message carries the id of a request its socket sent
  and has in flight, at most one final reply per id, streamed deltas add up to the answer,
  citations name only that request's documents;
- the queue bound holds: sampled diffrag_queue_depth <= max_queue and diffrag_inflight_requests
  <= max_queue + workers x max_running; the replies each client counted, per operation and code (overloaded
  included), equal diffrag_requests_total;
- resident memory is flat: mean RSS of the last window is at most 5% above the first
  (windows of 30 s, or a quarter of a shorter run). The measured run follows --warmup seconds
  of the same load, after the two bounded structures that fill as they are used have been
  filled on purpose (the token-count cache and each worker's KV cache): what the daemon keeps
  while serving must stay flat, not what it touches for the first time.
Reported: requests per second, p50/p99 latency per operation, overloaded share, RSS.
"""
import argparse
import json
import multiprocessing as mp
import pathlib
import random
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import msgpack  # noqa: E402
import zmq  # noqa: E402

from daemon_util import Daemon, fast_model, http_get  # noqa: E402

COLL = "soak"
N_STORED = 200
WORDS = ("river harbour castle meadow lantern copper violet thunder orchard glacier falcon ember "
         "willow quartz saffron basalt cedar delta fjord grove").split()


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_request(rng, rid):
    """(message, expectation) for one request of the mix."""
    x = rng.random()
    if x < 0.55:
        docs = [{"id": "%s/%d" % (rid, i), "text": "%s %s." % (words(rng, rng.randrange(8, 60)), rid)}
                for i in range(rng.randrange(1, 4))]
        stream = rng.random() < 0.33
        msg = {"v": 1, "op": "query", "id": rid, "question": "Where is the %s?" % rng.choice(WORDS),
               "docs": docs, "max_tokens": rng.choice((2, 8, 24)), "stream": stream}
        return msg, {"op": "query", "docs": {d["id"] for d in docs}, "stream": stream}
    if x < 0.65:
        msg = {"v": 1, "op": "query", "id": rid, "question": "Which %s?" % rng.choice(WORDS),
               "collection": COLL, "max_tokens": 4, "top_k": 3}
        return msg, {"op": "query", "docs": None, "stream": False}
    if x < 0.75:
        doc = "s%03d" % rng.randrange(N_STORED)
        msg = {"v": 1, "op": "ingest", "id": rid, "collection": COLL,
               "docs": [{"id": doc, "text": words(rng, rng.randrange(50, 1500))}]}
        return msg, {"op": "ingest"}
    if x < 0.82:
        msg = {"v": 1, "op": "get", "id": rid, "collection": COLL,
               "doc_id": "s%03d" % rng.randrange(N_STORED)}
        return msg, {"op": "get"}
    if x < 0.89:
        return {"v": 1, "op": "list", "id": rid, "collection": COLL, "limit": 20}, {"op": "list"}
    if x < 0.95:
        return {"v": 1, "op": "stats", "id": rid, "collection": COLL}, {"op": "stats"}
    return {"v": 1, "op": "ping", "id": rid}, {"op": "ping"}


def check_final(exp, deltas, r):
    """A problem with a final reply, or None."""
    if not r["ok"]:
        return None if r["error"]["code"] == "overloaded" else "error %r" % (r["error"],)
    if exp["op"] == "query":
        if exp["stream"] and "".join(deltas) != r["answer"]:
            return "deltas do not add up to the answer"
        cited = {c["doc_id"] for c in r["citations"]}
        if exp["docs"] is not None and not cited <= exp["docs"]:
            return "citations of another request: %s" % sorted(cited - exp["docs"])[:3]
        if exp["docs"] is None and not all(c.startswith("s") for c in cited):
            return "citations outside the collection"
    elif exp["op"] == "ingest" and r.get("ingested") != 1:
        return "ingest reply %r" % (r,)
    return None


def client_process(endpoint, first, n_clients, seconds, timeout, seed, out):
    ctx = zmq.Context()
    poller = zmq.Poller()
    socks = []
    for k in range(n_clients):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        poller.register(s, zmq.POLLIN)
        socks.append({"sock": s, "name": "c%d" % (first + k), "seq": 0, "cur": None, "due": 0, "backoff": False,
                      "rng": random.Random(seed * 1000 + k)})
    by_sock = {c["sock"]: c for c in socks}
    counts = {}          # (op, code) -> replies
    lat = {}             # op or "overloaded" -> [ms]
    problems = []
    lost = 0
    done_ids = set()

    def send_next(c):
        c["seq"] += 1
        rid = "%s-%d" % (c["name"], c["seq"])
        msg, exp = make_request(c["rng"], rid)
        c["cur"] = {"id": rid, "exp": exp, "t0": time.perf_counter(), "deltas": []}
        c["sock"].send(msgpack.packb(msg))

    end = time.perf_counter() + seconds
    for c in socks:
        send_next(c)
    while True:
        now = time.perf_counter()
        active = [c for c in socks if c["cur"]]
        if not active and not any(c["due"] for c in socks):
            break
        for c in active:
            if now - c["cur"]["t0"] > timeout:
                problems.append("lost: %s got no reply in %.0f s" % (c["cur"]["id"], timeout))
                lost += 1
                c["cur"] = None
        for sock, _ in poller.poll(5 if any(c["due"] for c in socks) else 100):
            c = by_sock[sock]
            raw = sock.recv()
            try:
                r = msgpack.unpackb(raw, raw=False)
            except (ValueError, msgpack.ExtraData) as e:   # UnicodeDecodeError is a ValueError
                problems.append("undecodable reply (%s): %r" % (e, raw[:200]))
                continue
            cur = c["cur"]
            if cur is None or r.get("id") != cur["id"]:
                kind = "duplicate" if r.get("id") in done_ids else "misdirected"
                problems.append("%s message %r" % (kind, r)[:300])
                continue
            if "ok" not in r:
                if not cur["exp"].get("stream"):
                    problems.append("delta for a request that did not stream: %s" % cur["id"])
                cur["deltas"].append(r["delta"])
                continue
            ms = (time.perf_counter() - cur["t0"]) * 1e3
            op = cur["exp"]["op"]
            code = "ok" if r["ok"] else r["error"]["code"]
            c["backoff"] = code == "overloaded"
            counts[(op, code)] = counts.get((op, code), 0) + 1
            lat.setdefault("overloaded" if code == "overloaded" else op, []).append(ms)
            p = check_final(cur["exp"], cur["deltas"], r)
            if p:
                problems.append("%s: %s" % (cur["id"], p))
            done_ids.add(cur["id"])
            c["cur"] = None
            if c["backoff"]:
                # as a client told to retry later would: a short random pause
                c["due"] = time.perf_counter() + c["rng"].uniform(0.002, 0.05)
            elif time.perf_counter() < end:
                send_next(c)
        for c in socks:
            if c["due"] and time.perf_counter() >= c["due"]:
                c["due"] = 0
                if time.perf_counter() < end:
                    send_next(c)
    # anything arriving now would be a duplicate or a reply nobody asked for
    for sock, _ in poller.poll(500):
        while sock.poll(0):
            problems.append("late message %r" % (msgpack.unpackb(sock.recv(), raw=False),)[:300])
    for c in socks:
        c["sock"].close(0)
    ctx.term()
    out.put({"counts": [[k[0], k[1], v] for k, v in counts.items()], "lat": lat,
             "problems": problems[:50], "n_problems": len(problems), "lost": lost})


def parse_metrics(text):
    vals = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        k, _, v = line.rpartition(" ")
        vals[k] = float(v)
    return vals


def rss_kib(pid):
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100.0 * len(xs)))] if xs else float("nan")


def split(n, parts):
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def prefill_token_cache(c, n_words=400000, per_request=50000):
    """The context assembler's token-count cache is a fixed table (64 x 4096 words, 10.5 MiB)
    whose pages become resident as it fills, and it fills with every new word (request ids
    included) until it is three quarters full. Filled here first, so the soak measures what
    the daemon holds in steady state rather than the cache's first pages."""
    for start in range(0, n_words, per_request):
        text = " ".join("u%dx" % i for i in range(start, start + per_request))
        _, r = c.call({"v": 1, "op": "query", "question": "warm", "max_tokens": 1,
                       "docs": [{"id": "warm", "text": text}]}, timeout=120)
        assert r["ok"], r


def prefill_kv(c, n_workers):
    """Each worker's KV cache is allocated whole but its pages become resident only as prompts
    reach them: one query per worker that fills its context first."""
    text = " ".join("k%d" % i for i in range(12000))
    for i in range(n_workers):
        c.send({"v": 1, "op": "query", "id": "kv%d" % i, "question": "fill", "max_tokens": 1024,
                "max_context_tokens": 4096, "docs": [{"id": "kv", "text": text}], "top_k": 100})
    for _ in range(n_workers):
        r = c.recv(300)
        while "ok" not in r:
            r = c.recv(300)
        assert r["ok"], r


def run(args):
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="diffrag-soak-"))
    model = pathlib.Path(args.model) if args.model else fast_model(tmp)
    d = Daemon(tmp, model, workers=args.workers, threads=1, max_queue=args.max_queue,
               max_running=args.max_running, io_threads=2, log_level="warn")
    report = {"seconds": args.seconds, "clients": args.clients, "max_queue": args.max_queue,
              "workers": args.workers, "max_running": args.max_running}
    failures = []
    with d:
        c = d.client()
        rng = random.Random(1)
        for i in range(0, N_STORED, 50):
            _, r = c.call({"v": 1, "op": "ingest", "collection": COLL,
                           "docs": [{"id": "s%03d" % j, "text": words(rng, 300)}
                                    for j in range(i, i + 50)]})
            assert r["ok"], r
        prefill_token_cache(c)
        prefill_kv(c, args.workers)
        warm_out = mp.Queue()
        warm = [mp.Process(target=client_process, args=(d.endpoint, 10000 + 100 * i, n, args.warmup,
                                                         args.timeout, 100 + i, warm_out))
                for i, n in enumerate(split(args.clients, args.procs))]
        for p in warm:
            p.start()
        for _ in warm:
            w = warm_out.get(timeout=args.warmup + args.timeout + 60)
            if w["n_problems"]:
                failures.append("during the warm-up: %s" % w["problems"][:5])
        for p in warm:
            p.join(30)
        base = parse_metrics(d.metrics())
        samples = []          # (t, rss dict, queue_depth, inflight)
        stop = threading.Event()

        def sampler():
            t0 = time.time()
            while not stop.is_set():
                m = parse_metrics(http_get(d.metrics_url + "/metrics")[1])
                samples.append((time.time() - t0, rss_kib(d.proc.pid),
                                m.get("diffrag_queue_depth", 0), m.get("diffrag_inflight_requests", 0)))
                stop.wait(args.sample_s)

        out = mp.Queue()
        per = split(args.clients, args.procs)
        procs = []
        first = 0
        for i, n in enumerate(per):
            procs.append(mp.Process(target=client_process, args=(d.endpoint, first, n, args.seconds,
                                                                 args.timeout, i + 1, out)))
            first += n
        t_start = time.time()
        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        for p in procs:
            p.start()
        results = [out.get(timeout=args.seconds + args.timeout + 60) for _ in procs]
        for p in procs:
            p.join(30)
        wall = time.time() - t_start
        stop.set()
        th.join(5)
        final = parse_metrics(d.metrics())
        rc = d.stop()
        if rc != 0:
            failures.append("diffragd exited %d" % rc)

    counts, lat, problems, lost = {}, {}, [], 0
    for r in results:
        for op, code, v in r["counts"]:
            counts[(op, code)] = counts.get((op, code), 0) + v
        for k, v in r["lat"].items():
            lat.setdefault(k, []).extend(v)
        problems += r["problems"]
        lost += r["lost"]
    total = sum(counts.values())
    n_problems = sum(r["n_problems"] for r in results)
    if n_problems:
        failures.append("%d replies lost, duplicated, misdirected or wrong: %s"
                        % (n_problems, problems[:5]))
    # every reply a client counted is in /metrics, and nothing else was
    mismatch = []
    ops = {k[0] for k in counts} | {"ping", "query", "ingest", "get", "list", "stats"}
    codes = {k[1] for k in counts} | {"ok", "overloaded", "internal"}
    for op in sorted(ops):
        for code in sorted(codes):
            key = 'diffrag_requests_total{op="%s",code="%s"}' % (op, code)
            got = final.get(key, 0) - base.get(key, 0)
            if got != counts.get((op, code), 0):
                mismatch.append("%s: clients %d, metrics %d" % (key, counts.get((op, code), 0), got))
    if mismatch:
        failures.append("client counts differ from /metrics: %s" % mismatch[:5])
    overloaded = sum(v for (op, code), v in counts.items() if code == "overloaded")
    max_depth = max(s[2] for s in samples)
    max_inflight = max(s[3] for s in samples)
    if max_depth > args.max_queue or \
            max_inflight > args.max_queue + args.workers * args.max_running:
        failures.append("queue bound broken: queue_depth %d, inflight %d (max_queue %d, workers "
                        "%d, max_running %d)" % (max_depth, max_inflight, args.max_queue,
                                                 args.workers, args.max_running))
    win = min(30.0, args.seconds / 4.0)
    first_w = [s[1]["VmRSS"] for s in samples if s[0] <= win]
    last_w = [s[1]["VmRSS"] for s in samples if s[0] >= args.seconds - win and s[0] <= args.seconds]
    anon_first = [s[1].get("RssAnon", 0) for s in samples if s[0] <= win]
    anon_last = [s[1].get("RssAnon", 0) for s in samples if s[0] >= args.seconds - win and s[0] <= args.seconds]
    rss_first = sum(first_w) / len(first_w)
    rss_last = sum(last_w) / max(1, len(last_w))
    growth = rss_last / rss_first - 1
    if not last_w or growth > args.max_rss_growth:
        failures.append("resident memory grew %.1f%% (first %.0f s %.1f MiB, last %.0f s %.1f MiB)"
                        % (growth * 100, win, rss_first / 1024, win, rss_last / 1024))
    report.update({
        "requests": total, "wall_s": wall, "requests_per_s": total / wall,
        "counts": {"%s/%s" % k: v for k, v in sorted(counts.items())},
        "overloaded": overloaded, "overloaded_share": overloaded / max(1, total), "lost": lost,
        "problems": n_problems,
        "latency_ms": {k: {"n": len(v), "p50": pct(v, 50), "p99": pct(v, 99)} for k, v in sorted(lat.items())},
        "max_queue_depth": max_depth, "max_inflight": max_inflight,
        "rss_mib": {"first": rss_first / 1024, "last": rss_last / 1024, "growth": growth,
                    "window_s": win, "anon_first": sum(anon_first) / max(1, len(anon_first)) / 1024,
                    "anon_last": sum(anon_last) / max(1, len(anon_last)) / 1024,
                    "max": max(s[1]["VmRSS"] for s in samples) / 1024},
        "rss_trend_mib": [[round(s[0], 1), round(s[1]["VmRSS"] / 1024, 1)]
                          for s in samples[::max(1, len(samples) // 12)]],
        "failures": failures,
    })
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--warmup", type=float, default=30,
                    help="seconds of the same load before the measured run")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--procs", type=int, default=4, help="client processes")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-running", type=int, default=8,
                    help="requests each worker batches at once (the daemon's max_running)")
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=30, help="seconds a reply may take")
    ap.add_argument("--sample-s", type=float, default=0.5)
    ap.add_argument("--max-rss-growth", type=float, default=0.05)
    ap.add_argument("--model", help="GGUF model (default: a tiny random llama)")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args()
    rep = run(args)
    print("soak: %d clients, %.0f s, max_queue %d, %d workers: %d requests (%.0f/s), %d overloaded "
          "(%.1f%%), %d lost, %d problems"
          % (rep["clients"], rep["wall_s"], rep["max_queue"], rep["workers"], rep["requests"],
             rep["requests_per_s"], rep["overloaded"], 100 * rep["overloaded_share"], rep["lost"],
             rep["problems"]))
    for k, v in rep["latency_ms"].items():
        print("  %-10s n=%-7d p50 %8.2f ms  p99 %8.2f ms" % (k, v["n"], v["p50"], v["p99"]))
    r = rep["rss_mib"]
    print("  queue_depth max %d, inflight max %d; RSS first %.0f s %.1f MiB, last %.0f s %.1f MiB "
          "(%+.1f%%), anon %.1f -> %.1f MiB, max %.1f MiB"
          % (rep["max_queue_depth"], rep["max_inflight"], r["window_s"], r["first"], r["window_s"],
             r["last"], 100 * r["growth"], r["anon_first"], r["anon_last"], r["max"]))
    print("  RSS over time (s, MiB):", " ".join("%g:%.1f" % tuple(x) for x in rep["rss_trend_mib"]))
    for f in rep["failures"]:
        print("FAIL:", f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 1 if rep["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
