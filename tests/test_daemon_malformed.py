"""Malformed requests: each gets one reply with the right error code, the daemon keeps serving,
and the store is unchanged (documents, chunks and terms are compared before and after)."""
import struct
import time

import msgpack
import pytest

from daemon_util import Daemon, fast_model, query

MAX_MSG = 64 * 1024
MAX_DOCS = 4
MAX_Q = 200


def pk(obj):
    return msgpack.packb(obj)


def ok_query(**kw):
    m = query("What is the capital?", [{"id": "a", "text": "Paris is the capital of France."}])
    m.update(kw)
    return m


def raw_str(b):
    """A msgpack str holding arbitrary bytes (msgpack-python refuses invalid UTF-8)."""
    assert len(b) < 32
    return bytes([0xa0 | len(b)]) + b


def raw_map(pairs):
    """A msgpack map from (key bytes, value bytes) pairs, already encoded (duplicates allowed)."""
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(k + v for k, v in pairs)


def nested(depth):
    v = 1
    for _ in range(depth):
        v = [v]
    return v


# (name, frames or one body, expected code). Bodies are bytes; frames a list of bytes.
CASES = [
    ("empty frame", b"", "bad_request"),
    ("not msgpack (text)", b"hello, daemon", "bad_request"),
    ("reserved byte 0xc1", b"\xc1", "bad_request"),
    ("truncated map", pk({"v": 1, "op": "ping", "id": "t"})[:-2], "bad_request"),
    ("two values", pk({"v": 1, "op": "ping"}) + pk(1), "bad_request"),
    ("not a map: array", pk([1, "ping"]), "bad_request"),
    ("not a map: string", pk("ping"), "bad_request"),
    ("not a map: nil", pk(None), "bad_request"),
    ("missing v", pk({"op": "ping", "id": 1}), "bad_request"),
    ("v of wrong type", pk({"v": "1", "op": "ping"}), "bad_request"),
    ("unsupported version", pk({"v": 2, "op": "ping", "id": "ver"}), "unsupported_version"),
    ("negative version", pk({"v": -1, "op": "ping"}), "unsupported_version"),
    ("missing op", pk({"v": 1, "id": 5}), "bad_request"),
    ("unknown op", pk({"v": 1, "op": "fly"}), "bad_request"),
    ("op of wrong type", pk({"v": 1, "op": 3}), "bad_request"),
    ("id of wrong type", pk({"v": 1, "op": "ping", "id": {"a": 1}}), "bad_request"),
    ("non-string key", pk({"v": 1, "op": "ping", 1: 2}), "bad_request"),
    ("duplicate key", raw_map([(pk("v"), pk(1)), (pk("op"), pk("ping")), (pk("op"), pk("query"))]),
     "bad_request"),
    ("query without question", pk({"v": 1, "op": "query", "docs": [{"text": "x y"}]}), "bad_request"),
    ("question of wrong type", pk(ok_query(question=42)), "bad_request"),
    ("question not UTF-8", raw_map([(pk("v"), pk(1)), (pk("op"), pk("query")), (pk("id"), pk("u8")),
                                    (pk("question"), raw_str(b"caf\xe9 \xff")),
                                    (pk("docs"), pk([{"text": "a b"}]))]), "bad_request"),
    ("question too long", pk(ok_query(question="why " * 100)), "too_large"),
    ("empty question", pk(ok_query(question="")), "bad_request"),
    ("query with neither docs nor collection", pk({"v": 1, "op": "query", "question": "q"}),
     "bad_request"),
    ("docs not an array", pk(ok_query(docs={"text": "x"})), "bad_request"),
    ("doc not a map", pk(ok_query(docs=["just text"])), "bad_request"),
    ("doc without text", pk(ok_query(docs=[{"id": "a", "title": "t"}])), "bad_request"),
    ("doc text of wrong type", pk(ok_query(docs=[{"text": 12}])), "bad_request"),
    ("doc text not UTF-8", pk(ok_query(docs=[{"text": b"\xff\xfe binary"}])), "bad_request"),
    ("doc text invalid UTF-8 in a str", raw_map([(pk("v"), pk(1)), (pk("op"), pk("query")),
                                                (pk("question"), pk("q")),
                                                (pk("docs"), b"\x91\x81" + pk("text") +
                                                 raw_str(b"ok \xc3\x28 no"))]), "bad_request"),
    ("empty doc text", pk(ok_query(docs=[{"text": "   "}])), "bad_request"),
    ("too many documents", pk(ok_query(docs=[{"text": "word %d" % i} for i in range(MAX_DOCS + 1)])),
     "too_large"),
    ("array claiming 2^32 documents", raw_map([(pk("v"), pk(1)), (pk("op"), pk("query")), (pk("question"), pk("q")),
              (pk("docs"), b"\xdd\xff\xff\xff\xff\x80")]), "bad_request"),
    ("string claiming 4 GB", b"\x83" + pk("v") + pk(1) + pk("op") + pk("ping") + pk("id") +
     b"\xdb\xff\xff\xff\xf0abc", "bad_request"),
    ("negative max_tokens", pk(ok_query(max_tokens=-5)), "bad_request"),
    ("zero max_tokens", pk(ok_query(max_tokens=0)), "bad_request"),
    ("huge max_tokens", pk(ok_query(max_tokens=2**40)), "too_large"),
    ("max_tokens above the cap", pk(ok_query(max_tokens=100000)), "too_large"),
    ("max_context_tokens above the cap", pk(ok_query(max_context_tokens=10**6)), "too_large"),
    ("max_tokens as float", pk(ok_query(max_tokens=1.5)), "bad_request"),
    ("top_k zero", pk(ok_query(top_k=0)), "bad_request"),
    ("top_k huge", pk(ok_query(top_k=2**63)), "too_large"),
    ("temperature as text", pk(ok_query(temperature="hot")), "bad_request"),
    ("temperature NaN", pk(ok_query(temperature=float("nan"))), "bad_request"),
    ("temperature negative", pk(ok_query(temperature=-1.0)), "bad_request"),
    ("top_p zero", pk(ok_query(top_p=0)), "bad_request"),
    ("seed negative", pk(ok_query(seed=-1)), "bad_request"),
    ("stream not a bool", pk(ok_query(stream=1)), "bad_request"),
    ("deadline_ms zero", pk(ok_query(deadline_ms=0)), "bad_request"),
    ("deadline_ms huge", pk(ok_query(deadline_ms=2**50)), "bad_request"),
    ("too many stop strings", pk(ok_query(stop=["a", "b", "c", "d", "e", "f", "g", "h", "i"])),
     "too_large"),
    ("stop with NUL", pk(ok_query(stop=["a\x00b"])), "bad_request"),
    ("deep nesting", pk({"v": 1, "op": "ping", "x": nested(40)}), "bad_request"),
    ("oversize message", pk({"v": 1, "op": "ping", "pad": "x" * (MAX_MSG + 10)}), "too_large"),
    ("extra frame", [pk({"v": 1, "op": "ping", "id": "x"}), b"extra"], "bad_request"),
    ("empty delimiter and empty body", [b"", b""], "bad_request"),
    ("three frames after the delimiter", [b"", pk({"v": 1, "op": "ping"}), b"", b"x"],
     "bad_request"),
    ("ingest doc without id", pk({"v": 1, "op": "ingest", "collection": "main",
                                  "docs": [{"id": "n1", "text": "new doc"}, {"text": "no id"}]}),
     "bad_request"),
    ("ingest with one bad document", pk({"v": 1, "op": "ingest", "collection": "main",
                                         "docs": [{"id": "n2", "text": "fine text"},
                                                  {"id": "n3", "text": ""}]}), "bad_request"),
    ("ingest duplicate ids", pk({"v": 1, "op": "ingest", "collection": "main",
                                 "docs": [{"id": "d", "text": "one"}, {"id": "d", "text": "two"}]}),
     "bad_request"),
    ("ingest bad collection name", pk({"v": 1, "op": "ingest", "collection": "a\nb",
                                       "docs": [{"id": "x", "text": "t"}]}), "bad_request"),
    ("ingest too many documents", pk({"v": 1, "op": "ingest", "collection": "main",
                                      "docs": [{"id": str(i), "text": "t"} for i in range(9)]}),
     "too_large"),
    ("delete without ids", pk({"v": 1, "op": "delete", "collection": "main"}), "bad_request"),
    ("delete ids not strings", pk({"v": 1, "op": "delete", "collection": "main", "ids": [1, 2]}),
     "bad_request"),
    ("get without doc_id", pk({"v": 1, "op": "get", "collection": "main"}), "bad_request"),
    ("list limit zero", pk({"v": 1, "op": "list", "collection": "main", "limit": 0}), "bad_request"),
    ("list limit huge", pk({"v": 1, "op": "list", "collection": "main", "limit": 10**6}), "too_large"),
    ("cancel without target", pk({"v": 1, "op": "cancel"}), "bad_request"),
    ("cancel target of wrong type", pk({"v": 1, "op": "cancel", "target": [1]}), "bad_request"),
    ("ids without collection", pk(ok_query(ids=["a"])), "bad_request"),
]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("malformed"),
               fast_model(tmp_path_factory.mktemp("models")), workers=1,
               max_message_bytes=MAX_MSG, max_docs=MAX_DOCS, max_question_bytes=MAX_Q,
               max_tokens=512, max_context_tokens=2048, max_top_k=50)
    with d:
        yield d
        assert d.stop() == 0


