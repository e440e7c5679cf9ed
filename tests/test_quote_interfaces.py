"""Quote mode through every interface (docs/protocol.md, `answer_mode`): the same greedy
question over the same inline documents asked with answer_mode = quote over msgpack, the C
library (build/tests/test_client_c --quote), the CLI (`diffrag ask --answer-mode quote`), the
Python client (sync and async, blocking and streamed) and the OpenAI API (diffrag.answer_mode,
plain and streamed). Each interface's quotes are the msgpack reply's, each quote's text is its
document's bytes at its offsets, and the quotes make the answer; a free answer has none; a bad
value is refused everywhere with the daemon's message. The default model, a few tokens each."""
import asyncio
import http.client
import json
import sys

import pytest

from conftest import BUILD, DEFAULT_MODEL, ROOT
from daemon_util import Daemon, query
from test_cli import cli

sys.path.insert(0, str(ROOT / "clients" / "python"))
import diffrag  # noqa: E402

QUESTION = "How long is the Rhine?"
TEXTS = {"rhine.txt": "The Rhine is a European river. It flows about 1,230 kilometres from the "
                      "Swiss Alps\nto the North Sea. Cologne and Basel lie on its banks.\n",
         "paris.txt": "Paris is the capital of France; the Seine crosses it.\n"}
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quote-if")
    files = []
    for name, text in TEXTS.items():
        (tmp / name).write_text(text)
        files.append(str(tmp / name))
    # the documents as `diffrag ask -d FILE` sends them: the path as id, no title (so that the
    # same text through any interface makes the same prompt)
    docs = [{"id": f, "text": TEXTS[f.rsplit("/", 1)[1]]} for f in files]
    with Daemon(tmp, DEFAULT_MODEL, workers=1) as d:
        yield d, files, docs


def raw(d, docs, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0)
    deltas, r = d.client().call(query(QUESTION, docs, **kw), timeout=120)
    return deltas, r


@pytest.fixture(scope="module")
def reference(setup):
    """The msgpack reply of the quote-mode question: what every interface must show."""
    d, files, docs = setup
    _, r = raw(d, docs, answer_mode="quote", include=["token_signals"])
    assert r["ok"], r
    return r


def test_msgpack_quotes_are_the_documents_bytes(setup, reference):
    d, files, docs = setup
    r = reference
    assert r["answer_mode"] == "quote" and r["quotes"], r
    by_id = {x["id"]: x["text"].encode() for x in docs}
    cites = {c["marker"]: c for c in r["citations"]}
    for q in r["quotes"]:
        assert set(q) == {"marker", "doc_id", "chunk", "offsets", "text"}, q
        s, e = q["offsets"]
        assert 0 <= s < e and by_id[q["doc_id"]][s:e] == q["text"].encode(), q
        c = cites[q["marker"]]
        assert c["doc_id"] == q["doc_id"] and c["chunk"] == q["chunk"] and c["cited"], (c, q)
        assert c["offsets"][0] <= s and e <= c["offsets"][1], (c, q)
    assert "".join(q["text"] for q in r["quotes"]) == r["answer"], r
    # a citation no quote comes from is not cited, whatever the answer says
    quoted = {q["marker"] for q in r["quotes"]}
    assert all(c["cited"] == (c["marker"] in quoted) for c in r["citations"]), r["citations"]
    g = r["grounding"]
    removed = r["token_signals"]["quote_removed"]
    assert 0 <= g["quote_removed"] <= 1 and len(removed) == g["answer_tokens"] > 0, g
    assert abs(sum(removed) / len(removed) - g["quote_removed"]) < 1e-5, (removed, g)
    # streamed: the deltas are the quotes' text, and the quotes the same
    deltas, s = raw(d, docs, answer_mode="quote", stream=True)
    assert s["quotes"] == r["quotes"] and "".join(x["delta"] for x in deltas) == s["answer"]
    # free: no quote, no removed mass, no quote_removed signal
    _, f = raw(d, docs, include=["token_signals"])
    assert f["answer_mode"] == "free" and f["quotes"] == [], f
    assert f["grounding"]["quote_removed"] is None, f["grounding"]
    assert "quote_removed" not in f["token_signals"], f["token_signals"].keys()
    _, b = raw(d, docs, answer_mode="bogus")
    assert b["ok"] is False and b["error"]["code"] == "bad_request", b
    assert b["error"]["message"] == 'answer_mode must be "free" or "quote"', b


