"""The Python client (clients/python, package `diffrag`) against a live diffragd on loopback
with a tiny model: every call, streaming (break and cancel included), the asyncio client with
concurrent calls, daemon errors mapped to exceptions with their codes; against fake servers:
timeouts, connection failures, malformed replies, CurveZMQ with a ZAP handler; and
`pip install clients/python` into a fresh virtual environment, offline. FakeServer is shared
with tests/test_cli.py."""
import asyncio
import os
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq
import zmq.auth.thread

from conftest import ROOT, offline_venv
from daemon_util import Daemon, fast_model, free_port

sys.path.insert(0, str(ROOT / "clients" / "python"))
import diffrag  # noqa: E402

DOCS = [
    {"id": "rhine", "title": "Rhine", "text": "The Rhine is a European river that begins in the "
     "Swiss canton of Graubunden and flows into the North Sea. It is about 1,230 km long.",
     "meta": {"source": "test", "tags": ["river", "europe"]}},
    {"id": "paris", "title": "Paris", "text": "Paris is the capital and most populous city of "
     "France, with an estimated population of 2,102,650 residents."},
    {"id": "oxygen", "text": "Oxygen is a chemical element with symbol O and atomic number 8."},
]


class FakeServer:
    """A ROUTER on loopback that answers each request with what handler(request) returns: a
    list of replies, each a dict (packed, the request's id added unless present), bytes (sent
    as one frame) or a list of frames. With curve=(public, secret) it is a CurveZMQ server;
    allowed: the Z85 public keys a ZAP handler lets in (None: any)."""

    def __init__(self, handler, curve=None, allowed=None):
        self.handler = handler
        self.ctx = zmq.Context()
        self.auth = None
        if curve is not None:
            self.auth = zmq.auth.thread.ThreadAuthenticator(self.ctx)
            self.auth.start()
            if allowed is None:
                self.auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
            else:
                keys = {k if isinstance(k, bytes) else k.encode() for k in allowed}

                class Provider:
                    def callback(self, domain, key):
                        return key in keys
                self.auth.configure_curve_callback(domain="*", credentials_provider=Provider())
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            self.sock.curve_server = True
            self.sock.curve_secretkey = curve[1]
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests = []
        self.stop_flag = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop_flag:
            if not self.sock.poll(20):
                self.on_idle()
                continue
            frames = self.sock.recv_multipart()
            ident, body = frames[0], frames[-1]
            self.ident = ident
            req = msgpack.unpackb(body, raw=False)
            self.requests.append(req)
            for rep in self.handler(req) or []:
                self.send(req.get("id"), rep)

    def send(self, rid, rep):
        if isinstance(rep, dict):
            frames = [msgpack.packb(dict({"id": rid}, **rep))]
        elif isinstance(rep, bytes):
            frames = [rep]
        else:
            frames = list(rep)
        self.sock.send_multipart([self.ident] + frames)

    def on_idle(self):
        pass

    def close(self):
        self.stop_flag = True
        self.thread.join()
        self.sock.close(0)
        if self.auth:
            self.auth.stop()
        self.ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def tiny_model(tmp_path_factory):
    """One tiny model for every client test module of the session."""
    d = tmp_path_factory.getbasetemp() / "client-models"
    d.mkdir(exist_ok=True)
    return fast_model(d)


GROUNDED = {"ok": True, "answer": "It is 1,230 km long [1].", "finish_reason": "stop",
            "citations": [{"doc_id": "rhine", "chunk": 0, "score": 2.5, "offsets": [0, 40],
                           "marker": 1, "cited": True, "truncated": False}],
            "usage": {"prompt_tokens": 120, "context_tokens": 80, "completion_tokens": 9},
            "timings": {"ttft_ms": 12.5, "total_ms": 30.25},
            "grounding": {"score": 0.82, "flagged": True, "abstained": False,
                          "lookback_ratio": 0.41, "unsupported_token_ratio": 0.25,
                          "mean_logprob": -1.5, "min_logprob": -6.0, "answer_tokens": 8,
                          "flagged_tokens": 2, "detector": "smollm2-v1"}}


