"""The OpenAI-compatible HTTP API against hostile or careless clients (docs/openai.md#security):

- a 16 MiB body of `{}` values is refused (413) before it is parsed into a tree, adding at most
  256 MiB to the daemon's resident memory, alone or three at once;
- 64 clients that send a request and never read its answer lock nobody out: /v1/models answers
  within 2 s, a chat request past the slots left for others gets 503 with Retry-After (never a
  silent close), and each stalled connection is closed within http_timeout of its last read,
  its query cancelled;
- a client that half-closes after its request (shutdown(SHUT_WR), as `nc -N` does) is
  answered, whole or streamed;
- history past 256 turns, or with turns and a system text over 4,096 bytes, is answered with
  the oldest turns left out and counted in `diffrag.context.history_left_out`;
- ambiguous framing (two Content-Lengths, Content-Length with chunked, HTTP/1.1 without Host,
  a NUL in a header value) gets 400 and a close, an unsupported transfer coding 501, at once;
- refusals are logged at most once a second, with the count of those held back."""
import http.client
import json
import re
import socket
import threading
import time

import pytest

from daemon_util import SAMPLE_DOCS, Daemon, fast_model, slow_model

DOCS = SAMPLE_DOCS
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fast_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, model):
    d = Daemon(tmp_path_factory.mktemp("api"), model, workers=1, threads=1)
    with d:
        yield d
        assert d.stop() == 0, d.log_text()[-2000:]


def status_kib(pid, field):
    with open("/proc/%d/status" % pid) as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))


def request_bytes(body, path=CHAT, extra=b""):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\n\r\n" % (path.encode(), extra, len(data))) + data


def read_all(s, timeout):
    """Everything the server sends until it closes (or timeout passes): (bytes, closed)."""
    s.settimeout(timeout)
    got, t_end = b"", time.time() + timeout
    while time.time() < t_end:
        try:
            b = s.recv(65536)
        except socket.timeout:
            return got, False
        except (ConnectionResetError, BrokenPipeError):
            return got, True
        if not b:
            return got, True
        got += b
    return got, False


