"""A query's conversation history and system text end to end (docs/protocol.md, `query`): both
accepted and counted in the reply's `context`, every malformed turn refused with the turn
named, the oldest turns left out when the budget is small, a system text too long for the
budget named in the refusal, and the Python client's history= and system= arguments."""
import sys

import pytest

from conftest import ROOT
from daemon_util import Daemon, fast_model, query

sys.path.insert(0, str(ROOT / "clients" / "python"))
import diffrag  # noqa: E402

DOCS = [{"id": "rhine", "title": "Rhine", "text": "The Rhine is a European river that flows "
         "into the North Sea. It is about 1,230 km long."}]

TURNS = [{"role": "user", "content": "Where does the Rhine flow?"},
         {"role": "assistant", "content": "Into the North Sea [1]."}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    model = fast_model(tmp_path_factory.mktemp("models"))
    d = Daemon(tmp_path_factory.mktemp("hist"), model, workers=1, max_question_bytes=512,
               max_turn_bytes=512)
    with d:
        yield d
        assert d.stop() == 0, d.log_text()[-2000:]


def ask(client, **kw):
    kw.setdefault("max_tokens", 2)
    _, r = client.call(query("And how long is it?", DOCS, **kw))
    return r


def test_history_and_system_are_counted(daemon):
    c = daemon.client()
    plain = ask(c, id="plain")
    assert plain["ok"], plain
    assert plain["context"]["history_turns"] == 0 and plain["context"]["history_left_out"] == 0
    r = ask(c, id="hist", history=TURNS, system="Answer in one short sentence.")
    assert r["ok"], r
    cx = r["context"]
    assert cx["history_turns"] == 2 and cx["history_left_out"] == 0, cx
    # the turns and the system text are in the prompt, not among the documents
    assert r["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert r["usage"]["context_tokens"] == plain["usage"]["context_tokens"]
    assert [x["doc_id"] for x in r["citations"]] == ["rhine"]
    # unknown keys in a turn are ignored; an empty history is no history
    r = ask(c, history=[dict(TURNS[0], name="ana")])
    assert r["ok"] and r["context"]["history_turns"] == 1, r
    r = ask(c, history=[])
    assert r["ok"] and r["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"], r


@pytest.mark.parametrize("history,system,code,says", [
    ([{"role": "system", "content": "x"}], None, "bad_request",
     'history[0].role must be "user" or "assistant" (a system message goes in the query\'s "system")'),
    ([TURNS[0], {"role": "tool", "content": "x"}], None, "bad_request",
     'history[1].role must be "user" or "assistant"'),
    ([{"role": "user", "content": 5}], None, "bad_request",
     "history[0].content must be a string, not"),
    ([{"role": "user", "content": ""}], None, "bad_request", "history[0].content is empty"),
    ([{"role": "user", "content": "x" * 513}], None, "too_large",
     "history[0].content has 513 bytes; the limit is 512"),
    ([{"content": "hi"}], None, "bad_request", "history[0] has no role"),
    ([{"role": "user"}], None, "bad_request", "history[0] has no content"),
    (["hi"], None, "bad_request", "history[0] must be a map"),
    ("user: hi", None, "bad_request", "history must be an array"),
    ([TURNS[0]] * 257, None, "too_large", "history has 257 turns; the limit is 256"),
    (None, "", "bad_request", "system is empty"),
    (None, ["be brief"], "bad_request", "system must be a string"),
    (None, "s" * 513, "too_large", "system has 513 bytes; the limit is 512"),
])
def test_malformed_history_is_refused(daemon, history, system, code, says):
    kw = {}
    if history is not None:
        kw["history"] = history
    if system is not None:
        kw["system"] = system
    r = ask(daemon.client(), id="bad", **kw)
    assert r["ok"] is False and r["id"] == "bad", r
    assert r["error"]["code"] == code and says in r["error"]["message"], r["error"]


def test_256_turns_are_accepted(daemon):
    r = ask(daemon.client(), history=[TURNS[i % 2] for i in range(256)])
    assert r["ok"], r
    assert r["context"]["history_turns"] + r["context"]["history_left_out"] == 256


def test_small_budget_leaves_the_oldest_turns_out(daemon):
    c = daemon.client()
    plain = ask(c)
    fixed_and_docs = plain["usage"]["prompt_tokens"]
    turns = [{"role": ("user", "assistant")[i % 2],
              "content": "Turn %d: a sentence about rivers, seas and their lengths." % i}
             for i in range(30)]
    budget = fixed_and_docs + 240
    r = ask(c, history=turns, max_context_tokens=budget)
    assert r["ok"], r
    cx = r["context"]
    assert cx["history_turns"] >= 1 and cx["history_left_out"] >= 1, cx
    assert cx["history_turns"] + cx["history_left_out"] == 30
    assert r["usage"]["prompt_tokens"] <= budget
    # the turns take at most half of what the fixed part leaves: the document still fits whole
    assert cx["whole"] and [x["doc_id"] for x in r["citations"]] == ["rhine"], r
    # a larger budget places more of them
    r2 = ask(c, history=turns, max_context_tokens=budget + 600)
    assert r2["ok"] and r2["context"]["history_turns"] > cx["history_turns"], r2["context"]


def test_system_text_over_the_budget_is_named(daemon):
    c = daemon.client()
    plain = ask(c)
    budget = max(64, plain["usage"]["prompt_tokens"] - plain["usage"]["context_tokens"])
    r = ask(c, system="Be brief and polite. " * 24, max_context_tokens=budget)
    assert r["ok"] is False and r["error"]["code"] == "too_large", r
    assert "system text" in r["error"]["message"], r["error"]


def test_python_client_passes_history_and_system(daemon):
    with diffrag.Client(daemon.endpoint, timeout=30) as cl:
        a = cl.query("And how long is it?", docs=DOCS, max_tokens=2, history=TURNS,
                     system="Answer in one short sentence.")
        assert a.context.history_turns == 2 and a.context.history_left_out == 0, a.context
        parts = list(cl.stream("And how long is it?", docs=DOCS, max_tokens=2, history=TURNS[:1]))
        assert parts[-1].context.history_turns == 1
        with pytest.raises(diffrag.BadRequest, match=r"history\[0\]\.role"):
            cl.query("And how long is it?", docs=DOCS, max_tokens=2,
                     history=[{"role": "robot", "content": "beep"}])
