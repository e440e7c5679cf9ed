"""diffragd end to end on loopback: every op, streaming order, cancel mid-decode, deadlines,
inline documents and stored collections, REQ and DEALER envelopes, an ipc:// endpoint, the
configuration commands, and /metrics (promtool check + counters that move as expected)."""
import json
import shutil
import subprocess
import time

import msgpack
import pytest
import zmq

from conftest import BUILD, DEFAULT_MODEL, ROOT
from daemon_util import (SAMPLE_DOCS, DIFFRAGD, Daemon, fast_model, free_port, http_get, query,
                         slow_model)

DOCS = SAMPLE_DOCS
QWEN = ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return fast_model(d), slow_model(d)


@pytest.fixture(scope="module")
def fast(tmp_path_factory, models):
    d = Daemon(tmp_path_factory.mktemp("fast"), models[0], workers=2, max_queue=32)
    with d:
        yield d
        assert d.stop() == 0, d.log_text()[-2000:]


@pytest.fixture(scope="module")
def slow(tmp_path_factory, models):
    # one request at a time: the queueing tests need a busy worker
    d = Daemon(tmp_path_factory.mktemp("slow"), models[1], workers=1, max_tokens=4096,
               max_running=1)
    with d:
        yield d
        assert d.stop() == 0, d.log_text()[-2000:]


def test_ping_echoes_ids(fast):
    c = fast.client()
    for rid in (7, "abc-é", -3, 2**40):
        _, r = c.call({"v": 1, "op": "ping", "id": rid})
        # the model is named by its file (tiny-fast.gguf), not by the header's general.name
        # ("tiny-llama"); a file without general.file_type is named by its weights' type
        assert r == {"id": rid, "ok": True, "pong": True, "version": r["version"],
                     "model": "tiny-fast", "architecture": "llama", "quantization": "F32"}, r
    _, r = c.call({"v": 1, "op": "ping"})
    assert r["id"] is None and r["ok"] is True


@pytest.mark.parametrize("path,arch,quant", [(QWEN, "qwen2", "Q4_K_M"),
                                              (DEFAULT_MODEL, "llama", "Q4_1")],
                         ids=["qwen", "smollm2"])
def test_served_model_is_named_by_its_file(tmp_path, path, arch, quant):
    """ping, /v1/models and diffrag_build_info name the model by the file the user fetched (its
    base name without .gguf), not by the header's general.name ("Qwen2.5 Coder 0.5B Instruct
    AWQ" for every quantisation of it), and report the architecture and the quantisation
    (general.file_type) from the header. A broker of remote workers only, which loads just the
    tokenizer, is enough: ping and /v1/models need no worker."""
    if not path.exists():
        pytest.skip("%s absent (make model)" % path.name)
    stem = path.name[:-len(".gguf")]
    d = Daemon(tmp_path, path, workers=0, worker_listen="tcp://127.0.0.1:%d" % free_port())
    try:
        d.start(wait_ready=False)
        _, r = d.client().call({"v": 1, "op": "ping", "id": 1}, timeout=60)
        assert (r["model"], r["architecture"], r["quantization"]) == (stem, arch, quant), r
        status, body = http_get(d.http_url + "/v1/models")
        assert status == 200, body
        listed = json.loads(body)["data"]
        assert [(m["id"], m["diffrag"]) for m in listed] == \
            [(stem, {"architecture": arch, "quantization": quant})], listed
        status, body = http_get(d.http_url + "/v1/models/" + stem)
        assert status == 200 and json.loads(body)["id"] == stem, body
        info = [l for l in d.metrics().splitlines() if l.startswith("diffrag_build_info{")]
        assert info and ('model="%s",architecture="%s",quantization="%s"' % (stem, arch, quant)
                         in info[0]), info
    finally:
        assert d.stop() == 0, d.log_text()[-2000:]


