"""The OpenAI-compatible HTTP API (docs/openai.md), driven by the official `openai` package and
by raw sockets: answers equal to the msgpack protocol's, streaming, usage and the `diffrag`
extension, the SDK's own exceptions for bad requests, unknown collections and overload,
malformed HTTP and a slowloris while the ZeroMQ side keeps answering, cancel on disconnect,
API keys, and HTTPS."""
import http.client
import json
import shutil
import signal
import socket
import ssl
import subprocess
import time

import openai
import pytest

from daemon_util import SAMPLE_DOCS, Daemon, query, slow_model

DOCS = SAMPLE_DOCS
QUESTION = "How long is the Rhine?"


def sdk(d, key="none", **kw):
    # no retries: a 429 or a 5xx must reach the test, not be retried behind its back
    return openai.OpenAI(base_url=d.http_url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


def post(d, body, headers=None, timeout=60):
    """(status, parsed JSON or text) of one POST /v1/chat/completions."""
    c = http.client.HTTPConnection("127.0.0.1", d.http_port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    c.request("POST", "/v1/chat/completions", data,
              dict({"Content-Type": "application/json"}, **(headers or {})))
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


def zmq_ping(d):
    """The ZeroMQ side answers (within 5 s)."""
    c = d.client()
    t0 = time.time()
    _, r = c.call({"v": 1, "op": "ping", "id": 1}, timeout=5)
    assert r["ok"] is True
    return time.time() - t0


@pytest.fixture(scope="module")
def api(tmp_path_factory, default_model):
    d = Daemon(tmp_path_factory.mktemp("api"), default_model, workers=1, threads=2,
               http_timeout=2, http_max_connections=32, default_collection="kb",
               max_message_bytes="64KiB")
    with d:
        c = d.client()
        _, r = c.call({"v": 1, "op": "ingest", "collection": "kb", "docs": DOCS}, timeout=60)
        assert r["ok"], r
        yield d
        assert d.stop() == 0, d.log_text()[-2000:]


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    d = tmp_path_factory.mktemp("slow")
    keys = d / "api.keys"
    keys.write_text("# clients\nsecret-key-one\n\n  secret-key-two  \n")
    keys.chmod(0o600)
    dm = Daemon(d, slow_model(d), workers=1, max_tokens=4096, max_running=1, max_queue=1,
                http_api_key_file=keys)
    with dm:
        yield dm
        assert dm.stop() == 0, dm.log_text()[-2000:]


def test_models_lists_the_served_model(api):
    models = sdk(api).models.list()
    ids = [m.id for m in models.data]
    assert len(ids) == 1 and ids[0], ids
    assert sdk(api).models.retrieve(ids[0]).id == ids[0]
    with pytest.raises(openai.NotFoundError):
        sdk(api).models.retrieve("no-such-model")


def test_greedy_answer_equals_the_msgpack_protocols(api):
    r = sdk(api).chat.completions.create(
        model="any", messages=[{"role": "user", "content": QUESTION}], max_tokens=48,
        temperature=0, extra_body={"diffrag": {"docs": DOCS}})
    _, m = api.client().call(query(QUESTION, DOCS, max_tokens=48), timeout=60)
    assert m["ok"], m
    print("http:", r.choices[0].message.content, "| msgpack:", m["answer"])
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == m["answer"] and m["answer"]
    assert r.choices[0].finish_reason == m["finish_reason"] == "stop"
    assert r.usage.prompt_tokens == m["usage"]["prompt_tokens"]
    assert r.usage.completion_tokens == m["usage"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ext = r.model_extra["diffrag"]
    assert ext["citations"] == m["citations"] and {c["doc_id"] for c in ext["citations"]} >= {"rhine"}
    assert ext["context"] == m["context"] and ext["finish_reason"] == "stop"
    assert set(ext["grounding"]) == set(m["grounding"])
    assert ext["grounding"]["answer_tokens"] == m["grounding"]["answer_tokens"]
    assert set(ext["timings"]) >= {"queue_ms", "prefill_ms", "ttft_ms", "total_ms"}


def test_stream_concatenates_to_the_answer_with_usage_last(api):
    kw = dict(model="any", messages=[{"role": "user", "content": QUESTION}], max_tokens=48,
              temperature=0, extra_body={"diffrag": {"docs": DOCS}})
    whole = sdk(api).chat.completions.create(**kw)
    chunks = list(sdk(api).chat.completions.create(stream=True,
                                                   stream_options={"include_usage": True}, **kw))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert finals[0].model_extra["diffrag"]["citations"] == whole.model_extra["diffrag"]["citations"]
    # usage comes once, in the last chunk, with no choices
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage no chunk carries it
    plain = list(sdk(api).chat.completions.create(stream=True, **kw))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == "stop"


def test_default_collection_history_and_system(api):
    r = sdk(api).chat.completions.create(
        model="any", max_tokens=32, temperature=0,
        messages=[{"role": "system", "content": "Answer in one short sentence."},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris [2]."},
                  {"role": "user", "content": [{"type": "text", "text": "How many people live there?"}]}])
    ext = r.model_extra["diffrag"]
    # no documents named: the default collection "kb" was searched, for the follow-up and the
    # user's previous message (the follow-up alone shares no word with any document)
    assert ext["citations"] and ext["citations"][0]["doc_id"] == "paris", ext["citations"]
    assert ext["context"]["history_turns"] == 2 and ext["context"]["history_left_out"] == 0
    assert r.choices[0].message.content


def test_sdk_exceptions(api, slow):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(api).chat.completions.create(model="any", n=2,
                                         messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 400 and "n = 1" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        sdk(api).chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}],
                                         extra_body={"diffrag": {"collection": "nope"}})
    assert "nope" in e.value.message and e.value.body["code"] == "not_found"
    with pytest.raises(openai.AuthenticationError):
        sdk(slow, key="wrong").chat.completions.create(
            model="any", messages=[{"role": "user", "content": "x"}])
    # overload: one request runs, one waits (max_queue 1), the next is refused at once
    c = slow.client()
    c.send(query("Tell me about the Rhine.", DOCS, id="busy", max_tokens=3000))
    time.sleep(0.3)
    c.send(query("Tell me about Paris.", DOCS, id="queued", max_tokens=3000))
    time.sleep(0.2)
    t0 = time.time()
    with pytest.raises(openai.RateLimitError) as e:
        sdk(slow, key="secret-key-one").chat.completions.create(
            model="any", messages=[{"role": "user", "content": "x"}],
            extra_body={"diffrag": {"docs": DOCS}})
    assert time.time() - t0 < 5 and e.value.body["code"] == "overloaded"
    assert e.value.response.headers.get("retry-after") == "1"
    for rid in ("busy", "queued"):
        c.send({"v": 1, "op": "cancel", "target": rid})
    finals = 0
    while finals < 2:
        r = c.recv(30)
        finals += r.get("id") in ("busy", "queued")


BAD = [
    (b"{not json", None, "invalid JSON"),
    (b"[1, 2]", None, "JSON object"),
    ({"model": "x"}, "messages", "messages is required"),
    ({"messages": "hi"}, "messages", "non-empty array"),
    ({"messages": [{"role": "user"}]}, "messages", "no content"),
    ({"messages": [{"content": "x"}]}, "messages", "string role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "not supported"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages", "last message"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages", "only text"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "10"}, "max_tokens", "integer"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, None, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature", "number"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream", "boolean"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": -1}, "seed", "non-negative"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools", "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "diffrag": {"colection": "kb"}}, "diffrag", "colection"),
    ({"messages": [{"role": "user", "content": "x"}], "diffrag": {"docs": [{"title": "t"}]}}, None, "text"),
    ({"messages": [{"role": "user", "content": ""}]}, None, "question"),
]


