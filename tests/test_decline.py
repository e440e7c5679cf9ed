"""Declining as a policy (docs/groundedness.md#declining): a query's `unsupported` (or the
configuration's) is `answer`, `mark` (the default: the reply as it always was) or `decline`.
Declined when retrieval matched nothing, the answer is decline_text and nothing is generated (no
prefill: no engine step, no prompt token counted); declined when the detector flags the
answer, the model's attempt is kept in `attempt`; `answer` reports the score with no flag; the
outcome counters move by what the replies say; the OpenAI API shows a decline as a normal
completion, and so do the CLI and the Python client; SIGHUP reloads the policy; a bad value
is refused with a clear message. A tiny random model with a calibration
whose threshold is 0 flags every answer it scores, so the flagged paths are deterministic."""
import http.client
import json
import subprocess

import pytest

from daemon_util import DIFFRAGD, Daemon, gen_model, query
from test_daemon_grounding import DOCS, sha256, write_calibration

ANSWERABLE = "How long is the Rhine?"
UNMATCHED = "Boiling tungsten?"        # no word of it is in DOCS
DEFAULT_TEXT = "The documents do not say."


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return gen_model(tmp_path_factory.mktemp("models") / "tiny-untied.gguf", "--seed", 7,
                     "--untied")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, model):
    """A daemon whose detector flags every scored answer (threshold 0); policy mark."""
    tmp = tmp_path_factory.mktemp("decline")
    cal = write_calibration(tmp / "tiny.grounding", sha256(model))
    with Daemon(tmp, model, workers=1, grounding_calibration=cal, grounding_threshold="0") as d:
        yield d


def ask(d, question, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 1.0)
    kw.setdefault("seed", 3)
    deltas, r = d.client().call(query(question, DOCS, **kw), timeout=60)
    assert r["ok"], r
    return deltas, r


COUNTED = {"answered": ("diffrag_answers_total", {"outcome": "answered"}),
           "flagged": ("diffrag_answers_total", {"outcome": "flagged"}),
           "declined": ("diffrag_answers_total", {"outcome": "declined"}),
           "no_match": ("diffrag_declined_answers_total", {"reason": "no_match"}),
           "declined_flagged": ("diffrag_declined_answers_total", {"reason": "flagged"}),
           "detector_flags": ("diffrag_hallucination_flagged_requests_total", {}),
           "prompt_tokens": ("diffrag_prompt_tokens_total", {}),
           "engine_steps": ("diffrag_step_tokens_count", {})}


def counts(d):
    return {k: d.metric(name, **labels) for k, (name, labels) in COUNTED.items()}


def moved(before, after):
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


def test_mark_is_the_default_and_unchanged(daemon):
    before = counts(daemon)
    _, r = ask(daemon, ANSWERABLE)
    assert r["declined"] is False and r["decline_reason"] is None and r["attempt"] is None
    assert r["grounding"]["flagged"] is True and r["answer"], r
    _, r2 = ask(daemon, UNMATCHED)          # mark never declines: it answers and flags
    assert r2["context"]["chunks_matched"] == 0 and r2["usage"]["completion_tokens"] > 0, r2
    assert r2["declined"] is False
    m = moved(before, counts(daemon))
    assert m["flagged"] == 2, m
    assert "declined" not in m, m


def test_no_match_declines_without_generating(daemon):
    before = counts(daemon)
    deltas, r = ask(daemon, UNMATCHED, unsupported="decline", stream=True)
    assert r["answer"] == DEFAULT_TEXT and r["declined"] is True, r
    assert r["decline_reason"] == "no_match" and r["attempt"] is None, r
    assert r["context"]["chunks_matched"] == 0 and r["citations"] == [], r
    assert r["usage"]["prompt_tokens"] == 0 and r["usage"]["completion_tokens"] == 0, r
    assert r["grounding"]["score"] is None and r["grounding"]["answer_tokens"] == 0, r
    assert "".join(x["delta"] for x in deltas) == r["answer"]
    m = moved(before, counts(daemon))
    # no engine step ran and no prompt token was counted: nothing was prefilled
    assert m == {"declined": 1, "no_match": 1}, m
    assert "outcome=declined decline_reason=no_match" in daemon.log_text()