def split_response(raw):
    """(status line and headers, body) of one raw HTTP/1.1 response, a chunked body decoded;
    the body is None when it is cut short."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return head, rest
    body = b""
    while True:
        size, sep, rest = rest.partition(b"\r\n")
        if not sep:
            return head, None
        n = int(size.split(b";")[0], 16)
        if n == 0:
            return head, body
        if len(rest) < n + 2:
            return head, None
        body, rest = body + rest[:n], rest[n + 2:]


def post(d, body, headers=None, timeout=30):
    c = http.client.HTTPConnection("127.0.0.1", d.http_port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    c.request("POST", CHAT, data, dict({"Content-Type": "application/json"}, **(headers or {})))
    r = c.getresponse()
    text = r.read()
    c.close()
    return r.status, json.loads(text) if text.startswith(b"{") else text, r


# ---- what one request may cost ----

def empties_body(size, value=b"{}"):
    head = b'{"messages":[{"role":"user","content":"How long is the Rhine?"}],"max_tokens":4,' \
           b'"diffrag":{"docs":["The Rhine is about 1,230 km long."]},"metadata":['
    n = (size - len(head) - 2) // (len(value) + 1)
    return head + b",".join([value] * n) + b"]}"


def test_a_body_of_empty_objects_costs_little(daemon):
    body = empties_body(16 * 1024 * 1024 - 4096)
    assert len(body) < 16 * 1024 * 1024
    pid = daemon.proc.pid
    # warm up: one ordinary request, so that the baseline holds the allocator's arenas
    status, r, _ = post(daemon, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                              "diffrag": {"docs": DOCS}})
    assert status == 200, r
    added = []
    for n in (1, 3):
        with open("/proc/%d/clear_refs" % pid, "w") as f:
            f.write("5")   # VmHWM := VmRSS
        rss0 = status_kib(pid, "VmRSS")
        results = [None] * n

        def one(i):
            results[i] = post(daemon, body, timeout=120)[:2]
        t0 = time.time()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        hwm = status_kib(pid, "VmHWM")
        added.append((hwm - rss0) / 1024)
        print("%d x %.1f MiB body of {}: %s in %.1f s; RSS %.0f MiB, peak %.0f MiB: +%.0f MiB"
              % (n, len(body) / 2**20, [s for s, _ in results], time.time() - t0, rss0 / 1024,
                 hwm / 1024, added[-1]))
        for status, r in results:
            assert status in (200, 413), (status, str(r)[:300])
            if status == 413:
                err = r["error"]
                assert err["code"] == "too_large" and "JSON values" in err["message"], r
        assert added[-1] <= 256, added
    # an ordinary request still goes through
    status, r, _ = post(daemon, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                              "diffrag": {"docs": DOCS}})
    assert status == 200, r


# ---- clients that never read ----

@pytest.fixture
def short_timeout(tmp_path, model):
    d = Daemon(tmp_path, model, workers=1, threads=1, http_timeout=2, max_tokens=7168,
               max_running=64)
    with d:
        yield d
        assert d.stop() == 0, d.log_text()[-2000:]


def test_clients_that_never_read_lock_nobody_out(short_timeout):
    api = short_timeout
    # 7,000 tokens streamed make about 1.5 MB: more than the kernel holds for a client that
    # reads nothing
    body = {"messages": [{"role": "user", "content": "Tell me about the Rhine."}],
            "max_tokens": 7000, "stream": True, "diffrag": {"docs": DOCS}}
    left0 = api.metric("diffrag_http_client_disconnects_total")
    held = []
    for _ in range(64):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # a small window: stalls soon
        s.connect(("127.0.0.1", api.http_port))
        s.sendall(request_bytes(body))
        held.append(s)
    try:
        time.sleep(1.0)
        t0 = time.time()
        c = http.client.HTTPConnection("127.0.0.1", api.http_port, timeout=10)
        try:
            c.request("GET", "/v1/models")
            r = c.getresponse()
            models = r.status, r.read()
        except (ConnectionError, http.client.HTTPException) as e:
            models = 0, repr(e).encode()
        c.close()
        took = time.time() - t0
        print("/v1/models with 64 clients that never read: %s in %.2f s" % (models[0], took))
        assert models[0] == 200 and took < 2, models
        # one more chat request while the slots for answers are taken: a prompt 503
        t0 = time.time()
        try:
            status, r, resp = post(api, dict(body, stream=False, max_tokens=4), timeout=10)
            retry = resp.getheader("Retry-After")
        except (ConnectionError, http.client.HTTPException) as e:
            status, r, retry = 0, repr(e), None
        print("a chat request meanwhile: %s in %.2f s, Retry-After %s" % (status, time.time() - t0,
                                                                          retry))
        assert status in (200, 503), (status, r)
        if status == 503:
            assert retry and r["error"]["code"] == "overloaded", r
        # the connections that read nothing are closed once http_timeout (2 s) passes without a
        # read, their queries cancelled; each got a 200 stream or a 503
        t_end = time.time() + 30
        closed, codes = 0, {}
        for s in held:
            got, done = read_all(s, max(0.1, t_end - time.time()))
            closed += done
            code = got[9:12].decode(errors="replace")
            codes[code] = codes.get(code, 0) + 1
        print("the 64: %d closed by the server within %.1f s; statuses %s"
              % (closed, 30 - (t_end - time.time()), codes))
        assert closed == 64 and set(codes) <= {"200", "503"}, (closed, codes)
        assert codes.get("503", 0) >= 1, codes
        assert api.metric("diffrag_http_client_disconnects_total") > left0
        assert "read nothing of its answer" in api.log_text()
    finally:
        for s in held:
            s.close()
    t_end = time.time() + 10
    while api.metric("diffrag_inflight_requests") and time.time() < t_end:
        time.sleep(0.1)
    assert api.metric("diffrag_inflight_requests") == 0


# ---- a half-closed client ----

@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slow")
    d = Daemon(tmp, slow_model(tmp), workers=1, threads=1)
    with d:
        yield d
        assert d.stop() == 0, d.log_text()[-2000:]


@pytest.mark.parametrize("stream", [False, True])
def test_a_half_closed_client_is_answered(slow, stream):
    # a system text of its own, so that no cached prefix makes the answer come too soon to tell
    system = "Answer request %s-%f." % (stream, time.time())
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Tell me about the Rhine."}],
            "max_tokens": 64, "stream": stream, "diffrag": {"docs": DOCS}}
    s = socket.create_connection(("127.0.0.1", slow.http_port))
    s.sendall(request_bytes(body))
    s.shutdown(socket.SHUT_WR)
    t0 = time.time()
    got, closed = read_all(s, 60)
    s.close()
    took = time.time() - t0
    # an interim 100 (Continue) may come first
    final = re.sub(rb"^(HTTP/1\.1 1\d\d [^\r]*\r\n\r\n)+", b"", got)
    print("half-closed, stream=%s: %r... in %.2f s" % (stream, final[:40], took))
    assert final.startswith(b"HTTP/1.1 200"), got[:300]
    head, text = split_response(final)
    assert text is not None, final[-300:]
    assert took > 0.15, "the answer came too soon to tell (%.2f s)" % took
    if stream:
        assert text.endswith(b"data: [DONE]\n\n"), text[-300:]
    else:
        assert json.loads(text)["choices"][0]["finish_reason"] == "length", text[-300:]


# ---- long conversations ----

def test_long_conversations_leave_the_oldest_turns_out(daemon):
    turns = [{"role": ("user", "assistant")[i % 2], "content": "Turn %d about rivers." % i}
             for i in range(260)]
    q = {"role": "user", "content": "How long is the Rhine?"}
    status, r, _ = post(daemon, {"messages": turns + [q], "max_tokens": 2,
                                 "diffrag": {"docs": DOCS}})
    assert status == 200, r
    cx = r["diffrag"]["context"]
    print("260 turns:", {k: cx[k] for k in ("history_turns", "history_left_out")})
    assert cx["history_turns"] + cx["history_left_out"] == 260 and cx["history_left_out"] >= 4, cx
    # a long RAG system prompt, and a long earlier answer, each well over 4,096 bytes: the
    # prompt budget, not a byte limit, decides whether they fit
    system = {"role": "system", "content": "You answer questions about European rivers. " * 94}
    answer = {"role": "assistant", "content": "The Rhine flows north. " * 180}
    for messages in ([system, q],
                     [{"role": "user", "content": "Tell me about the Rhine."}, answer, q]):
        status, r, _ = post(daemon, {"messages": messages, "max_tokens": 2,
                                  "diffrag": {"docs": DOCS, "max_context_tokens": 7100}})
        assert status == 200, r
        cx = r["diffrag"]["context"]
        print("%s: %d prompt tokens," % ([len(m["content"]) for m in messages],
                                         r["usage"]["prompt_tokens"]),
              {k: cx[k] for k in ("history_turns", "history_left_out")})
        turns = 0 if messages[0] is system else 2
        assert cx["history_turns"] == turns and cx["history_left_out"] == 0, cx
    # past max_turn_bytes (1 MiB): a turn is left out with the older ones; a system text is
    # refused, naming the setting
    huge = "The Rhine flows north. " * (1024 * 1024 // 23 + 1)
    messages = [{"role": "user", "content": "Tell me about the Rhine."},
                {"role": "assistant", "content": huge},
                {"role": "user", "content": "And its length?"}, q]
    status, r, _ = post(daemon, {"messages": messages, "max_tokens": 2, "diffrag": {"docs": DOCS}})
    assert status == 200, r
    cx = r["diffrag"]["context"]
    assert cx["history_turns"] == 1 and cx["history_left_out"] == 2, cx
    status, r, _ = post(daemon, {"messages": [{"role": "system", "content": huge}, q],
                                 "max_tokens": 2, "diffrag": {"docs": DOCS}})
    assert status == 413 and "max_turn_bytes" in r["error"]["message"], r


# ---- ambiguous framing ----

GOOD = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                   "diffrag": {"docs": DOCS}}).encode()
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
FRAMING = [
    ("two Content-Lengths", 400,
     b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
     b"Content-Length: 0\r\n\r\n" % len(GOOD) + GOOD + SMUGGLED),
    ("Content-Length and chunked", 400,
     b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(GOOD), GOOD)),
    ("HTTP/1.1 without Host", 400, b"GET /v1/models HTTP/1.1\r\n\r\n"),
    ("two Hosts", 400, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n"),
    ("a NUL in a header value", 400,
     b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Note: a\x00b\r\n\r\n"),
    ("a NUL in the last header value", 400,
     b"GET /v1/models HTTP/1.1\r\nX-Note: ok\r\nHost: x\x00y\r\n\r\n"),
    ("Transfer-Encoding: gzip", 501,
     b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\nabc"),
    ("Transfer-Encoding: gzip, chunked", 501,
     b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
     b"3\r\nabc\r\n0\r\n\r\n"),
]


def test_ambiguous_framing_is_refused_at_once(daemon):
    for name, want, data in FRAMING:
        s = socket.create_connection(("127.0.0.1", daemon.http_port))
        t0 = time.time()
        s.sendall(data)
        got, closed = read_all(s, 5)
        s.close()
        took = time.time() - t0
        print("%s: %r in %.2f s, closed %s" % (name, got[:12], took, closed))
        assert got.startswith(b"HTTP/1.1 %d" % want), (name, got[:300])
        # one response: nothing smuggled through
        assert len(re.findall(rb"(?:^|\n)HTTP/1\.[01] \d\d\d ", got)) == 1, (name, got)
        assert b'"error"' in got, (name, got[:300])
        assert closed and took < 2, (name, closed, took)
    # well-formed requests are still served, CRLF and all
    for data in (request_bytes(GOOD, extra=b"Connection: close\r\n"),
                 b"GET /v1/models HTTP/1.0\r\n\r\n",
                 b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(GOOD), GOOD)):
        s = socket.create_connection(("127.0.0.1", daemon.http_port))
        s.sendall(data)
        got, _ = read_all(s, 30 if b"POST" in data else 5)
        s.close()
        assert got.startswith(b"HTTP/1.1 200") or got.startswith(b"HTTP/1.0 200"), got[:300]


# ---- the log under a flood of refusals ----

def test_refusals_are_logged_at_most_once_a_second(tmp_path, model):
    keys = tmp_path / "api.keys"
    keys.write_text("the-key\n")
    keys.chmod(0o600)
    d = Daemon(tmp_path, model, workers=1, threads=1, http_api_key_file=keys, log_level="debug")
    with d:
        c = http.client.HTTPConnection("127.0.0.1", d.http_port, timeout=10)
        t0, n = time.time(), 0
        while time.time() - t0 < 1.5:
            c.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
            r = c.getresponse()
            r.read()
            assert r.status == 401
            n += 1
        for _ in range(50):   # other refusals too: bad bodies
            c.request("POST", CHAT, b"{not json", {"Authorization": "Bearer the-key"})
            r = c.getresponse()
            r.read()
            assert r.status == 400
            n += 1
        time.sleep(1.1)
        c.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        c.getresponse().read()
        n += 1
        took = time.time() - t0
        c.close()
        time.sleep(0.2)
        lines = [l for l in d.log_text().splitlines() if "http request refused" in l]
        print("%d refusals in %.1f s: %d log lines; the last: %s" % (n, took, len(lines),
                                                                    lines[-1] if lines else None))
        assert n > 100 and 2 <= len(lines) <= took + 2, len(lines)
        held = sum(int(m) for m in re.findall(r"suppressed_since_last=(\d+)", "\n".join(lines)))
        assert held + len(lines) == n, (held, len(lines), n)
        assert d.metric("diffrag_http_requests_total", endpoint="models", status="401") >= n - 50
        assert d.stop() == 0, d.log_text()[-2000:]