def test_malformed_requests_get_clear_errors(api):
    for body, param, needle in BAD:
        status, r = post(api, body)
        print(status, r)
        assert status == 400, (body, status, r)
        err = r["error"]
        assert err["type"] == "invalid_request_error" and needle in err["message"], (body, err)
        if param:
            assert err["param"] == param, (body, err)
        zmq_ping(api)
    # fields OpenAI allows and diffrag does not use are accepted
    status, r = post(api, {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8,
                           "frequency_penalty": 0.5, "presence_penalty": 0, "user": "u-1",
                           "logit_bias": {"50256": -100}, "metadata": {"k": "v"}, "store": False,
                           "response_format": {"type": "text"}, "parallel_tool_calls": False,
                           "model": "gpt-4o", "n": 1, "stop": None, "seed": 3})
    assert status == 200 and r["choices"][0]["message"]["content"] is not None, r
    # wrong method, unknown path
    c = http.client.HTTPConnection("127.0.0.1", api.http_port, timeout=10)
    c.request("GET", "/v1/chat/completions")
    r = c.getresponse()
    assert r.status == 405 and json.loads(r.read())["error"]["message"] == "use POST"
    c.request("GET", "/v2/anything")
    r = c.getresponse()
    assert r.status == 404 and "no such endpoint" in json.loads(r.read())["error"]["message"]
    c.close()