def test_stream_order_and_reply_shape(fast):
    c = fast.client()
    deltas, r = c.call(query("How long is the Rhine river?", DOCS, id="s1", stream=True,
                             max_tokens=40))
    assert r["ok"] is True, r
    assert all(d["id"] == "s1" and set(d) == {"id", "delta"} for d in deltas)
    assert "".join(d["delta"] for d in deltas) == r["answer"]
    assert r["finish_reason"] in ("stop", "length")
    u, t = r["usage"], r["timings"]
    assert 1 <= u["completion_tokens"] <= 40
    assert u["prompt_tokens"] > u["context_tokens"] > 0
    for k in ("queue_ms", "retrieve_ms", "prefill_ms", "ttft_ms", "decode_ms", "total_ms"):
        assert t[k] >= 0, (k, t)
    assert t["total_ms"] >= t["prefill_ms"] + t["decode_ms"] - 1e-6
    assert t["ttft_ms"] >= t["prefill_ms"]
    print("deltas=%d completion_tokens=%d timings=%s" % (len(deltas), u["completion_tokens"], t))
    # the first citation is the document about the river
    cites = r["citations"]
    assert cites[0]["doc_id"] == "rhine", cites
    doc = next(d for d in DOCS if d["id"] == "rhine")
    s, e = cites[0]["offsets"]
    assert 0 <= s < e <= len(doc["text"].encode())
    assert [c["marker"] for c in cites] == list(range(1, len(cites) + 1))
    assert all(cites[i]["score"] >= cites[i + 1]["score"] for i in range(len(cites) - 1))


def test_inline_docs_without_ids_are_numbered(fast):
    c = fast.client()
    _, r = c.call(query("capital of France", [{"text": d["text"]} for d in DOCS], id=1,
                        max_tokens=4))
    assert r["ok"] and r["citations"][0]["doc_id"] == "2", r["citations"]
    assert r["usage"]["completion_tokens"] <= 4


def test_req_envelope_gets_one_reply_and_no_deltas(fast):
    c = fast.client(zmq.REQ)
    _, r = c.call(query("Where does the Rhine flow?", DOCS, id="req", stream=True, max_tokens=8))
    assert r["ok"] and r["id"] == "req" and "answer" in r
    _, r = c.call({"v": 1, "op": "ping", "id": 2})
    assert r["pong"] is True


def test_store_operations(fast):
    c = fast.client()
    coll = "ops"
    _, r = c.call({"v": 1, "op": "ingest", "id": 1, "collection": coll,
                   "docs": [dict(d, meta={"source": "test", "n": i}) for i, d in enumerate(DOCS)]})
    assert r["ok"] and r["ingested"] == 3 and r["docs"] == 3 and r["chunks"] >= 3, r
    _, r = c.call({"v": 1, "op": "stats", "id": 2, "collection": coll})
    assert r["docs"] == 3 and r["chunks"] >= 3 and r["text_bytes"] == sum(
        len(d["text"].encode()) for d in DOCS), r
    _, r = c.call({"v": 1, "op": "list", "id": 3})
    assert coll in r["collections"]
    _, r = c.call({"v": 1, "op": "list", "id": 4, "collection": coll, "limit": 2})
    assert [d["id"] for d in r["docs"]] == ["oxygen", "paris"] and r["next"] == "paris", r
    _, r = c.call({"v": 1, "op": "list", "id": 5, "collection": coll, "after": r["next"]})
    assert [d["id"] for d in r["docs"]] == ["rhine"] and r["next"] is None, r
    _, r = c.call({"v": 1, "op": "get", "id": 6, "collection": coll, "doc_id": "paris"})
    assert r["doc"]["text"] == DOCS[1]["text"] and r["doc"]["title"] == "Paris"
    assert r["doc"]["meta"] == {"source": "test", "n": 1}
    _, r = c.call(query("What is the atomic number of oxygen?", collection=coll, id=7,
                        max_tokens=8))
    assert r["ok"] and r["citations"][0]["doc_id"] == "oxygen", r
    _, r = c.call(query("river capital element", collection=coll, ids=["paris"], id=8,
                        max_tokens=4))
    assert {x["doc_id"] for x in r["citations"]} == {"paris"}, r["citations"]
    # inline documents and a collection together: hits from both
    _, r = c.call(query("Rhine river capital population", [{"id": "inline", "text":
                  "The capital has a large population near the river."}], collection=coll,
                  id=9, max_tokens=4))
    got = {x["doc_id"] for x in r["citations"]}
    assert "inline" in got and got & {"rhine", "paris"}, got
    _, r = c.call({"v": 1, "op": "delete", "id": 10, "collection": coll, "ids": ["paris", "nope"]})
    assert r["ok"] and r["deleted"] == 1 and r["docs"] == 2, r
    _, r = c.call({"v": 1, "op": "get", "id": 11, "collection": coll, "doc_id": "paris"})
    assert r["ok"] is False and r["error"]["code"] == "not_found", r
    for m in ({"v": 1, "op": "stats", "collection": "no-such"},
              {"v": 1, "op": "delete", "collection": "no-such", "ids": ["a"]},
              {"v": 1, "op": "list", "collection": "no-such"},
              query("anything", collection="no-such")):
        _, r = c.call(dict(m, id="nf"))
        assert r["ok"] is False and r["error"]["code"] == "not_found", (m, r)


