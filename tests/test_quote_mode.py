"""Quote mode (docs/groundedness.md#quote-mode) through the daemon: with answer_mode "quote"
every answer is a join of verbatim spans of the placed documents. A tiny random model sampled
at temperature 1 writes whatever it likes, so across many seeds the constraint is what keeps
every span in the documents: each quote's text is the document's bytes at its offsets, the
quotes make the answer, its marker is its citation's, and the removed mass is reported per
token and on average. Stored collections, streaming, batching, declining and the
configuration key are covered too; free mode is unchanged."""
import time

import pytest

from daemon_util import Daemon, gen_model, query
from conftest import ROOT
from test_daemon_grounding import DOCS, refused_start, sha256, write_calibration

DOC_TEXT = {d["id"]: d["text"].encode() for d in DOCS}
QUESTIONS = ["How long is the Rhine?", "Which river crosses Paris?", "Where does the Rhine end?",
             "What lies on the banks of the Rhine?"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return gen_model(tmp_path_factory.mktemp("models") / "tiny-untied.gguf", "--seed", 7,
                     "--untied")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("quote")
    with Daemon(tmp, model, workers=1) as d:
        yield d


def call(d, msg, timeout=60):
    deltas, r = d.client().call(msg, timeout=timeout)
    assert r["ok"], r
    return deltas, r


def check_quotes(r, doc_text, generated=None):
    """Every quote is the document's bytes at its offsets, cited by its chunk's marker, and
    the quotes, one after the other, are the generated text."""
    generated = r["answer"] if generated is None else generated
    assert r["answer_mode"] == "quote"
    markers = {c["marker"]: c for c in r["citations"]}
    joined = b""
    for q in r["quotes"]:
        a, b = q["offsets"]
        assert 0 <= a < b <= len(doc_text[q["doc_id"]]), q
        assert doc_text[q["doc_id"]][a:b] == q["text"].encode(), (q, doc_text[q["doc_id"]][a:b])
        c = markers[q["marker"]]
        assert c["doc_id"] == q["doc_id"] and c["chunk"] == q["chunk"], (q, c)
        assert c["offsets"][0] <= a and b <= c["offsets"][1], (q, c)
        joined += q["text"].encode()
    assert joined == generated.encode(), (r["quotes"], generated)
    n = r["grounding"]["answer_tokens"]
    assert len(r["quotes"]) <= 4 and (n == 0) == (not r["quotes"]), r
    return joined


def test_every_span_is_in_the_documents(daemon):
    spans = removed_seen = 0
    for seed in range(1, 25):
        q = QUESTIONS[seed % len(QUESTIONS)]
        _, r = call(daemon, query(q, DOCS, answer_mode="quote", temperature=1.0, seed=seed,
                                  max_tokens=16, include=["token_signals"]))
        check_quotes(r, DOC_TEXT)
        spans += len(r["quotes"])
        g, ts = r["grounding"], r["token_signals"]
        assert len(ts["quote_removed"]) == g["answer_tokens"]
        assert all(0 <= x <= 1 for x in ts["quote_removed"])
        if g["answer_tokens"]:
            mean = sum(ts["quote_removed"]) / g["answer_tokens"]
            assert abs(g["quote_removed"] - mean) < 1e-5, (g["quote_removed"], mean)
            removed_seen += g["quote_removed"] > 0.01
        # a quote's citation is cited; a citation no quote comes from is not
        quoted = {q["marker"] for q in r["quotes"]}
        assert {c["marker"] for c in r["citations"] if c["cited"]} == quoted
    # a random model puts most of its mass outside the documents, and joins spans
    assert spans > 24 and removed_seen > 12, (spans, removed_seen)


def test_free_mode_is_unchanged(daemon):
    msg = query(QUESTIONS[0], DOCS, temperature=1.0, seed=5, max_tokens=12,
                include=["token_signals"])
    _, plain = call(daemon, msg)
    _, free = call(daemon, dict(msg, answer_mode="free"))
    assert plain["answer_mode"] == free["answer_mode"] == "free"
    assert plain["quotes"] == [] and plain["grounding"]["quote_removed"] is None
    assert "quote_removed" not in plain["token_signals"]
    for k in ("answer", "citations", "grounding", "token_signals"):
        assert plain[k] == free[k], k


def test_streamed_deltas_make_the_quoted_answer(daemon):
    deltas, r = call(daemon, query(QUESTIONS[1], DOCS, answer_mode="quote", temperature=1.0,
                                   seed=11, max_tokens=16, stream=True))
    check_quotes(r, DOC_TEXT)
    assert "".join(d["delta"] for d in deltas) == r["answer"]


def test_batched_quotes_equal_one_at_a_time(daemon):
    msgs = [query(QUESTIONS[i % 4], DOCS, answer_mode="quote" if i % 2 else "free",
                  temperature=1.0, seed=40 + i, max_tokens=16) for i in range(6)]
    alone = [call(daemon, m)[1] for m in msgs]
    clients = [daemon.client() for _ in msgs]
    for i, (c, m) in enumerate(zip(clients, msgs)):
        c.send(dict(m, id="b%d" % i))
    together = [c.recv(timeout=60) for c in clients]
    for a, t in zip(alone, together):
        assert t["ok"], t
        assert (t["answer"], t["quotes"]) == (a["answer"], a["quotes"])


def test_a_stored_collection_is_quoted_at_its_offsets(daemon):
    docs = [{"id": "essay", "title": "Rivers", "text": " ".join(
        "River %d flows %d km to the sea past the town of Town%d." % (i, 100 + 7 * i, i)
        for i in range(120))}]
    call(daemon, {"v": 1, "op": "ingest", "collection": "rivers", "docs": docs})
    _, got = call(daemon, {"v": 1, "op": "get", "collection": "rivers", "doc_id": "essay"})
    text = {"essay": got["doc"]["text"].encode()}
    for seed in range(1, 7):
        _, r = call(daemon, {"v": 1, "op": "query", "question": "How far does river 17 flow?",
                             "collection": "rivers", "top_k": 4, "relevance_floor": 0,
                             "answer_mode": "quote",
                             "temperature": 1.0, "seed": seed, "max_tokens": 16})
        assert len(r["citations"]) > 1
        check_quotes(r, text)


def test_a_bad_mode_is_refused(daemon):
    _, r = daemon.client().call(query(QUESTIONS[0], DOCS, answer_mode="verbatim"), timeout=30)
    assert not r["ok"] and r["error"]["code"] == "bad_request"
    assert "answer_mode" in r["error"]["message"], r


def test_the_configured_mode_and_a_declined_quote(tmp_path, model):
    """answer_mode = quote in the configuration quotes queries that do not say; a quoted
    attempt the detector flags is declined, its quotes describing the attempt."""
    cal = write_calibration(tmp_path / "tiny.grounding", sha256(model))
    with Daemon(tmp_path, model, workers=1, answer_mode="quote", grounding_calibration=cal,
                grounding_threshold="0") as d:
        _, r = call(d, query(QUESTIONS[0], DOCS, temperature=1.0, seed=3, max_tokens=12))
        assert r["answer_mode"] == "quote" and r["grounding"]["flagged"] is True
        check_quotes(r, DOC_TEXT)
        _, r = call(d, query(QUESTIONS[0], DOCS, temperature=1.0, seed=3, max_tokens=12,
                             unsupported="decline"))
        assert r["declined"] and r["decline_reason"] == "flagged", r
        check_quotes(r, DOC_TEXT, generated=r["attempt"])
        assert not any(c["cited"] for c in r["citations"])
        _, r = call(d, query(QUESTIONS[0], DOCS, answer_mode="free", temperature=1.0, seed=3,
                             max_tokens=12))
        assert r["answer_mode"] == "free" and r["quotes"] == []


def test_a_bad_configured_mode_stops_the_start(tmp_path, model):
    log = refused_start(tmp_path, model, answer_mode="verbatim")
    assert "answer_mode" in log and "free or quote" in log, log


def test_real_text_is_quoted(tmp_path):
    """The tests' small instruct model over a real paragraph: a greedy quoted answer is a
    span of it, begins with a word (not a space), and its removed mass is small when the
    paragraph says the answer."""
    model = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    para = (ROOT / "examples" / "sample-paragraph.txt").read_text()
    docs = [{"id": "sample", "text": para}]
    with Daemon(tmp_path, model, workers=1, threads=2) as d:
        t0 = time.time()
        _, r = call(d, query("How long is the Rhine?", docs, answer_mode="quote",
                             max_tokens=24), timeout=120)
        check_quotes(r, {"sample": para.encode()})
        assert r["answer"] and not r["answer"][0].isspace(), r["answer"]
        assert r["grounding"]["quote_removed"] is not None
        print("quoted in %.1f s: %r, removed %.3f" % (time.time() - t0, r["answer"],
                                                     r["grounding"]["quote_removed"]))