def raw_status(port, data, read_timeout=10):
    """Sends raw bytes and returns the status line and body the server answered with."""
    s = socket.create_connection(("127.0.0.1", port), timeout=read_timeout)
    try:
        s.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass
    got = b""
    try:
        while True:
            b = s.recv(65536)
            if not b:
                break
            got += b
            if b"\r\n\r\n" in got and b"}\n" in got:
                break
    except (ConnectionResetError, socket.timeout):
        pass
    s.close()
    return got


def test_huge_bodies_are_refused_unread(api):
    # announced: refused on the headers, before a byte of the body is read
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1073741824\r\n\r\n")
    t0 = time.time()
    got = raw_status(api.http_port, head + b"{")
    assert got.startswith(b"HTTP/1.1 413") and b"larger than 65536 bytes" in got, got[:300]
    assert time.time() - t0 < 5
    # chunked, with no length: what passes the cap is dropped unread, and the 413 follows
    chunk = b"x" * 16384
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(64)) + b"0\r\n\r\n"
    got = raw_status(api.http_port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + body)
    assert got.startswith(b"HTTP/1.1 413"), got[:300]
    # and one that never ends is cut at http_timeout (2 s)
    s = socket.create_connection(("127.0.0.1", api.http_port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    t0, cut = time.time(), False
    try:
        while time.time() - t0 < 8:
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            time.sleep(0.05)
    except (BrokenPipeError, ConnectionResetError):
        cut = True
    s.close()
    assert cut and time.time() - t0 < 6, time.time() - t0
    zmq_ping(api)
    assert api.metric("diffrag_http_requests_total", endpoint="chat_completions", status="413") >= 2


def test_slowloris_holds_nothing(api):
    held = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", api.http_port), timeout=5)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        held.append(s)
    try:
        # the ZeroMQ side answers meanwhile, queries included
        assert zmq_ping(api) < 2
        _, r = api.client().call(query(QUESTION, DOCS, max_tokens=8), timeout=30)
        assert r["ok"], r
        # so does the HTTP API: a complete request takes the place of the oldest half-open one
        status, r = post(api, {"messages": [{"role": "user", "content": QUESTION}],
                               "max_tokens": 8, "diffrag": {"docs": DOCS}}, timeout=20)
        assert status == 200, r
        assert api.metric("diffrag_http_connections") <= 32
        # and the half-open connections are cut once http_timeout (2 s) passes
        time.sleep(3)
        closed = 0
        for s in held:
            s.settimeout(0.2)
            try:
                closed += s.recv(1) == b""
            except (ConnectionResetError, BrokenPipeError):
                closed += 1
            except socket.timeout:
                pass
        assert closed == len(held), closed
    finally:
        for s in held:
            s.close()
    zmq_ping(api)


def wait_metric(d, name, want, timeout=15, **labels):
    t_end = time.time() + timeout
    while time.time() < t_end:
        v = d.metric(name, **labels)
        if v >= want:
            return v
        time.sleep(0.1)
    return d.metric(name, **labels)


def test_a_client_that_leaves_mid_stream_cancels_its_query(slow):
    cancelled0 = slow.metric("diffrag_query_finish_total", reason="cancelled")
    left0 = slow.metric("diffrag_http_client_disconnects_total")
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me about the Rhine."}],
                       "max_tokens": 3000, "stream": True, "diffrag": {"docs": DOCS}}).encode()
    s = socket.create_connection(("127.0.0.1", slow.http_port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
              b"secret-key-two\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
              % (len(body), body))
    got = b""
    while got.count(b"data: ") < 4:
        b = s.recv(4096)
        assert b, got
        got += b
    assert got.startswith(b"HTTP/1.1 200") and b"text/event-stream" in got
    s.close()
    t0 = time.time()
    assert wait_metric(slow, "diffrag_http_client_disconnects_total", left0 + 1) == left0 + 1
    assert wait_metric(slow, "diffrag_query_finish_total", cancelled0 + 1,
                       reason="cancelled") == cancelled0 + 1
    print("cancelled %.2f s after the client left" % (time.time() - t0))
    t_end = time.time() + 10
    while slow.metric("diffrag_inflight_requests") and time.time() < t_end:
        time.sleep(0.1)
    assert slow.metric("diffrag_inflight_requests") == 0
    # a client that leaves while waiting for a whole (not streamed) answer: the same
    s = socket.create_connection(("127.0.0.1", slow.http_port), timeout=30)
    body = body.replace(b'"stream": true', b'"stream": false')
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
              b"secret-key-one\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(0.5)
    s.close()
    assert wait_metric(slow, "diffrag_http_client_disconnects_total", left0 + 2) == left0 + 2
    assert wait_metric(slow, "diffrag_query_finish_total", cancelled0 + 2,
                       reason="cancelled") == cancelled0 + 2


def test_api_keys(slow):
    queries0 = slow.metric("diffrag_requests_total", op="query", code="ok")
    refused0 = slow.metric("diffrag_http_requests_total", endpoint="chat_completions", status="401")
    body = {"messages": [{"role": "user", "content": "Paris?"}], "max_tokens": 4,
            "diffrag": {"docs": DOCS}}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret-key-one"},
                    {"Authorization": "Bearer secret-key-one2"}):
        status, r = post(slow, body, headers)
        assert status == 401 and r["error"]["code"] == "invalid_api_key", (headers, status, r)
    c = http.client.HTTPConnection("127.0.0.1", slow.http_port, timeout=10)
    c.request("GET", "/v1/models")
    r = c.getresponse()
    assert r.status == 401 and r.getheader("WWW-Authenticate") == "Bearer"
    r.read()
    c.close()
    # none of them reached the broker, let alone a worker
    assert slow.metric("diffrag_requests_total", op="query", code="ok") == queries0
    assert slow.metric("diffrag_http_requests_total", endpoint="chat_completions", status="401") == refused0 + 4
    for key in ("secret-key-one", "secret-key-two"):
        status, r = post(slow, body, {"Authorization": "Bearer " + key})
        assert status == 200, r
    assert slow.metric("diffrag_requests_total", op="query", code="ok") == queries0 + 2