def pong(req):
    return [{"ok": True, "pong": True, "version": "0.1.0", "model": "fake"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("pyclient"), tiny_model(tmp_path_factory), workers=2)
    with d:
        yield d
        assert d.stop() == 0, d.log_text()[-2000:]


def test_sync_every_call(daemon):
    with diffrag.Client(daemon.endpoint, timeout=20) as c:
        p = c.ping()
        assert isinstance(p, diffrag.Pong) and p.model == "tiny-fast" and p.version and p.rtt_ms > 0
        r = c.ingest("py", DOCS)
        assert isinstance(r, diffrag.IngestResult)
        assert (r.collection, r.ingested, r.docs) == ("py", 3, 3) and r.chunks >= 3, r
        assert r.bytes == sum(len(d["text"].encode()) for d in DOCS)
        assert "py" in c.list().collections
        page = c.list("py", limit=2)
        assert [d.id for d in page.docs] == ["oxygen", "paris"] and page.next == "paris"
        assert c.list("py", after=page.next).docs[0].id == "rhine"
        doc = c.get("py", "rhine")
        assert isinstance(doc, diffrag.Document)
        assert (doc.title, doc.text, doc.meta) == ("Rhine", DOCS[0]["text"], DOCS[0]["meta"])
        s = c.stats("py")
        assert isinstance(s, diffrag.CollectionStats) and s.docs == 3 and s.terms > 0
        ds = c.stats()
        assert isinstance(ds, diffrag.DaemonStats) and ds.workers_idle + ds.workers_busy == 2
        a = c.query("What is the population of Paris, the capital of France?", collection="py",
                    max_tokens=12)
        assert isinstance(a, diffrag.Answer) and a.citations[0].doc_id == "paris", a
        assert isinstance(a.citations[0], diffrag.Citation) and a.citations[0].marker == 1
        assert 1 <= a.usage.completion_tokens <= 12 and a.timings.total_ms > 0
        assert a.grounding is None or isinstance(a.grounding, diffrag.Grounding)
        a2 = c.query("How long is the Rhine?", docs=[DOCS[0]["text"], {"id": "x", "text": "Nothing."}],
                     max_tokens=4)
        assert {x.doc_id for x in a2.citations} <= {"1", "x"} and a2.citations[0].doc_id == "1"
        d = c.delete("py", ["paris", "absent"])
        assert isinstance(d, diffrag.DeleteResult) and (d.deleted, d.docs) == (1, 2)
        x = c.drop("py")
        assert isinstance(x, diffrag.DropResult) and (x.collection, x.dropped) == ("py", 2), x
        assert x.raw["ok"] is True and "py" not in c.list().collections
        with pytest.raises(diffrag.NotFound):
            c.drop("py")
        print("ping %.2f ms; query: %s tokens, %.1f ms; ingest chunks %d"
              % (p.rtt_ms, a.usage.completion_tokens, a.timings.total_ms, r.chunks))


def test_sync_stream(daemon):
    with diffrag.Client(daemon.endpoint) as c:
        items = list(c.stream("How long is the Rhine?", docs=DOCS[:2], max_tokens=24))
        deltas, final = items[:-1], items[-1]
        assert deltas and all(isinstance(x, diffrag.Delta) for x in deltas)
        assert isinstance(final, diffrag.Answer)
        assert "".join(x.text for x in deltas) == final.answer
        assert all(x.id == final.id for x in deltas)
        print("stream: %d deltas, finish=%s" % (len(deltas), final.finish_reason))


def test_stream_break_and_cancel(daemon):
    """Leaving a stream early cancels it on the daemon; cancel() from inside the loop too."""
    before = daemon.metric("diffrag_requests_total", op="cancel", code="ok")
    with diffrag.Client(daemon.endpoint) as c:
        n = 0
        for item in c.stream("Tell me about the Rhine.", docs=DOCS, max_tokens=1000):
            n += 1
            if n == 3:
                break
        # the socket stays usable: the cancelled query's late messages are dropped
        assert c.ping().model == "tiny-fast"
        final = None
        state = None
        for item in c.stream("Tell me about Paris.", docs=DOCS, max_tokens=1000, id="long-one"):
            if isinstance(item, diffrag.Delta) and state is None:
                state = c.cancel("long-one")
            elif isinstance(item, diffrag.Answer):
                final = item
        assert state == "running"
        assert final.finish_reason == "cancelled" and final.usage.completion_tokens < 1000
        print("cancelled after %d tokens" % final.usage.completion_tokens)
    deadline = time.time() + 5
    while daemon.metric("diffrag_requests_total", op="cancel", code="ok") < before + 2:
        assert time.time() < deadline, "the daemon did not see both cancels"
        time.sleep(0.05)


def test_errors_are_exceptions_with_codes(daemon):
    with diffrag.Client(daemon.endpoint) as c:
        c.ingest("errs", DOCS[:1])
        cases = [
            (lambda: c.get("errs", "nope"), diffrag.NotFound, "not_found"),
            (lambda: c.stats("no-such-collection"), diffrag.NotFound, "not_found"),
            (lambda: c.query("x", collection="errs", top_k=-1), diffrag.BadRequest, "bad_request"),
            (lambda: c.query("x" * 5000, collection="errs"), diffrag.TooLarge, "too_large"),
            (lambda: c.cancel("never-sent"), diffrag.NotFound, "not_found"),
            (lambda: c.ingest("errs", [{"id": "a", "text": ""}]), diffrag.BadRequest, "bad_request"),
        ]
        for call, cls, code in cases:
            with pytest.raises(cls) as e:
                call()
            assert e.value.code == code and isinstance(e.value, diffrag.ServerError)
            assert isinstance(e.value, diffrag.DiffragError) and e.value.message
            print(code, "->", e.value)
        with pytest.raises(ValueError):
            c.query("no documents and no collection")
        with pytest.raises(ValueError):
            c.ingest("errs", [{"text": "no id"}])


def test_asyncio(daemon):
    async def main():
        async with diffrag.AsyncClient(daemon.endpoint, timeout=20) as c:
            assert (await c.ping()).model == "tiny-fast"
            r = await c.ingest("aio", DOCS)
            assert r.ingested == 3
            # three queries in flight at once on one socket, each gets its own answer
            qs = ["How long is the Rhine?", "What is the capital of France?", "Atomic number of oxygen?"]
            answers = await asyncio.gather(*[c.query(q, collection="aio", max_tokens=6, id="q%d" % i)
                                             for i, q in enumerate(qs)])
            assert [a.id for a in answers] == ["q0", "q1", "q2"]
            assert [a.citations[0].doc_id for a in answers] == ["rhine", "paris", "oxygen"], \
                [[x.doc_id for x in a.citations] for a in answers]
            deltas, final = [], None
            async for item in c.stream("Where does the Rhine flow?", collection="aio", max_tokens=20):
                if isinstance(item, diffrag.Delta):
                    deltas.append(item.text)
                else:
                    final = item
            assert final is not None and "".join(deltas) == final.answer and deltas
            # leaving a stream early cancels it
            n = 0
            async for item in c.stream("Tell me everything.", docs=DOCS, max_tokens=1000):
                n += 1
                if n == 2:
                    break
            assert (await c.get("aio", "rhine")).meta == DOCS[0]["meta"]
            assert "aio" in (await c.list()).collections
            assert [d.id for d in (await c.list("aio", limit=1)).docs] == ["oxygen"]
            assert (await c.stats("aio")).docs == 3
            assert (await c.stats()).version
            with pytest.raises(diffrag.NotFound) as e:
                await c.get("aio", "nope")
            assert e.value.code == "not_found"
            assert (await c.delete("aio", "oxygen")).deleted == 1
            x = await c.drop("aio")
            assert isinstance(x, diffrag.DropResult) and (x.collection, x.dropped) == ("aio", 2)
            with pytest.raises(diffrag.NotFound) as e:
                await c.drop("aio")
            assert e.value.code == "not_found"
            return len(deltas)
    n = asyncio.run(main())
    print("async stream: %d deltas" % n)


def test_timeout_connect_failure_and_late_replies():
    silent = FakeServer(lambda req: [])
    try:
        c = diffrag.Client(silent.endpoint, timeout=0.3)
        t0 = time.time()
        with pytest.raises(diffrag.Timeout) as e:
            c.ping()
        waited = time.time() - t0
        assert e.value.code == "timeout" and isinstance(e.value, TimeoutError)
        assert 0.29 <= waited < 1.5, waited
        print("timeout after %.3f s" % waited)
        # the server wakes up: it answers every request late, then the current one; the late
        # replies (for ids that timed out) are dropped
        silent.handler = lambda req: pong(req)
        assert c.ping().model == "fake"
        c.close()

        async def amain():
            async with diffrag.AsyncClient(silent.endpoint, timeout=0.3) as ac:
                silent.handler = lambda req: []
                with pytest.raises(diffrag.Timeout):
                    await ac.ping()
                silent.handler = pong
                return await ac.ping()
        assert asyncio.run(amain()).model == "fake"
    finally:
        silent.close()
    port = free_port()
    t0 = time.time()
    with diffrag.Client("tcp://127.0.0.1:%d" % port, connect_timeout=0.3) as c:
        with pytest.raises(diffrag.ConnectionFailed) as e:
            c.ping()
    assert e.value.code == "connect" and "connection refused" in e.value.message
    assert time.time() - t0 < 2


def test_endpoint_form_and_unresolvable_host():
    """An endpoint without a scheme is a ValueError that says what one looks like; a host that
    does not resolve fails the first call at once, saying so (not "connection refused")."""
    for ep in ("127.0.0.1:7400", "tcp://127.0.0.1", "nonsense://x"):
        for cls in (diffrag.Client, diffrag.AsyncClient):
            with pytest.raises(ValueError) as e:
                cls(ep)
            assert str(e.value) == ("endpoint '%s': expected tcp://HOST:PORT, ipc://PATH or "
                                    "inproc://NAME" % ep)
    t0 = time.time()
    with diffrag.Client("tcp://nosuchhost.invalid:7400", connect_timeout=3) as c:
        with pytest.raises(diffrag.ConnectionFailed) as e:
            c.ping()
    assert '"nosuchhost.invalid" does not resolve' in e.value.message and e.value.code == "connect"

    async def amain():
        async with diffrag.AsyncClient("tcp://nosuchhost.invalid:7400", connect_timeout=3) as ac:
            with pytest.raises(diffrag.ConnectionFailed) as e:
                await ac.ping()
            return e.value
    err = asyncio.run(amain())
    assert '"nosuchhost.invalid" does not resolve' in err.message
    print("no such host:", err, "after %.2f s" % (time.time() - t0))


MALFORMED = [
    (b"\xc1x", "malformed reply"),
    (msgpack.packb([1, 2]), "not a map"),
    (msgpack.packb({"ok": True}), 'no "id"'),
    (msgpack.packb({"id": None, "ok": 1}), '"ok" is not a boolean'),
    (msgpack.packb({"id": None}), 'neither "ok"'),
    (msgpack.packb({"id": None, 1: 2, "ok": True}), "malformed reply"),
    (b"\xdd\xff\xff\xff\xff\x01", "malformed reply"),
    (b"\x91" * 3000 + b"\x01", "malformed reply"),
    (msgpack.packb({"id": None, "ok": True}) + b"\x00", "malformed reply"),
    ([b"a", b"b"], "2 frames"),
    (b"", "empty frame"),
]


def test_malformed_replies_raise_protocol_error():
    state = {"reply": None}

    def handler(req):
        if req["op"] == "ping" and state["reply"] is not None:
            r, state["reply"] = state["reply"], None
            return [r]
        if req["op"] == "query":
            return [{"ok": True, "answer": 5}]
        return pong(req)

    with FakeServer(handler) as srv, diffrag.Client(srv.endpoint, timeout=1) as c:
        for raw, expect in MALFORMED:
            state["reply"] = raw
            with pytest.raises(diffrag.ProtocolError) as e:
                c.ping()
            assert expect in str(e.value) and e.value.code == "protocol", (raw[:20], e.value)
            assert c.ping().model == "fake"  # still usable
        with pytest.raises(diffrag.ProtocolError) as e:
            c.query("q", docs=["text"])
        assert "field answer: expected a string" in str(e.value)
        print("malformed replies: %d kinds, each a ProtocolError" % (len(MALFORMED) + 1))


def test_citation_heading_parsed():
    """A citation's heading path (a chunk of a Markdown document) is read into
    Citation.heading; a reply without one (a daemon before heading paths) gives ""."""
    with_heading = dict(GROUNDED, citations=[dict(GROUNDED["citations"][0],
                                                  heading="Rivers \u203a Rhine")])
    for reply, want in ((with_heading, "Rivers \u203a Rhine"), (GROUNDED, "")):
        with FakeServer(lambda req: [reply] if req["op"] == "query" else pong(req)) as srv, \
                diffrag.Client(srv.endpoint) as c:
            a = c.query("How long is the Rhine?", docs=["The Rhine is 1,230 km long."])
            assert a.citations[0].heading == want, a.citations


def test_relevance_floor_sent_and_below_floor_parsed():
    """query(relevance_floor=0) sends the floor (0 included; None sends none), and the
    reply's context.chunks_below_floor is read (0 when the daemon does not say)."""
    seen = []
    reply = dict(GROUNDED, context={"documents": 1, "doc_tokens": 900, "placed_tokens": 100,
                                    "chunks_matched": 2, "chunks_placed": 2,
                                    "chunks_left_out": 0, "chunks_below_floor": 7,
                                    "whole": False})

    def handle(req):
        if req["op"] != "query":
            return pong(req)
        seen.append(req)
        return [dict(reply, id=req["id"])]
    with FakeServer(handle) as srv, diffrag.Client(srv.endpoint) as c:
        a = c.query("How long is the Rhine?", docs=["The Rhine is 1,230 km long."],
                    relevance_floor=0)
        b = c.query("How long is the Rhine?", docs=["The Rhine is 1,230 km long."])
    assert seen[0]["relevance_floor"] == 0 and "relevance_floor" not in seen[1], seen
    assert a.context.chunks_below_floor == 7 and b.context.chunks_matched == 2


def test_grounding_figures_parsed():
    """The grounding figures of a reply (the groundedness work adds them) become a typed
    Grounding; a field of an unexpected type reads as None instead of failing the answer."""
    reply = dict(GROUNDED)
    with FakeServer(lambda req: [reply] if req["op"] == "query" else pong(req)) as srv, \
            diffrag.Client(srv.endpoint) as c:
        a = c.query("How long is the Rhine?", docs=["The Rhine is 1,230 km long."])
        g = a.grounding
        assert isinstance(g, diffrag.Grounding)
        assert (g.score, g.flagged, g.abstained, g.flagged_tokens, g.detector) == \
            (0.82, True, False, 2, "smollm2-v1")
        assert g.self_check is None   # the daemon did not run the self-check
        reply["grounding"] = dict(GROUNDED["grounding"], self_check=0.375)
        assert c.query("q", docs=["t"]).grounding.self_check == 0.375
        reply["grounding"] = dict(GROUNDED["grounding"], context_reliance=-1.25)
        assert c.query("q", docs=["t"]).grounding.context_reliance == -1.25
        assert c.query("q", docs=["t"]).grounding.hidden_probe is None
        reply["grounding"] = dict(GROUNDED["grounding"], hidden_probe=0.25)
        assert c.query("q", docs=["t"]).grounding.hidden_probe == 0.25
        assert a.citations[0].cited and a.timings.ttft_ms == 12.5 and a.timings.queue_ms == 0.0
        reply["grounding"] = dict(GROUNDED["grounding"], detector={"name": "x"}, flagged=1)
        g = c.query("q", docs=["t"]).grounding
        assert g.detector is None and g.flagged is None and g.score == 0.82
        reply.pop("grounding")
        assert c.query("q", docs=["t"]).grounding is None


def test_curve(tmp_path):
    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    with FakeServer(pong, curve=(server_pub, server_sec), allowed=[client_pub]) as srv:
        with diffrag.Client(srv.endpoint, server_key=server_pub.decode(),
                            secret_key=client_sec.decode(), connect_timeout=2) as c:
            assert c.ping().model == "fake"
        other_pub, other_sec = zmq.curve_keypair()
        # refusals are reported as soon as the handshake fails; the timeout (5 s) only bounds
        # the wait, long enough that a loaded machine still sees the refusal before it
        with diffrag.Client(srv.endpoint, server_key=server_pub, secret_key=other_sec,
                            connect_timeout=5) as c:
            with pytest.raises(diffrag.ConnectionFailed) as e:
                c.ping()
        assert "refused this client's CurveZMQ key" in e.value.message, e.value
        with diffrag.Client(srv.endpoint, connect_timeout=5) as c:
            with pytest.raises(diffrag.ConnectionFailed) as e:
                c.ping()
        # ZeroMQ reports a plain client against a CURVE server either as a mechanism mismatch
        # or, when the server closes first (a loaded machine), as a broken handshake.
        assert ("mechanism mismatch" in e.value.message or
                "handshake failed" in e.value.message), e.value

        async def amain():
            async with diffrag.AsyncClient(srv.endpoint, server_key=server_pub,
                                           secret_key=client_sec) as ac:
                return await ac.ping()
        assert asyncio.run(amain()).model == "fake"
    with pytest.raises(ValueError):
        diffrag.Client("tcp://127.0.0.1:1", server_key="short")
    with pytest.raises(ValueError):
        diffrag.Client("tcp://127.0.0.1:1", secret_key=client_sec)


def test_pip_install_offline(tmp_path, daemon):
    """`pip install clients/python` as a user would, into a fresh virtual environment that
    sees the test interpreter's pyzmq and msgpack: the in-tree build backend needs nothing from an
    index, so no network is used."""
    venv = tmp_path / "venv"
    offline_venv(venv)
    py = venv / "bin" / "python"
    env = dict(os.environ, PIP_NO_INDEX="1", PYTHONPATH="")
    r = subprocess.run([str(py), "-m", "pip", "install", "--disable-pip-version-check",
                        str(ROOT / "clients" / "python")], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    script = ("import diffrag, sys; c = diffrag.Client(sys.argv[1]); p = c.ping(); "
              "print(diffrag.__file__); print(p.model)")
    r = subprocess.run([str(py), "-c", script, daemon.endpoint], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    where, model = r.stdout.split()
    assert where.startswith(str(venv)) and model == "tiny-fast", r.stdout
    site = next(venv.glob("lib/python*/site-packages"))
    assert (site / "diffrag" / "py.typed").exists()
    assert (site / "diffrag-0.1.0.dist-info" / "METADATA").read_text().count("Requires-Dist") == 2
    print("installed into", site)


def test_python_example(daemon):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "ask_folder.py"),
                        daemon.endpoint, str(ROOT / "examples"), "How long is the Rhine?"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "clients" / "python")))
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stderr
    assert 'in the collection "examples" (created if it was not there)' in r.stdout
    assert "sources:" in r.stdout
    assert "sample-paragraph.txt" in r.stdout.split("sources:")[1]