def test_c_library(setup, reference):
    d, files, docs = setup
    import subprocess
    p = subprocess.run([str(BUILD / "tests" / "test_client_c"), "--endpoint", d.endpoint,
                        "--quote", QUESTION, str(MAX_TOKENS), *files],
                       capture_output=True, text=True, timeout=120)
    print(p.stdout[-4000:], p.stderr[-4000:])
    assert p.returncode == 0 and "checks, 0 failed" in p.stdout, p.stderr
    got = []
    for line in p.stdout.splitlines():
        if line.startswith("quote "):
            _, marker, doc_id, chunk, s, e, hexed = line.split(" ")
            got.append({"marker": int(marker), "doc_id": doc_id, "chunk": int(chunk),
                        "offsets": [int(s), int(e)], "text": bytes.fromhex(hexed).decode()})
        elif line.startswith("quote_removed "):
            removed = float(line.split()[1])
    assert got == reference["quotes"], (got, reference["quotes"])
    assert removed == pytest.approx(reference["grounding"]["quote_removed"], abs=1e-12)


def shown(text):
    """A quote's text as the CLI prints it: on one line, cut at 100 characters."""
    t = " ".join(text.split())
    return t if len(t) <= 100 else t[:100] + "\u2026"


def test_cli(setup, reference):
    d, files, docs = setup
    args = ["ask", QUESTION, *sum((["-d", f] for f in files), []), "--max-tokens", MAX_TOKENS]
    r = cli(*args, "--answer-mode", "quote", endpoint=d.endpoint, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(reference["answer"] + "\n"), r.stdout
    lines = r.stdout.splitlines()
    want = ['quote [%d] %s bytes %d-%d: "%s"' % (q["marker"], q["doc_id"], *q["offsets"],
                                                  shown(q["text"])) for q in reference["quotes"]]
    quoted = [x for x in lines if x.startswith("quote [")]
    assert quoted == want, (quoted, want)
    # after the sources, before the grounding
    first = lines.index(want[0])
    assert lines.index("sources:") < first < min(i for i, x in enumerate(lines)
                                                 if x.startswith("grounding:")), lines
    details = [x for x in lines if x.startswith("  details: ")]
    pct = "probability quote mode removed %.1f%%" % (100 * reference["grounding"]["quote_removed"])
    assert len(details) == 1 and pct in details[0], (details, pct)
    # free: neither
    r = cli(*args, endpoint=d.endpoint, timeout=120)
    assert r.returncode == 0 and "\nquote" not in r.stdout and "removed" not in r.stdout, \
        r.stdout
    r = cli(*args, "--answer-mode", "bogus", endpoint=d.endpoint)
    assert r.returncode == 2 and '--answer-mode wants free or quote, not "bogus"' in r.stderr, \
        r.stderr
    r = cli("ask", "--help")
    assert "--answer-mode MODE" in r.stdout, r.stdout


def as_quotes(qs):
    return [{"marker": q.marker, "doc_id": q.doc_id, "chunk": q.chunk,
             "offsets": list(q.offsets), "text": q.text} for q in qs]


def test_python_sync(setup, reference):
    d, files, docs = setup
    with diffrag.Client(d.endpoint, timeout=120) as c:
        a = c.query(QUESTION, docs=docs, max_tokens=MAX_TOKENS, answer_mode="quote")
        assert a.answer_mode == "quote" and a.answer == reference["answer"], a
        assert all(isinstance(q, diffrag.Quote) for q in a.quotes)
        assert as_quotes(a.quotes) == reference["quotes"], a.quotes
        assert a.grounding.quote_removed == reference["grounding"]["quote_removed"]
        parts = list(c.stream(QUESTION, docs=docs, max_tokens=MAX_TOKENS, answer_mode="quote"))
        final = parts[-1]
        assert as_quotes(final.quotes) == reference["quotes"], final.quotes
        assert "".join(p.text for p in parts[:-1]) == "".join(q.text for q in final.quotes)
        f = c.query(QUESTION, docs=docs, max_tokens=MAX_TOKENS, answer_mode="free")
        assert f.answer_mode == "free" and f.quotes == [] and f.grounding.quote_removed is None
        with pytest.raises(diffrag.BadRequest, match="answer_mode must be"):
            c.query(QUESTION, docs=docs, answer_mode="bogus")


def test_python_async(setup, reference):
    d, files, docs = setup

    async def go():
        async with diffrag.AsyncClient(d.endpoint, timeout=120) as c:
            a = await c.query(QUESTION, docs=docs, max_tokens=MAX_TOKENS, answer_mode="quote")
            parts = [x async for x in c.stream(QUESTION, docs=docs, max_tokens=MAX_TOKENS,
                                               answer_mode="quote")]
            with pytest.raises(diffrag.BadRequest):
                await c.query(QUESTION, docs=docs, answer_mode="bogus")
            return a, parts

    a, parts = asyncio.run(go())
    assert a.answer_mode == "quote" and as_quotes(a.quotes) == reference["quotes"], a
    assert a.grounding.quote_removed == reference["grounding"]["quote_removed"]
    assert as_quotes(parts[-1].quotes) == reference["quotes"], parts[-1]


def post(d, body):
    c = http.client.HTTPConnection("127.0.0.1", d.http_port, timeout=120)
    c.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
              {"Content-Type": "application/json"})
    resp = c.getresponse()
    text = resp.read().decode()
    c.close()
    return resp.status, text