def test_flagged_answer_is_declined_and_its_attempt_kept(daemon):
    _, marked = ask(daemon, ANSWERABLE, seed=5)
    before = counts(daemon)
    deltas, r = ask(daemon, ANSWERABLE, seed=5, unsupported="decline", stream=True)
    assert r["context"]["chunks_matched"] > 0, r
    assert r["declined"] is True and r["decline_reason"] == "flagged", r
    assert r["answer"] == DEFAULT_TEXT and r["attempt"] == marked["answer"], (r, marked)
    # the grounding figures are the attempt's: the detector flagged it
    assert r["grounding"] == marked["grounding"] | {"flagged": True}
    assert r["usage"]["completion_tokens"] == marked["usage"]["completion_tokens"] > 0
    # the deltas streamed the attempt; the final reply says to show the fixed answer instead
    assert "".join(x["delta"] for x in deltas) == r["attempt"]
    m = moved(before, counts(daemon))
    assert m["declined"] == 1, m
    assert m["declined_flagged"] == 1, m
    assert m["detector_flags"] == 1, m   # the detector's rate
    assert m["engine_steps"] > 0 and m["prompt_tokens"] > 0, m


def test_answer_drops_the_flag_and_keeps_the_score(daemon):
    before = counts(daemon)
    _, r = ask(daemon, ANSWERABLE, unsupported="answer")
    g = r["grounding"]
    assert g["score"] is not None and g["flagged"] is False and g["flagged_tokens"] == 0, g
    assert r["declined"] is False and r["answer"], r
    _, r2 = ask(daemon, UNMATCHED, unsupported="answer")
    assert r2["usage"]["completion_tokens"] > 0 and not r2["declined"], r2
    m = moved(before, counts(daemon))
    assert m["answered"] == 2, m
    assert "detector_flags" not in m, m


def test_bad_query_value_is_refused(daemon):
    _, r = daemon.client().call(query(ANSWERABLE, DOCS, unsupported="maybe"))
    assert r["ok"] is False and r["error"]["code"] == "bad_request", r
    assert "unsupported must be" in r["error"]["message"], r
    _, r = daemon.client().call(query(ANSWERABLE, DOCS, unsupported=1))
    assert r["ok"] is False and r["error"]["code"] == "bad_request", r


def post(d, body):
    c = http.client.HTTPConnection("127.0.0.1", d.http_port, timeout=60)
    c.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
              {"Content-Type": "application/json"})
    resp = c.getresponse()
    text = resp.read().decode()
    c.close()
    return resp.status, text


def test_openai_api_declines(daemon):
    body = {"model": "x", "messages": [{"role": "user", "content": UNMATCHED}],
            "max_tokens": 8, "diffrag": {"docs": DOCS, "unsupported": "decline"}}
    status, text = post(daemon, body)
    assert status == 200, text
    r = json.loads(text)
    assert r["choices"][0]["message"]["content"] == DEFAULT_TEXT, r
    assert r["choices"][0]["finish_reason"] == "stop"
    x = r["diffrag"]
    assert x["declined"] is True and x["decline_reason"] == "no_match" and x["attempt"] is None
    assert r["usage"]["prompt_tokens"] == 0 and r["usage"]["completion_tokens"] == 0, r
    # a flagged decline, streamed: the last chunk carries the answer that replaces the deltas
    body = dict(body, stream=True, temperature=1.0, seed=3,
                messages=[{"role": "user", "content": ANSWERABLE}])
    status, text = post(daemon, body)
    assert status == 200, text
    chunks = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]
    shown = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    last = [c for c in chunks if "diffrag" in c][-1]["diffrag"]
    assert last["declined"] is True and last["decline_reason"] == "flagged", last
    assert last["answer"] == DEFAULT_TEXT and last["attempt"] == shown, (last, shown)
    status, text = post(daemon, dict(body, diffrag={"docs": DOCS, "unsupported": "never"}))
    assert status == 400 and "unsupported" in text, text