def store_state(c):
    _, st = c.call({"v": 1, "op": "stats", "collection": "main", "id": "st"})
    _, ls = c.call({"v": 1, "op": "list", "collection": "main", "id": "ls"})
    _, cl = c.call({"v": 1, "op": "list", "id": "cl"})
    return (st["docs"], st["chunks"], st["terms"], st["text_bytes"],
            [d["id"] for d in ls["docs"]], cl["collections"])


def test_malformed_requests(daemon):
    assert len(CASES) >= 25
    c = daemon.client()
    _, r = c.call({"v": 1, "op": "ingest", "collection": "main", "id": 0,
                   "docs": [{"id": "p", "text": "Paris is the capital of France."},
                            {"id": "r", "text": "The Rhine flows into the North Sea."}]})
    assert r["ok"], r
    before = store_state(c)
    bad_before = sum(daemon.metric("diffrag_requests_total", op=op, code=code)
                     for op in ("none", "ping", "query", "ingest", "delete", "get", "list",
                                "cancel")
                     for code in ("bad_request", "too_large", "unsupported_version"))
    worst_ms = 0.0
    failures = []
    for name, msg, want in CASES:
        t0 = time.time()
        if isinstance(msg, list):
            c.send_frames(msg)
        else:
            c.send(msg)
        try:
            r = c.recv(5)
        except TimeoutError:
            failures.append((name, "no reply"))
            continue
        worst_ms = max(worst_ms, (time.time() - t0) * 1e3)
        got = r.get("error", {}).get("code") if r.get("ok") is False else "ok"
        if got != want:
            failures.append((name, want, r))
        # nothing else follows the one reply
        if c.poll(0.02):
            failures.append((name, "a second reply", c.recv(1)))
        # ping still answers between malformed messages
        _, p = c.call({"v": 1, "op": "ping", "id": "alive"})
        assert p["pong"] is True, (name, p)
    print("%d malformed cases, slowest reply %.1f ms" % (len(CASES), worst_ms))
    assert not failures, failures
    # the errors echo the id when it could be read
    _, r = c.call(pk({"v": 2, "op": "ping", "id": "ver"}))
    assert r["id"] == "ver" and r["error"]["code"] == "unsupported_version"
    assert "speaks 1" in r["error"]["message"]
    assert store_state(c) == before
    bad_after = sum(daemon.metric("diffrag_requests_total", op=op, code=code)
                    for op in ("none", "ping", "query", "ingest", "delete", "get", "list",
                               "cancel")
                    for code in ("bad_request", "too_large", "unsupported_version"))
    assert bad_after - bad_before == len(CASES) + 1, (bad_after, bad_before)
    # a well-formed query still works
    _, r = c.call(ok_query(id="after", max_tokens=3))
    assert r["ok"] and r["citations"][0]["doc_id"] == "a"


def test_message_past_the_transport_limit_drops_only_that_peer(daemon):
    """Past 4x max_message_bytes ZeroMQ drops the connection before buffering the message; the
    daemon and its other clients carry on."""
    rogue = daemon.client()
    rogue.send(pk({"v": 1, "op": "ping", "pad": "x" * (5 * MAX_MSG)}))
    assert not rogue.poll(0.5)
    c = daemon.client()
    _, r = c.call({"v": 1, "op": "ping", "id": "still"})
    assert r["pong"] is True