def test_https(tmp_path, default_model):
    assert shutil.which("openssl"), "the openssl command makes the test certificate: make deps"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    d = Daemon(tmp_path, default_model, workers=1, threads=2, http_tls_cert_file=cert,
               http_tls_key_file=key)
    with d:
        ctx = ssl.create_default_context(cafile=str(cert))
        c = http.client.HTTPSConnection("127.0.0.1", d.http_port, context=ctx, timeout=60)
        c.request("POST", "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16,
             "diffrag": {"docs": DOCS}}), {"Content-Type": "application/json"})
        r = c.getresponse()
        out = json.loads(r.read())
        assert r.status == 200 and out["choices"][0]["message"]["content"], out
        c.close()
        # plain HTTP on the TLS port gets nothing useful
        got = raw_status(d.http_port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 5)
        assert b'"object":"list"' not in got
        assert d.stop() == 0, d.log_text()[-2000:]


def test_draining_answers_503(tmp_path):
    d = Daemon(tmp_path, slow_model(tmp_path), workers=1, max_tokens=4096, max_running=1,
               drain_timeout=30)
    with d:
        c = d.client()
        c.send(query("Tell me about the Rhine.", DOCS, id="long", stream=True, max_tokens=3000))
        assert "delta" in c.recv(30)
        d.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(openai.InternalServerError) as e:
            sdk(d).chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}],
                                           extra_body={"diffrag": {"docs": DOCS}})
        assert e.value.status_code == 503 and e.value.body["code"] == "shutting_down"
        c.send({"v": 1, "op": "cancel", "target": "long"})
        assert d.stop() == 0, d.log_text()[-2000:]