def test_configured_policy_and_text(tmp_path, model):
    with Daemon(tmp_path, model, workers=1, grounding_calibration="none",
                unsupported="decline", decline_text="Nothing on that here.") as d:
        _, r = ask(d, UNMATCHED)
        assert r["answer"] == "Nothing on that here." and r["decline_reason"] == "no_match", r
        _, r = ask(d, UNMATCHED, unsupported="mark")       # the query's own wins
        assert r["declined"] is False and r["usage"]["completion_tokens"] > 0, r
        # without a calibration nothing is flagged, so a matched question is answered
        _, r = ask(d, ANSWERABLE)
        assert r["declined"] is False and r["grounding"]["flagged"] is None, r


@pytest.mark.parametrize("args,needle", [
    (("--unsupported", "maybe"), 'unsupported: "maybe" is not answer, mark or decline'),
    (("--decline-text", ""), "decline_text: must be a non-empty"),
])
def test_bad_configuration_is_refused(model, args, needle):
    p = subprocess.run([str(DIFFRAGD), "--config", "/dev/null", "--model", str(model),
                        "--check-config", *args], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and needle in p.stderr, (p.returncode, p.stderr)


def test_cli_shows_the_decline(daemon, tmp_path):
    from test_cli import cli
    doc = tmp_path / "rhine.txt"
    doc.write_text(DOCS[0]["text"])
    r = cli("ask", UNMATCHED, "-d", doc, "--unsupported", "decline", endpoint=daemon.endpoint)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(DEFAULT_TEXT + "\n"), r.stdout
    assert "declined: the documents do not say (retrieval found nothing on the question)" \
        in r.stdout and "attempt:" not in r.stdout, r.stdout
    r = cli("ask", ANSWERABLE, "-d", doc, "--unsupported", "decline", "--temperature", "1",
            "--seed", "3", "--max-tokens", "8", endpoint=daemon.endpoint)
    assert r.returncode == 0, r.stderr
    assert "declined: the documents do not say (the detector flagged the model's answer)" \
        in r.stdout and "\nattempt: " in r.stdout, r.stdout
    r = cli("ask", ANSWERABLE, "-d", doc, "--unsupported", "decline", "--stream",
            "--temperature", "1", "--seed", "3", "--max-tokens", "8", endpoint=daemon.endpoint)
    assert "attempt: the streamed text above, replaced by: " + DEFAULT_TEXT in r.stdout, r.stdout
    r = cli("ask", ANSWERABLE, "-d", doc, endpoint=daemon.endpoint)   # mark: no decline line
    assert r.returncode == 0 and "declined" not in r.stdout, r.stdout
    r = cli("ask", ANSWERABLE, "-d", doc, "--unsupported", "never", endpoint=daemon.endpoint)
    assert r.returncode == 2 and "--unsupported wants answer, mark or decline" in r.stderr


def test_python_client_reads_the_decline(daemon):
    import sys
    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "clients" / "python"))
    import diffrag
    with diffrag.Client(daemon.endpoint) as c:
        a = c.query(UNMATCHED, docs=DOCS, unsupported="decline")
        assert a.declined is True and a.decline_reason == "no_match", a
        assert a.answer == DEFAULT_TEXT and a.attempt is None and a.usage.prompt_tokens == 0
        a = c.query(ANSWERABLE, docs=DOCS, unsupported="decline", temperature=1.0, seed=3,
                    max_tokens=8)
        assert a.declined and a.decline_reason == "flagged" and a.attempt, a
        parts = list(c.stream(ANSWERABLE, docs=DOCS, unsupported="decline", temperature=1.0,
                              seed=3, max_tokens=8))
        final = parts[-1]
        assert final.declined and final.attempt == "".join(p.text for p in parts[:-1])
        a = c.query(ANSWERABLE, docs=DOCS)
        assert a.declined is False and a.decline_reason is None and a.attempt is None
        with pytest.raises(diffrag.BadRequest):
            c.query(ANSWERABLE, docs=DOCS, unsupported="sometimes")