def test_openai_api(setup, reference):
    d, files, docs = setup
    body = {"model": "x", "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": MAX_TOKENS, "temperature": 0,
            "diffrag": {"docs": docs, "answer_mode": "quote"}}
    status, text = post(d, body)
    assert status == 200, text
    r = json.loads(text)
    x = r["diffrag"]
    assert r["choices"][0]["message"]["content"] == reference["answer"], r
    assert x["answer_mode"] == "quote" and x["quotes"] == reference["quotes"], x
    assert x["grounding"]["quote_removed"] == pytest.approx(
        reference["grounding"]["quote_removed"], abs=1e-12)
    status, text = post(d, dict(body, stream=True))
    assert status == 200, text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    shown_text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                         if c["choices"])
    last = [c for c in chunks if "diffrag" in c][-1]["diffrag"]
    assert last["answer_mode"] == "quote" and last["quotes"] == reference["quotes"], last
    assert shown_text == "".join(q["text"] for q in last["quotes"]), (shown_text, last)
    status, text = post(d, dict(body, diffrag={"docs": docs}))
    assert status == 200 and json.loads(text)["diffrag"]["quotes"] == [], text
    assert json.loads(text)["diffrag"]["answer_mode"] == "free", text
    status, text = post(d, dict(body, diffrag={"docs": docs, "answer_mode": "bogus"}))
    assert status == 400 and "answer_mode must be" in text, text
    status, text = post(d, dict(body, diffrag={"docs": docs, "answer_modes": "quote"}))
    assert status == 400 and "unsupported, answer_mode)" in text, text


def test_cli_quote_lines_are_one_line_and_cut():
    """What the CLI makes of a quote's text, from a fake daemon: whitespace runs (newlines,
    tabs) shown as one space and trimmed at the ends, cut after 100 characters (not bytes)
    with an ellipsis; a quote-mode answer with no quote says so."""
    from test_clients_python import GROUNDED, FakeServer, pong
    long_text = "\n\tDer Rhein fließt " + "é" * 120 + "  \n"
    quotes = [{"marker": 1, "doc_id": "rhine", "chunk": 0, "offsets": [5, 12],
               "text": " about\n\t1,230 km "},
              {"marker": 2, "doc_id": "de", "chunk": 3, "offsets": [100, 100 + len(
                  long_text.encode())], "text": long_text}]
    reply = dict(GROUNDED, answer_mode="quote", quotes=quotes,
                 grounding=dict(GROUNDED["grounding"], quote_removed=0.02849))
    replies = [reply, dict(reply, quotes=[], answer=""), dict(GROUNDED)]

    def handler(req):
        if req["op"] == "query":
            return [replies.pop(0)]
        return pong(req)

    with FakeServer(handler) as srv:
        r = cli("ask", "-c", "x", "How long?", endpoint=srv.endpoint)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        cut = "Der Rhein fließt " + "é" * 83 + "\u2026"
        assert 'quote [1] rhine bytes 5-12: "about 1,230 km"' in lines, lines
        assert 'quote [2] de bytes 100-%d: "%s"' % (100 + len(long_text.encode()), cut) in lines
        assert "probability quote mode removed 2.8%" in r.stdout, r.stdout
        r = cli("ask", "-c", "x", "How long?", endpoint=srv.endpoint)
        assert "\nquotes: none (the answer quotes nothing)\n" in r.stdout, r.stdout
        r = cli("ask", "-c", "x", "How long?", endpoint=srv.endpoint)   # no answer_mode: free
        assert "quote" not in r.stdout and "removed" not in r.stdout, r.stdout