def test_drop_collection(fast):
    c = fast.client()
    _, r = c.call({"v": 1, "op": "ingest", "id": "i1", "collection": "dropme", "docs": DOCS})
    assert r["ok"] and r["docs"] == 3, r
    _, r = c.call({"v": 1, "op": "ingest", "id": "i2", "collection": "keepme", "docs": DOCS[:1]})
    assert r["ok"], r
    before = fast.metric("diffrag_requests_total", op="drop", code="ok")
    _, r = c.call({"v": 1, "op": "drop", "id": "d1", "collection": "dropme"})
    assert r == {"id": "d1", "ok": True, "collection": "dropme", "dropped": 3}, r
    assert fast.metric("diffrag_requests_total", op="drop", code="ok") == before + 1
    _, r = c.call({"v": 1, "op": "list", "id": "l"})
    assert "dropme" not in r["collections"] and "keepme" in r["collections"], r
    for m in ({"v": 1, "op": "drop", "collection": "dropme"},
              {"v": 1, "op": "stats", "collection": "dropme"},
              {"v": 1, "op": "get", "collection": "dropme", "doc_id": "paris"},
              query("capital", collection="dropme")):
        _, r = c.call(dict(m, id="nf"))
        assert r["ok"] is False and r["error"]["code"] == "not_found", (m, r)
    for bad in ({"v": 1, "op": "drop", "id": "b"}, {"v": 1, "op": "drop", "id": "b", "collection": ""},
                {"v": 1, "op": "drop", "id": "b", "collection": 7}):
        _, r = c.call(bad)
        assert r["ok"] is False and r["error"]["code"] == "bad_request", (bad, r)
    verify = subprocess.run([str(BUILD / "diffrag-store"), "--data-dir", str(fast.data_dir), "verify"],
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # the same name again: a fresh collection, holding only what is ingested now
    _, r = c.call({"v": 1, "op": "ingest", "id": "i3", "collection": "dropme", "docs": DOCS[1:2]})
    assert r["ok"] and r["docs"] == 1, r
    _, r = c.call({"v": 1, "op": "list", "id": "l2", "collection": "dropme"})
    assert [d["id"] for d in r["docs"]] == [DOCS[1]["id"]], r


def test_daemon_stats_and_cancel_unknown(fast):
    c = fast.client()
    _, r = c.call({"v": 1, "op": "stats", "id": "st"})
    assert r["ok"] and r["workers"]["idle"] + r["workers"]["busy"] == 2, r
    assert r["kv_cache_bytes"] > 0 and r["draining"] is False
    _, r = c.call({"v": 1, "op": "cancel", "id": "c", "target": "never-sent"})
    assert r["ok"] is False and r["error"]["code"] == "not_found", r


def test_cancel_mid_decode(slow):
    c = slow.client()
    c.send(query("Tell me about the Rhine.", DOCS, id="long", stream=True, max_tokens=3000))
    seen = 0
    while seen < 5:
        r = c.recv(30)
        assert "delta" in r, r
        seen += 1
    t_cancel = time.time()
    c.send({"v": 1, "op": "cancel", "id": "stop-it", "target": "long"})
    ack = final = None
    late_deltas = 0
    while final is None:
        r = c.recv(30)
        if r.get("id") == "stop-it":
            ack = r
        elif "delta" in r and "ok" not in r:
            late_deltas += 1
        else:
            final = r
    latency_ms = (time.time() - t_cancel) * 1e3
    assert ack == {"id": "stop-it", "ok": True, "found": True, "state": "running"}, ack
    assert final["ok"] is True and final["finish_reason"] == "cancelled", final
    n = final["usage"]["completion_tokens"]
    step_ms = final["timings"]["decode_ms"] / max(1, n - 1)
    print("cancel: completion_tokens=%d step_ms=%.2f cancel_to_final_ms=%.2f late_deltas=%d"
          % (n, step_ms, latency_ms, late_deltas))
    assert n < 3000
    # The worker stops at its next decode step: the reply comes within about one step (plus
    # the socket round trip), not after the remaining thousands of tokens.
    assert latency_ms < 3 * step_ms + 50, (latency_ms, step_ms)


def test_cancel_queued_and_deadlines(slow):
    c = slow.client()
    c.send(query("Tell me about Paris.", DOCS, id="busy", max_tokens=3000))
    time.sleep(0.3)
    # queued behind it (one worker): cancel answers at once, the query gets `cancelled`
    c.send(query("And oxygen?", DOCS, id="queued", max_tokens=5))
    time.sleep(0.1)
    c.send({"v": 1, "op": "cancel", "id": "cq", "target": "queued"})
    got = {}
    while len(got) < 2:
        r = c.recv(10)
        got[r["id"]] = r
    assert got["cq"]["ok"] and got["cq"]["state"] == "queued", got
    assert got["queued"]["ok"] is False and got["queued"]["error"]["code"] == "cancelled", got
    # a deadline that passes while queued: deadline_exceeded, on time
    t0 = time.time()
    _, r = c.call(query("Rhine?", DOCS, id="dq", deadline_ms=300, max_tokens=5))
    waited = (time.time() - t0) * 1e3
    print("queued deadline: error after %.1f ms (deadline 300 ms)" % waited)
    assert r["ok"] is False and r["error"]["code"] == "deadline_exceeded", r
    assert 290 <= waited < 800, waited
    _, r = c.call({"v": 1, "op": "cancel", "id": "cb", "target": "busy"})
    assert r["ok"] and r["state"] == "running"
    r = c.recv(60)
    assert r["id"] == "busy" and r["finish_reason"] == "cancelled", r
    # a deadline that passes while generating: the partial answer, finish_reason deadline. It
    # must fall after the prompt's prefill: 1.5 s, or more where the build is slower (the
    # sanitizer build takes seconds over the busy query's prompt, of about the same length).
    deadline = max(1500, int(2 * r["timings"]["prefill_ms"]) + 1000)
    t0 = time.time()
    _, r = c.call(query("Rhine?", DOCS, id="dr", deadline_ms=deadline, max_tokens=3000),
                  timeout=deadline / 1e3 + 60)
    waited = (time.time() - t0) * 1e3
    step_ms = r["timings"]["decode_ms"] / max(1, r["usage"]["completion_tokens"] - 1)
    print("running deadline: reply after %.1f ms (deadline %d ms), %d tokens, step %.2f ms"
          % (waited, deadline, r["usage"]["completion_tokens"], step_ms))
    assert r["ok"] is True and r["finish_reason"] == "deadline", r
    assert 0 < r["usage"]["completion_tokens"] < 3000
    assert deadline <= waited < deadline + 3 * step_ms + 250, waited


def test_ipc_endpoint(tmp_path, models):
    sock = tmp_path / "diffragd.sock"
    d = Daemon(tmp_path, models[0], workers=1, listen="ipc://%s" % sock)
    d.endpoint = "ipc://%s" % sock
    with d:
        _, r = d.client().call({"v": 1, "op": "ping", "id": "ipc"})
        assert r["pong"] is True
        _, r = d.client().call(query("capital of France", DOCS, id="q", max_tokens=3))
        assert r["ok"] and r["citations"][0]["doc_id"] == "paris"
        assert d.stop() == 0


def test_metrics_promtool_and_counters(fast):
    status, body = http_get(fast.metrics_url + "/healthz")
    assert status == 200 and body == "ok\n"
    assert http_get(fast.metrics_url + "/readyz")[0] == 200
    assert http_get(fast.metrics_url + "/nope")[0] == 404
    before = {k: fast.metric(*k[:1], **dict(k[1:])) for k in (
        ("diffrag_requests_total", ("op", "query"), ("code", "ok")),
        ("diffrag_requests_total", ("op", "ping"), ("code", "bad_request")),
        ("diffrag_generated_tokens_total",), ("diffrag_prompt_tokens_total",),
        ("diffrag_time_to_first_token_seconds_count",),
        ("diffrag_request_duration_seconds_count", ("op", "query")))}
    c = fast.client()
    gen = prompt = 0
    for i in range(3):
        _, r = c.call(query("How long is the Rhine?", DOCS, id=i, max_tokens=6))
        gen += r["usage"]["completion_tokens"]
        prompt += r["usage"]["prompt_tokens"]
    _, r = c.call({"v": 1, "op": "ping", "id": "x", "extra": 1, "v2": [1]})
    assert r["ok"]  # unknown keys are ignored
    _, r = c.call({"v": 1, "op": "ping", "id": {"bad": "id"}})
    assert r["error"]["code"] == "bad_request"
    after = {k: fast.metric(*k[:1], **dict(k[1:])) for k in before}
    delta = {k[0] + str(k[1:]): after[k] - before[k] for k in before}
    print("metric deltas:", delta)
    vals = list(delta.values())
    assert vals == [3, 0, gen, prompt, 3, 3], delta
    # the malformed id never decoded the op: it counts under op="none"
    assert fast.metric("diffrag_requests_total", op="none", code="bad_request") >= 1
    assert fast.metric("diffrag_workers", state="idle") + fast.metric("diffrag_workers",
                                                                        state="busy") == 2
    assert fast.metric("diffrag_kv_cache_bytes") > 0
    assert ('diffrag_build_info{version="0.1.0",backend="cpu",model="tiny-fast",'
            'architecture="llama",quantization="F32"} 1') in fast.metrics()
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is required"
    p = subprocess.run([promtool, "check", "metrics"], input=fast.metrics(), text=True,
                       capture_output=True)
    print("promtool:", p.returncode, p.stdout.strip(), p.stderr.strip())
    assert p.returncode == 0, p.stdout + p.stderr


# ---- configuration commands ----

def run_diffragd(*args):
    return subprocess.run([str(DIFFRAGD), *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def parse_kv(text, commented=False):
    out = {}
    for line in text.splitlines():
        s = line.strip()
        if commented and s.startswith("#"):
            s = s[1:].strip()
        elif s.startswith("#") or not s:
            continue
        if "=" in s and " = " in s:
            k, _, v = s.partition(" = ")
            if k.isidentifier():
                out[k] = v
    return out


def test_print_config_and_deploy_file_list_every_key():
    p = run_diffragd("--config", "/dev/null", "--print-config")
    assert p.returncode == 0, p.stderr
    defaults = parse_kv(p.stdout)
    assert len(defaults) >= 25 and {"model", "data_dir", "listen", "worker_listen",
                                    "metrics_listen", "workers", "threads", "device", "max_queue",
                                    "max_message_bytes", "max_docs", "max_context_tokens",
                                    "max_tokens", "chunk_tokens", "kv_budget_bytes", "log_level",
                                    "drain_timeout"} <= set(defaults)
    deploy = (ROOT / "deploy" / "diffragd.conf").read_text()
    listed = parse_kv(deploy, commented=True)
    missing = set(defaults) - set(listed)
    assert not missing, missing
    # every key the deploy file leaves commented shows the embedded default
    commented = parse_kv("\n".join(l for l in deploy.splitlines() if l.startswith("#")),
                         commented=True)
    wrong = {k: (v, defaults[k]) for k, v in commented.items() if k in defaults and v != defaults[k]}
    assert not wrong, wrong
    # docs/configuration.md documents every key with its default
    doc = (ROOT / "docs" / "configuration.md").read_text()
    undocumented = [k for k, v in defaults.items() if "| `%s` | `%s` |" % (k, v) not in doc]
    assert not undocumented, undocumented
    # the file's own settings load and pass validation
    p = run_diffragd("--config", ROOT / "deploy" / "diffragd.conf", "--print-config")
    assert p.returncode == 0, p.stderr


def test_config_file_cli_override_and_errors(tmp_path, models):
    conf = tmp_path / "d.conf"
    conf.write_text("# comment\nmax_queue = 7   # trailing comment\nlog_level = \"debug\"\n"
                    "max-docs=12\n")
    p = run_diffragd("--config", conf, "--print-config", "--max-queue", "9", "--drain-timeout=5")
    kv = parse_kv(p.stdout)
    assert p.returncode == 0 and kv["max_queue"] == "9" and kv["log_level"] == "debug"
    assert kv["max_docs"] == "12" and kv["drain_timeout"] == "5", kv
    for text, needle in (("bogus = 1\n", "d.conf:1: unknown key"),
                         ("\n\nworkers = many\n", "d.conf:3: workers: not an integer"),
                         ("max_queue = 0\n", "max_queue: 0 is outside"),
                         ("max_message_bytes = 12parsecs\n", "not a size"),
                         ("just words\n", "expected `key = value`"),
                         ("chunk_overlap = 300\n", "must be below chunk_tokens"),
                         ("kv_type = q4\n", "kv_type: \"q4\" is not one of f16, f32, q8"),
                         ("kv_type = q8\ndevice = cuda\n", "kv_type q8 is for the CPU backend")):
        conf.write_text(text)
        p = run_diffragd("--config", conf, "--check-config")
        assert p.returncode == 2 and needle in p.stderr, (text, p.stderr)
    p = run_diffragd("--config", "/dev/null", "--check-config", "--model", models[0])
    assert p.returncode == 0 and "configuration ok" in p.stdout, p.stderr
    p = run_diffragd("--config", "/dev/null", "--check-config", "--model", tmp_path / "none.gguf")
    assert p.returncode == 1 and "none.gguf" in p.stderr
    p = run_diffragd("--config", tmp_path / "missing.conf", "--print-config")
    assert p.returncode == 2 and "missing.conf" in p.stderr
    p = run_diffragd("--no-such-flag", "1")
    assert p.returncode == 2 and "unknown option" in p.stderr
    p = run_diffragd("--help")
    assert p.returncode == 0 and "max_queue" in p.stdout


def test_budget_refusal_at_startup(tmp_path, models):
    # an explicit context the budget cannot hold: the worker's engine refuses it
    d = Daemon(tmp_path, models[0], workers=1, kv_budget_bytes="64KiB", max_context_tokens=2048)
    d.start(wait_ready=False)
    rc = d.proc.wait(30)
    log = d.log_text()
    d.stop()
    assert rc == 1 and "cannot start a worker" in log and "budget" in log, log[-1500:]
    # the automatic one shrinks to the budget, and gives up when no prompt would fit
    d = Daemon(tmp_path, models[0], workers=1, kv_budget_bytes="64KiB")
    d.start(wait_ready=False)
    rc = d.proc.wait(30)
    log = d.log_text()
    d.stop()
    assert rc == 1 and 'msg="no room for a prompt"' in log and "kv_budget_bytes" in log, log[-1500:]


def test_same_id_twice_in_flight_on_one_connection(slow):
    """A second request whose id is in flight from the same DEALER socket is refused at once
    (bad_request) and the first runs to its end; the id is free again after its reply. The same
    id from two sockets, and requests without an id, all run."""
    c = slow.client()
    first = query("Tell me about the Rhine.", DOCS, id=7, max_tokens=24)
    c.send(first)
    c.send(query("And Paris?", DOCS, id=7, max_tokens=4))
    refused = c.recv(30)
    assert refused == {"id": 7, "ok": False, "error": {
        "code": "bad_request",
        "message": "id 7 is already in flight on this connection: wait for its reply or "
                   "cancel it"}}, refused
    done = c.recv(60)
    assert done["id"] == 7 and done["ok"] is True and done["finish_reason"] in ("stop", "length")
    assert done["usage"]["completion_tokens"] >= 1
    assert not c.poll(0.3)   # one reply each: nothing else comes
    _, r = c.call(query("Rhine?", DOCS, id=7, max_tokens=2))
    assert r["ok"] is True, r
    # a string id; a cancel names the one live request with it
    c.send(query("Tell me about the Rhine.", DOCS, id="q", max_tokens=3000))
    c.send(query("Rhine?", DOCS, id="q", max_tokens=2))
    r = c.recv(30)
    assert r["id"] == "q" and r["error"]["code"] == "bad_request", r
    assert r["error"]["message"].startswith("id q is already in flight"), r
    _, r = c.call({"v": 1, "op": "cancel", "id": "stop-q", "target": "q"})
    assert r["ok"] is True and r["found"] is True, r
    r = c.recv(60)
    # cancelled while generating (finish_reason) or before its first token (error code)
    assert r["id"] == "q" and (r.get("finish_reason") == "cancelled" or
                               r.get("error", {}).get("code") == "cancelled"), r
    # the same id on two sockets, and no id twice on one socket: every one runs
    d = slow.client()
    c.send(query("Rhine?", DOCS, id="twin", max_tokens=4))
    d.send(query("Paris?", DOCS, id="twin", max_tokens=4))
    c.send(query("Oxygen?", DOCS, max_tokens=4))
    c.send(query("Oxygen?", DOCS, max_tokens=4))
    got = [c.recv(60) for _ in range(3)] + [d.recv(60)]
    assert all(r["ok"] is True for r in got), got
    assert sorted(str(r["id"]) for r in got) == ["None", "None", "twin", "twin"], got