def test_sighup_reloads_the_policy(tmp_path, model):
    import signal
    import time
    conf = tmp_path / "diffragd.conf"
    conf.write_text("unsupported = mark\n")
    d = Daemon(tmp_path, model, workers=1, grounding_calibration="none")
    d.argv[d.argv.index("/dev/null")] = str(conf)
    with d:
        _, r = ask(d, UNMATCHED)
        assert r["declined"] is False, r
        conf.write_text("unsupported = decline\ndecline_text = Not in the documents.\n")
        d.send_signal(signal.SIGHUP)
        for _ in range(200):
            if "configuration reloaded" in d.log_text():
                break
            time.sleep(0.05)
        assert 'changed="unsupported,decline_text"' in d.log_text(), d.log_text()[-2000:]
        _, r = ask(d, UNMATCHED)
        assert r["answer"] == "Not in the documents." and r["decline_reason"] == "no_match", r


def test_a_model_refusal_is_declined(tmp_path, model):
    """The model's own refusal counts as a decline (reason model_refused): a worker that joins
    over TCP (here one that answers every job with the prompt's refusal, as a model that
    refuses would) is asked through the real broker; the reply is decline_text with the
    refusal kept as the attempt, and the outcome counters say model_refused."""
    import struct

    import msgpack
    import zmq

    from daemon_util import free_port
    wport = free_port()
    d = Daemon(tmp_path, model, workers=0, worker_listen="tcp://127.0.0.1:%d" % wport,
               unsupported="decline")
    ctx = zmq.Context()
    w = ctx.socket(zmq.DEALER)
    try:
        d.start(wait_ready=False)
        w.connect("tcp://127.0.0.1:%d" % wport)
        w.send_multipart([b"\x01", msgpack.packb({"v": 1, "model": "refuser", "vocab": 512,
                                                  "n_ctx": 8192, "kv_bytes": 1 << 20,
                                                  "threads": 1, "max_running": 1})])
        d.wait_ready()
        refusal = "I cannot find the answer in the provided documents."
        c = d.client()
        c.send(query(ANSWERABLE, DOCS, max_tokens=12, id="r1"))
        job = None
        while job is None:
            assert w.poll(30000), "no job reached the worker"
            frames = w.recv_multipart()
            if frames[0] == b"\x03":
                job = frames[1][:8]
        n = 3
        f32 = lambda v: struct.pack("<%df" % n, *([v] * n))   # noqa: E731
        ends = [10, 30, len(refusal)]
        sig = {"n": n, "logprob": f32(-0.1), "entropy": f32(0.5), "margin": f32(0.8),
               "doc_mass": f32(0.2), "gen_mass": f32(0.1), "diff_doc_mass": f32(0.2),
               "lookback": f32(0.6), "text_end": struct.pack("<3I", *ends)}
        before = d.metric("diffrag_declined_answers_total", reason="model_refused")
        w.send_multipart([b"\x05", job + msgpack.packb({
            "finish": "stop", "text": refusal, "prompt_tokens": 40, "completion_tokens": n + 1,
            "cached_tokens": 0, "prefill_ms": 1.0, "ttft_ms": 1.0, "decode_ms": 1.0,
            "signals": sig})])
        r = c.recv(timeout=30)
        assert r["ok"], r
        assert r["declined"] and r["decline_reason"] == "model_refused", r
        assert r["answer"] == DEFAULT_TEXT and r["attempt"] == refusal, r
        assert r["grounding"]["abstained"] is True
        after = d.metric("diffrag_declined_answers_total", reason="model_refused")
        assert after == before + 1, (before, after)
        assert d.metric("diffrag_answers_total", outcome="declined") >= 1
    finally:
        w.close(0)
        ctx.term()
        d.__exit__(None, None, None)
