"""diffragd's groundedness figures end to end (docs/groundedness.md): the `grounding` field of
every query reply and its `token_signals` arrays; a calibration written here for a tiny random
model gives the score that tools/grounding_features.py recomputes from those arrays; the
metrics move by what the replies say and pass `promtool check metrics`; a calibration for
another model leaves the detector off, a malformed one stops the daemon from starting,
`grounding_calibration = auto` finds the right file; a remote worker returns the same
figures; and the default model's signals look like what they measure."""
import hashlib
import math
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from daemon_util import DIFFRAGD, Daemon, free_port, gen_model, query

sys.path.insert(0, str(ROOT / "tools"))
import grounding_features as gf  # noqa: E402

GROUNDING_KEYS = {"score", "flagged", "abstained", "lookback_ratio", "unsupported_token_ratio",
                  "mean_logprob", "min_logprob", "self_check", "context_reliance",
                  "hidden_probe", "quote_removed", "answer_tokens", "flagged_tokens", "detector"}
SIGNAL_KEYS = {"text", "logprob", "entropy", "margin", "doc_mass", "gen_mass", "diff_doc_mass",
               "lookback", "unsupported"}
DOCS = [{"id": "rhine", "title": "Rhine",
         "text": "The Rhine flows 1,230 km from the Swiss Alps to the North Sea. Cologne and "
                 "Basel lie on its banks."},
        {"id": "paris", "text": "Paris is the capital of France; the Seine crosses it."}]
QUESTIONS = ["How long is the Rhine?", "Which river crosses Paris?", "Where does the Rhine end?",
             "What is the capital of France?", "Which cities lie on the Rhine?"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random llama (2 layers of 4 heads) whose output layer is not the embedding, so
    that it writes varied text rather than one token over and over."""
    return gen_model(tmp_path_factory.mktemp("models") / "tiny-untied.gguf", "--seed", 7,
                     "--untied")


DOC_WORDS = {w for d in DOCS for w in re.findall(r"[a-z0-9]+", d["text"].lower())}
checked_words = []


def check_lexical(answer, texts, unsupported):
    """Where Python can tell without the Unicode tables and the stop-word list: a token of
    separators alone is never unsupported, and the tokens of an ASCII word that has a digit or
    starts with a capital (a content word) and is in no document are."""
    raw = answer.encode()
    ends = []
    for t in texts:
        ends.append((ends[-1] if ends else 0) + len(t.encode()))
    for t, u in zip(texts, unsupported):
        if not any(ch.isalnum() or ch in "'\u2019" for ch in t):
            assert not u, (t, texts)
    for m in re.finditer(rb"[A-Za-z0-9]+", raw):
        a, b = m.span()
        before, after = raw[a - 1:a], raw[b:b + 1]
        if (before and (before >= b"\x80" or before == b"'")) or \
                (after and (after >= b"\x80" or after == b"'")):
            continue   # may continue into a non-ASCII letter or an apostrophe
        w = m.group().decode()
        if not (w[0].isupper() or any(ch.isdigit() for ch in w)) or w.lower() in DOC_WORDS:
            continue
        toks = [i for i in range(len(texts)) if (ends[i - 1] if i else 0) < b and ends[i] > a]
        assert toks and all(unsupported[i] for i in toks), (w, [texts[i] for i in toks])
        checked_words.append(w)


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def write_calibration(path, model_sha, name="tiny-test", threshold=0.5, watch="0:0 1:1 1:3"):
    """Weights that make the score depend on every feature, with window 4 and stride 2 so a
    24-token answer has many windows."""
    path.write_text(
        "diffrag-grounding 1\n"
        "# written by tests/test_daemon_grounding.py\n"
        "name %s\n"
        "model_sha256 %s\n"
        "window 4\nstride 2\nthreshold %s\nwatch %s\n"
        "features unsupported_ratio mean_logprob min_logprob mean_entropy mean_margin lookback "
        "diff_doc_mass self_check context_reliance\n"
        "mean 0.3 -5 -7 5 0.05 0.4 0.1 0.2 0.5\n"
        "scale 0.4 1.5 2 1 0.05 0.2 0.1 0.3 2\n"
        "weights 0.7 -0.9 -0.4 0.8 -0.3 -1.1 -0.6 -0.5 -0.4\n"
        "bias -0.2\n" % (name, model_sha, threshold, watch))
    return path


def refused_start(tmp_path, model, **kw):
    """A daemon that must refuse to start: it exits non-zero; its log."""
    d = Daemon(tmp_path, model, workers=1, **kw)
    d.start(wait_ready=False)
    try:
        assert d.proc.wait(30) != 0
    finally:
        d.stop()
    return d.log_text()


def ask(client, question, **kw):
    """A sampled answer (reproducible by its seed) with token_signals."""
    kw.setdefault("temperature", 1.0)
    kw.setdefault("seed", 1)
    kw.setdefault("include", ["token_signals"])
    docs = kw.pop("docs", DOCS)
    _, r = client.call(query(question, docs, max_tokens=kw.pop("max_tokens", 24), **kw),
                       timeout=60)
    assert r["ok"], r
    return r


def check_shape(r):
    """The reply's grounding field and token_signals are present, typed and consistent."""
    g, ts = r["grounding"], r["token_signals"]
    assert set(g) == GROUNDING_KEYS, g
    n = g["answer_tokens"]
    assert isinstance(n, int) and n >= 1
    # the turn-ending control token is generated but is not an answer token
    assert n in (r["usage"]["completion_tokens"], r["usage"]["completion_tokens"] - 1), (n, r["usage"])
    assert isinstance(g["abstained"], bool) and isinstance(g["flagged_tokens"], int)
    assert isinstance(g["detector"], str)
    for k in ("lookback_ratio", "unsupported_token_ratio", "mean_logprob", "min_logprob"):
        assert isinstance(g[k], float), (k, g[k])
    # P(yes) of the self-check's verdict when it ran (grounding_self_check = 1), else nil
    assert g["self_check"] is None or 0 < g["self_check"] < 1, g["self_check"]
    # context reliance when measured (grounding_reliance = 1): a finite difference of means
    assert g["context_reliance"] is None or math.isfinite(g["context_reliance"]), g
    assert SIGNAL_KEYS <= set(ts) and set(ts) <= SIGNAL_KEYS | {"score"}, set(ts)
    assert all(len(ts[k]) == n for k in ts), {k: len(v) for k, v in ts.items()}
    assert "".join(ts["text"]) == r["answer"]
    assert all(isinstance(u, bool) for u in ts["unsupported"])
    for i in range(n):
        assert ts["logprob"][i] <= 1e-6 and ts["entropy"][i] >= -1e-6
        assert -1e-6 <= ts["margin"][i] <= 1 + 1e-6
        assert -1e-6 <= ts["doc_mass"][i] and -1e-6 <= ts["gen_mass"][i]
        assert ts["doc_mass"][i] + ts["gen_mass"][i] <= 1 + 1e-5
        assert -1e-6 <= ts["lookback"][i] <= 1 + 1e-6
        # plain GQA heads: the differential mass is the mass
        assert abs(ts["diff_doc_mass"][i] - ts["doc_mass"][i]) < 1e-6
    # the first token is chosen at the last prompt position: nothing generated to attend to
    assert ts["gen_mass"][0] == 0 and abs(ts["lookback"][0] - 1) < 1e-6
    if n > 1:
        assert ts["gen_mass"][1] > 0
    assert max(ts["doc_mass"]) > 0
    # the request figures from the token arrays (docs/groundedness.md)
    doc, gen = sum(ts["doc_mass"]), sum(ts["gen_mass"])
    assert math.isclose(g["lookback_ratio"], doc / (doc + gen) if doc + gen else 0, abs_tol=1e-6)
    assert math.isclose(g["unsupported_token_ratio"], sum(ts["unsupported"]) / n, abs_tol=1e-12)
    assert math.isclose(g["mean_logprob"], sum(ts["logprob"]) / n, abs_tol=1e-6)
    assert g["min_logprob"] == min(ts["logprob"])
    check_lexical(r["answer"], ts["text"], ts["unsupported"])
    return g, ts


def flagged_union(windows, scores, threshold):
    covered = set()
    for (a, b), s in zip(windows, scores):
        if s >= threshold:
            covered.update(range(a, b))
    return len(covered)


def test_signals_without_a_detector(tmp_path, model):
    with Daemon(tmp_path, model, workers=1, grounding_calibration="none",
                grounding_self_check=1, grounding_reliance=1) as d:
        c = d.client()
        r = ask(c, QUESTIONS[0], temperature=1, seed=2)
        g, ts = check_shape(r)
        assert g["score"] is None and g["flagged"] is None and g["detector"] == "none"
        assert g["flagged_tokens"] == 0 and "score" not in ts
        print("answer:", repr(r["answer"]), "grounding:", g)
        # the figures are in the request's log line
        line = [l for l in d.log_text().splitlines() if "op=query" in l][-1]
        for needle in ("detector=none", "score=-", "flagged=-", "answer_tokens=%d" % g["answer_tokens"],
                       "lookback_ratio=%.4f" % g["lookback_ratio"]):
            assert needle in line, (needle, line)
        # without include, no token_signals
        _, r2 = c.call(query(QUESTIONS[0], DOCS, max_tokens=24, temperature=1, seed=2), timeout=60)
        assert r2["ok"] and "token_signals" not in r2 and r2["grounding"] == g
        # include is checked
        for bad in (["nope"], "token_signals", [1], ["token_signals"] * 9):
            _, e = c.call(query(QUESTIONS[0], DOCS, max_tokens=2, include=bad), timeout=30)
            assert not e["ok"] and e["error"]["code"] == "bad_request", (bad, e)
            assert "include" in e["error"]["message"], e
        _, r3 = c.call(query(QUESTIONS[0], DOCS, max_tokens=24, include=[]), timeout=60)
        assert r3["ok"] and "token_signals" not in r3
        # streaming: the same figures; the deltas make the answer and the token texts
        deltas, r4 = c.call(query(QUESTIONS[0], DOCS, max_tokens=24, stream=True, temperature=1,
                                  seed=2, include=["token_signals"]), timeout=60)
        assert "".join(x["delta"] for x in deltas) == r4["answer"] == "".join(r4["token_signals"]["text"])
        assert r4["grounding"] == g
        # a stop string inside the answer: the tokens still cover exactly the answer
        stop = r["answer"][len(r["answer"]) // 2:][:3]
        assert stop.strip(), r["answer"]
        r5 = ask(c, QUESTIONS[0], stop=[stop], seed=2)
        assert r5["finish_reason"] == "stop" and len(r5["answer"]) < len(r["answer"])
        assert "".join(r5["token_signals"]["text"]) == r5["answer"]
        assert len(r5["token_signals"]["logprob"]) == r5["grounding"]["answer_tokens"]
        assert d.metric("diffrag_grounding_checked_requests_total") == 0
        assert 'calibration="none",threshold="none"} 1' in d.metrics()


def test_calibrated_score_matches_numpy_and_metrics_move(tmp_path, model):
    cal_path = write_calibration(tmp_path / "tiny.grounding", sha256(model))
    cal = gf.read_calibration(str(cal_path))
    with Daemon(tmp_path, model, workers=2, grounding_calibration=cal_path,
                grounding_self_check=1, grounding_reliance=1) as d:
        c = d.client()
        names = ("diffrag_grounding_checked_requests_total",
                 "diffrag_hallucination_flagged_requests_total", "diffrag_abstained_requests_total",
                 "diffrag_answer_tokens_total", "diffrag_hallucination_flagged_tokens_total",
                 "diffrag_hallucination_score_count", "diffrag_lookback_ratio_count",
                 "diffrag_unsupported_token_ratio_count")
        before = {k: d.metric(k) for k in names}
        replies = []
        max_diff = 0.0
        for i, q in enumerate(QUESTIONS):
            r = ask(c, q, temperature=0.9 if i % 2 else 0, seed=i)
            g, ts = check_shape(r)
            assert g["detector"] == "tiny-test" and isinstance(g["score"], float)
            assert isinstance(g["self_check"], float), g
            assert isinstance(g["context_reliance"], float), g
            score, wscores = gf.score(cal, dict(ts, self_check=g["self_check"],
                                                context_reliance=g["context_reliance"]))
            wins = gf.windows(g["answer_tokens"], cal["window"], cal["stride"])
            max_diff = max(max_diff, abs(score - g["score"]))
            assert abs(score - g["score"]) < 1e-5, (score, g["score"])
            # each token's score is the highest of the windows that contain it
            for t in range(g["answer_tokens"]):
                want = max(s for (a, b), s in zip(wins, wscores) if a <= t < b)
                assert abs(ts["score"][t] - want) < 1e-5, (t, ts["score"][t], want)
            assert g["flagged"] == (g["score"] >= cal["threshold"] and not g["abstained"])
            assert g["flagged_tokens"] == (flagged_union(wins, wscores, cal["threshold"])
                                           if g["flagged"] else 0)
            replies.append(g)
        print("max |score - NumPy score| = %.3g over %d answers" % (max_diff, len(replies)))
        print("scores:", [round(g["score"], 4) for g in replies])
        print("content words checked for lexical support:", checked_words)
        assert checked_words, "no answer had a word the lexical check could judge"
        assert len({round(g["score"], 6) for g in replies}) > 1, "the scores should differ"
        after = {k: d.metric(k) for k in names}
        moved = {k: after[k] - before[k] for k in names}
        n = len(replies)
        assert moved["diffrag_grounding_checked_requests_total"] == n
        assert moved["diffrag_hallucination_score_count"] == n
        assert moved["diffrag_lookback_ratio_count"] == n
        assert moved["diffrag_unsupported_token_ratio_count"] == n
        assert moved["diffrag_hallucination_flagged_requests_total"] == sum(g["flagged"] for g in replies)
        assert moved["diffrag_abstained_requests_total"] == sum(g["abstained"] for g in replies)
        assert moved["diffrag_answer_tokens_total"] == sum(g["answer_tokens"] for g in replies)
        assert moved["diffrag_hallucination_flagged_tokens_total"] == sum(g["flagged_tokens"] for g in replies)
        assert d.metric("diffrag_hallucination_score_sum") == pytest.approx(
            sum(g["score"] for g in replies), abs=1e-6)
        text = d.metrics()
        assert 'diffrag_hallucination_detector_info{model="tiny-untied",calibration="tiny-test",' \
               'threshold="0.5"} 1' in text, [l for l in text.splitlines() if "detector_info" in l]
        promtool = shutil.which("promtool")
        assert promtool, "promtool (Debian package prometheus) is required"
        p = subprocess.run([promtool, "check", "metrics"], input=text, text=True,
                           capture_output=True)
        print("promtool:", p.returncode, p.stdout.strip(), p.stderr.strip())
        assert p.returncode == 0, p.stdout + p.stderr
        assert "detector=tiny-test score=%.4f" % replies[-1]["score"] in d.log_text()


def test_hidden_state_probe_scores_as_numpy(tmp_path, model):
    """grounding_hidden_layers: replies that include hidden_states carry the residual stream of
    those layers (the first answer token's row, the answer's mean and the last row); a
    calibration with a probe adds its layer, and the reply's hidden_probe and score are what
    NumPy computes from those rows and the token signals, for probes of two rows and of three,
    and for the probes a calibration keeps for long and for short prompts."""
    with Daemon(tmp_path, model, workers=1, grounding_calibration="none") as d:
        r = ask(d.client(), QUESTIONS[0], include=["token_signals", "hidden_states"])
        assert r["hidden_states"] is None and r["grounding"]["hidden_probe"] is None
    with Daemon(tmp_path, model, workers=1, grounding_calibration="none",
                grounding_hidden_layers="2,0") as d:
        r = ask(d.client(), QUESTIONS[0], include=["token_signals", "hidden_states"])
        h = r["hidden_states"]
        assert h["layers"] == [2, 0] and len(h["first"]) == len(h["mean"]) == len(h["last"]) == 2
        dim = len(h["first"][0])
        rows = h["first"] + h["mean"] + h["last"]
        assert dim >= 8 and all(len(row) == dim for row in rows)
        assert r["grounding"]["answer_tokens"] > 1 and h["mean"][0] != h["first"][0]
        assert h["last"][0] not in (h["first"][0], h["mean"][0])
        assert all(math.isfinite(v) for row in rows for v in row)
        # answers cut at 1 and 2 tokens: the last row is the one that gave the last answer
        # token (no end-of-turn token came), so one token's rows are all the same, and two
        # tokens' mean is halfway between the first and the last
        for n in (1, 2):
            for seed in range(20):
                r = ask(d.client(), QUESTIONS[1], max_tokens=n, seed=seed,
                        include=["token_signals", "hidden_states"])
                if r["finish_reason"] == "length" and r["grounding"]["answer_tokens"] == n:
                    break
            else:
                pytest.fail("no answer of %d tokens cut at the limit in 20 seeds" % n)
            h = r["hidden_states"]
            for i in range(2):
                f, m, last = (np.asarray(h[k][i], np.float64) for k in ("first", "mean", "last"))
                want = f if n == 1 else (f + last) / 2
                assert np.allclose(m, want, rtol=1e-5, atol=1e-5), (n, i)
                assert n == 1 and np.array_equal(last, f) or n == 2 and not np.array_equal(last, f)
    rng = __import__("random").Random(5)
    probe = " ".join("%.6f" % rng.uniform(-0.05, 0.05) for _ in range(2 * dim))
    cal_path = write_calibration(tmp_path / "probe.grounding", sha256(model))
    text = cal_path.read_text().replace(
        "context_reliance\n", "context_reliance hidden_probe\n").replace(
        "0.2 0.5\n", "0.2 0.5 0.1\n").replace("0.3 2\n", "0.3 2 0.7\n").replace(
        "-0.5 -0.4\n", "-0.5 -0.4 1.3\n")
    cal_path.write_text(text + "probe_layer 1\nprobe_weights %s\nprobe_bias -0.3\n" % probe)
    cal = gf.read_calibration(str(cal_path))
    assert "hidden_probe" in cal["features"] and cal["probe_layer"] == 1
    with Daemon(tmp_path, model, workers=1, grounding_calibration=cal_path,
                grounding_hidden_layers="2") as d:
        probes, lengths = [], []
        for i, q in enumerate(QUESTIONS[:3]):
            r = ask(d.client(), q, seed=i, include=["token_signals", "hidden_states"])
            g, ts = check_shape(r)
            lengths.append(r["usage"]["context_tokens"])
            h = r["hidden_states"]
            assert h["layers"] == [2, 1], h["layers"]   # the probe's layer joins the listed ones
            z = gf.probe_logit(cal, h)
            assert abs(g["hidden_probe"] - 1 / (1 + math.exp(-z))) < 1e-5, (g["hidden_probe"], z)
            score, _ = gf.score(cal, dict(ts, hidden_probe=z))
            assert abs(score - g["score"]) < 1e-5, (score, g["score"])
            probes.append(g["hidden_probe"])
        assert len({round(p, 6) for p in probes}) > 1, probes
        print("hidden_probe:", [round(p, 4) for p in probes])
        lengths.append(ask(d.client(), QUESTIONS[0], docs=DOCS[:1])["usage"]["context_tokens"])
    # weights of three rows weigh the last row too
    probe3 = probe + " " + " ".join("%.6f" % rng.uniform(-0.05, 0.05) for _ in range(dim))
    cal_path.write_text(text + "probe_layer 2\nprobe_weights %s\nprobe_bias 0.2\n" % probe3)
    cal3 = gf.read_calibration(str(cal_path))
    with Daemon(tmp_path, model, workers=1, grounding_calibration=cal_path) as d:
        for i, q in enumerate(QUESTIONS[:2]):
            r = ask(d.client(), q, seed=i, include=["token_signals", "hidden_states"])
            g, ts = check_shape(r)
            z = gf.probe_logit(cal3, r["hidden_states"])
            two = gf.probe_logit(dict(cal3, probe_weights=cal3["probe_weights"][:2 * dim]),
                                 r["hidden_states"])
            assert abs(g["hidden_probe"] - 1 / (1 + math.exp(-z))) < 1e-5, (g["hidden_probe"], z)
            assert abs(z - two) > 1e-6, (z, two)   # the last row's weights count
    # a long probe takes the probe's place from its documents' tokens on, a short probe under
    # its own: here both at both documents' length, so a question over the first alone reads
    # the short probe and one over both the long probe
    assert lengths[-1] < lengths[0] == lengths[1], lengths
    long_probe = " ".join("%.6f" % rng.uniform(-0.05, 0.05) for _ in range(2 * dim))
    short_probe = " ".join("%.6f" % rng.uniform(-0.05, 0.05) for _ in range(2 * dim))
    cal_path.write_text(text + "probe_layer 1\nprobe_weights %s\nprobe_bias -0.3\n"
                        "long_probe_from %d\nlong_probe_weights %s\nlong_probe_bias 0.4\n"
                        "short_probe_until %d\nshort_probe_weights %s\nshort_probe_bias -0.1\n" % (
                            probe, max(lengths), long_probe, max(lengths), short_probe))
    cal_ranged = gf.read_calibration(str(cal_path))
    with Daemon(tmp_path, model, workers=1, grounding_calibration=cal_path,
                grounding_hidden_layers="2") as d:
        for i, docs in enumerate((DOCS[:1], DOCS, DOCS[:1], DOCS)):
            r = ask(d.client(), QUESTIONS[i], docs=docs, seed=i,
                    include=["token_signals", "hidden_states"])
            g, ts = check_shape(r)
            n = r["usage"]["context_tokens"]
            assert n == lengths[-1 if len(docs) == 1 else 0], (n, lengths)
            z = gf.probe_logit(cal_ranged, r["hidden_states"], n)
            assert abs(g["hidden_probe"] - 1 / (1 + math.exp(-z))) < 1e-5, (g["hidden_probe"], z)
            for keys in (gf.LONG_PROBE_KEYS, gf.SHORT_PROBE_KEYS):
                alone = {k: v for k, v in cal_ranged.items()
                         if k not in gf.LONG_PROBE_KEYS + gf.SHORT_PROBE_KEYS}
                alone.update(probe_weights=cal_ranged[keys[1]], probe_bias=cal_ranged[keys[2]])
                read = (n >= max(lengths)) == (keys == gf.LONG_PROBE_KEYS)
                assert (abs(z - gf.probe_logit(alone, r["hidden_states"])) < 1e-9) == read, \
                    (n, keys)
            assert abs(z - gf.probe_logit(cal, r["hidden_states"])) > 1e-6, (n, z)
    # a probe whose weights do not fit the model stops the start
    cal_path.write_text(text + "probe_layer 1\nprobe_weights 1 2\nprobe_bias 0\n")
    log = refused_start(tmp_path, model, grounding_calibration=cal_path)
    assert "probe does not fit the model" in log, log[-2000:]
    # and layers that are not numbers, or that the model (2 layers) does not have
    for value, rc, why in (("1,x", 2, "\"x\" is not a layer number"),
                           ("1,3", 1, "layer 3 is outside")):
        p = subprocess.run([str(DIFFRAGD), "--config", "/dev/null", "--model", str(model),
                            "--grounding-hidden-layers", value, "--check-config"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == rc and "grounding_hidden_layers: " + why in p.stderr, p.stderr


def test_self_check_leaves_the_answer_as_it_was(tmp_path, model):
    """`grounding_self_check = 0` and `grounding_reliance = 0` (the defaults): no verdict and no
    reliance (nil), and the same answers and token signals as with both on, which run after
    the answer; a score without them is the score with those features at their means (they add
    nothing). A query whose prompt holds no document has no reliance to measure."""
    cal_path = write_calibration(tmp_path / "tiny.grounding", sha256(model))
    cal = gf.read_calibration(str(cal_path))
    with Daemon(tmp_path, model, workers=1, grounding_calibration=cal_path,
                grounding_self_check=1, grounding_reliance=1) as d:
        on = [ask(d.client(), q, seed=i) for i, q in enumerate(QUESTIONS[:3])]
    with Daemon(tmp_path, model, workers=1, grounding_calibration=cal_path) as d:
        off = [ask(d.client(), q, seed=i) for i, q in enumerate(QUESTIONS[:3])]
    for a, b in zip(on, off):
        assert a["answer"] == b["answer"] and a["token_signals"].keys() == b["token_signals"].keys()
        for k in a["token_signals"]:
            if k != "score":
                assert a["token_signals"][k] == b["token_signals"][k], k
        assert isinstance(a["grounding"]["self_check"], float)
        assert isinstance(a["grounding"]["context_reliance"], float)
        assert b["grounding"]["self_check"] is None and b["grounding"]["context_reliance"] is None
        assert abs(b["grounding"]["score"] - gf.score(cal, b["token_signals"])[0]) < 1e-5
        at_mean = 1 / (1 + math.exp(-cal["mean"][cal["features"].index("self_check")]))
        rel_mean = cal["mean"][cal["features"].index("context_reliance")]
        assert abs(b["grounding"]["score"] -
                   gf.score(cal, dict(b["token_signals"], self_check=at_mean,
                                      context_reliance=rel_mean))[0]) < 1e-5
    with Daemon(tmp_path, model, workers=1, grounding_calibration=cal_path,
                grounding_self_check=1, grounding_reliance=1) as d:
        # no chunk shares a word with this question: nothing placed, no reliance
        _, r = d.client().call(query("Zyx?", DOCS, top_k=1, max_tokens=8,
                                     include=["token_signals"]), timeout=60)
        assert r["ok"] and not r["citations"], r
        assert r["grounding"]["context_reliance"] is None, r["grounding"]


def test_length_offset_moves_the_score_with_the_documents_tokens(tmp_path, model):
    """A calibration with length_tokens/length_offset: the daemon's score is NumPy's with the
    offset read at the reply's usage.context_tokens, over documents of different lengths, and
    it differs from the score without the offset by exactly that offset in every window."""
    cal_path = write_calibration(tmp_path / "len.grounding", sha256(model), name="tiny-len")
    cal_path.write_text(cal_path.read_text() + "length_tokens 100 1000\nlength_offset 1.5 -2\n")
    cal = gf.read_calibration(str(cal_path))
    plain = {k: v for k, v in cal.items() if k not in gf.LENGTH_KEYS}
    paris = DOCS[1]["text"]   # words the lexical check knows
    with Daemon(tmp_path, model, workers=1, grounding_calibration=cal_path) as d:
        c = d.client()
        seen = set()
        for i, extra in enumerate(("", " ".join([paris] * 10), " ".join([paris] * 60))):
            docs = [dict(DOCS[0], text=DOCS[0]["text"] + " " + extra)]
            r = ask(c, QUESTIONS[0], docs=docs, seed=i)
            g, ts = check_shape(r)
            tokens = r["usage"]["context_tokens"]
            seen.add(tokens)
            sig = dict(ts, context_tokens=tokens)
            want, wscores = gf.score(cal, sig)
            assert abs(g["score"] - want) < 1e-5, (tokens, g["score"], want)
            off = float(gf.length_offset(cal, math.log1p(tokens)))
            for a, b in zip(wscores, gf.score(plain, sig)[1]):
                a, b = min(max(a, 1e-12), 1 - 1e-12), min(max(b, 1e-12), 1 - 1e-12)
                assert abs(math.log(a / (1 - a)) - math.log(b / (1 - b)) - off) < 1e-6
        assert len(seen) == 3 and min(seen) < 100 < sorted(seen)[1] < 1000 < max(seen), seen


def test_threshold_override_flags_every_scored_answer(tmp_path, model):
    cal_path = write_calibration(tmp_path / "tiny.grounding", sha256(model), threshold=0.99)
    with Daemon(tmp_path, model, workers=1, grounding_calibration=cal_path,
                grounding_threshold="0") as d:
        c = d.client()
        g, _ = check_shape(ask(c, QUESTIONS[1]))
        assert g["flagged"] is True and g["flagged_tokens"] == g["answer_tokens"], g
        assert d.metric("diffrag_hallucination_flagged_requests_total") == 1
        assert 'calibration="tiny-test",threshold="0"} 1' in d.metrics()


def test_calibration_for_another_model_is_not_used(tmp_path, model):
    cal_path = write_calibration(tmp_path / "other.grounding", "ab" * 32)
    with Daemon(tmp_path, model, workers=1, grounding_calibration=cal_path) as d:
        g, ts = check_shape(ask(d.client(), QUESTIONS[2]))
        assert g["detector"] == "none" and g["score"] is None and g["flagged"] is None
        assert "score" not in ts
        log = d.log_text()
        assert "grounding calibration is for another model" in log and "ab" * 32 in log, log[-2000:]
        assert sha256(model) in log
        assert 'calibration="none"' in d.metrics()
        assert d.metric("diffrag_grounding_checked_requests_total") == 0


def test_malformed_calibration_stops_the_start(tmp_path, model):
    cal_path = write_calibration(tmp_path / "bad.grounding", sha256(model))
    lines = cal_path.read_text().splitlines()
    lines[4] = "window 0"
    cal_path.write_text("\n".join(lines) + "\n")
    log = refused_start(tmp_path, model, grounding_calibration=cal_path)
    assert "bad.grounding:5: window must be an integer from 1" in log, log[-2000:]
    p = subprocess.run([str(DIFFRAGD), "--config", "/dev/null", "--model", str(model),
                        "--grounding-calibration", str(cal_path), "--check-config"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "bad.grounding:5:" in p.stderr, (p.returncode, p.stderr)
    # a watched head outside the model (2 layers of 4 heads) is refused as well
    write_calibration(cal_path, sha256(model), watch="0:0 2:1")
    log = refused_start(tmp_path, model, grounding_calibration=cal_path)
    assert "watched head outside the model" in log and "head=2:1" in log
    # and a grounding_heads setting that is not LAYER:HEAD pairs
    p = subprocess.run([str(DIFFRAGD), "--config", "/dev/null", "--model", str(model),
                        "--grounding-heads", "1:1;2", "--check-config"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "grounding_heads" in p.stderr, p.stderr


def test_auto_finds_the_calibration_of_the_model(tmp_path, model, monkeypatch):
    d_dir = tmp_path / "deploy" / "grounding"
    d_dir.mkdir(parents=True)
    (d_dir / "a-broken.grounding").write_text("diffrag-grounding 1\nname x\n")
    write_calibration(d_dir / "b-other.grounding", "cd" * 32, name="other-model")
    write_calibration(d_dir / "c-tiny.grounding", sha256(model), name="tiny-auto")
    (d_dir / "d-ignored.txt").write_text("not a calibration")
    monkeypatch.chdir(tmp_path)
    with Daemon(tmp_path, model, workers=1) as d:     # grounding_calibration = auto
        g, _ = check_shape(ask(d.client(), QUESTIONS[3]))
        assert g["detector"] == "tiny-auto" and isinstance(g["score"], float), g
        log = d.log_text()
        assert "grounding calibration skipped" in log and "a-broken.grounding" in log
        assert "c-tiny.grounding" in log


def test_auto_looks_beside_the_executable(tmp_path, model, monkeypatch):
    """A diffragd run from another directory finds the calibration of the source tree its
    build directory lies in (build/diffragd and build/asan/diffragd), and when it finds none
    the log says where it looked."""
    tree = tmp_path / "tree"
    d_dir = tree / "deploy" / "grounding"
    d_dir.mkdir(parents=True)
    write_calibration(d_dir / "tiny.grounding", sha256(model), name="tiny-beside")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for sub in ("build", "build/asan"):
        exe = tree / sub / "diffragd"
        exe.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(DIFFRAGD, exe)
        d = Daemon(tmp_path, model, workers=1)
        d.argv[0] = str(exe)
        with d:
            g, _ = check_shape(ask(d.client(), QUESTIONS[3]))
            assert g["detector"] == "tiny-beside" and isinstance(g["score"], float), (sub, g)
            assert str(d_dir / "tiny.grounding") in d.log_text()
    (d_dir / "tiny.grounding").unlink()
    d = Daemon(tmp_path, model, workers=1)
    d.argv[0] = str(tree / "build" / "diffragd")
    with d:
        g, _ = check_shape(ask(d.client(), QUESTIONS[3]))
        assert g["detector"] == "none", g
        log = d.log_text()
        assert "no grounding calibration for this model" in log, log
        assert 'looked_in="deploy/grounding, %s' % d_dir in log, log


def test_remote_worker_returns_the_same_figures(tmp_path, model):
    cal_path = write_calibration(tmp_path / "tiny.grounding", sha256(model))
    with Daemon(tmp_path, model, workers=1, grounding_calibration=cal_path,
                grounding_self_check=1, grounding_reliance=1) as local:
        want = [ask(local.client(), q) for q in QUESTIONS[:2]]
    assert all(isinstance(w["grounding"]["self_check"], float) for w in want)
    wport = free_port()
    # the broker asks for the self-check in each job; the remote worker runs it
    d = Daemon(tmp_path, model, workers=0, worker_listen="tcp://127.0.0.1:%d" % wport,
               grounding_calibration=cal_path, grounding_self_check=1, grounding_reliance=1)
    log = open(tmp_path / "worker.log", "wb")
    worker = None
    try:
        d.start(wait_ready=False)
        worker = subprocess.Popen([str(DIFFRAGD), "--config", "/dev/null", "--worker", "--connect",
                                   "tcp://127.0.0.1:%d" % wport, "--model", str(model),
                                   "--workers", "1", "--threads", "1"],
                                  stdout=log, stderr=subprocess.STDOUT)
        d.wait_ready()
        for w in want:
            r = ask(d.client(), QUESTIONS[want.index(w)])
            check_shape(r)
            assert r["answer"] == w["answer"]
            for k in GROUNDING_KEYS:
                if isinstance(w["grounding"][k], float):
                    assert abs(r["grounding"][k] - w["grounding"][k]) < 1e-6, k
                else:
                    assert r["grounding"][k] == w["grounding"][k], k
            for k, arr in w["token_signals"].items():
                got = r["token_signals"][k]
                assert len(got) == len(arr)
                assert all(abs(a - b) < 1e-6 if isinstance(a, float) else a == b
                           for a, b in zip(got, arr)), k
        assert d.stop() == 0
    finally:
        if worker:
            worker.terminate()
            worker.wait(30)
        log.close()
        d.__exit__(None, None, None)


@pytest.mark.parametrize("setting,named", [({"grounding_heads": "0:0,7:1"}, "7:1"),
                                           ({"grounding_hidden_layers": "1,9"}, "layer 9")])
def test_remote_worker_reports_heads_it_does_not_have(tmp_path, model, setting, named):
    """A broker without the model cannot check grounding_heads or grounding_hidden_layers;
    the worker refuses the job with a message naming the head or layer, and the client gets
    an error reply, not silence."""
    wport = free_port()
    d = Daemon(tmp_path, model, workers=0, worker_listen="tcp://127.0.0.1:%d" % wport,
               grounding_calibration="none", **setting)
    log = open(tmp_path / "worker.log", "wb")
    worker = None
    try:
        d.start(wait_ready=False)
        worker = subprocess.Popen([str(DIFFRAGD), "--config", "/dev/null", "--worker", "--connect",
                                   "tcp://127.0.0.1:%d" % wport, "--model", str(model),
                                   "--workers", "1", "--threads", "1"],
                                  stdout=log, stderr=subprocess.STDOUT)
        d.wait_ready()
        _, r = d.client().call(query(QUESTIONS[0], DOCS, max_tokens=4), timeout=60)
        assert not r["ok"] and r["error"]["code"] == "internal", r
        assert named in r["error"]["message"], r
    finally:
        if worker:
            worker.terminate()
            worker.wait(30)
        log.close()
        d.__exit__(None, None, None)


def test_default_model_signals(tmp_path, default_model, monkeypatch):
    """The default model answers from a paragraph: its answer leans on the document; asked
    what the paragraph does not say, its refusal (if it gives one) is marked abstained. The
    calibration, if deploy/grounding/ has one for this model, is found by `auto`."""
    para = open(ROOT / "examples" / "sample-paragraph.txt").read()
    docs = [{"id": "p", "title": "Rhine", "text": para}]
    sha = sha256(default_model)
    matching = [p for p in (ROOT / "deploy" / "grounding").glob("*.grounding")
                if sha in p.read_text()] if (ROOT / "deploy" / "grounding").is_dir() else []
    monkeypatch.chdir(ROOT)     # where `auto` looks for deploy/grounding/
    with Daemon(tmp_path, default_model, workers=1, threads=2, max_context_tokens=2048,
                max_tokens=64) as d:
        c = d.client()
        _, r = c.call(query("How long is the Rhine?", docs, max_tokens=40,
                            include=["token_signals"]), timeout=300)
        assert r["ok"], r
        g, ts = check_shape(r)
        print("answer:", repr(r["answer"]), "grounding:", g)
        assert g["lookback_ratio"] > 0.05 and g["unsupported_token_ratio"] < 0.5, g
        if matching:
            assert g["detector"] != "none" and isinstance(g["score"], float), (matching, g)
        else:
            assert g["detector"] == "none", g
        _, r = c.call(query("What is the phone number of the mayor of Basel?", docs, max_tokens=40,
                            include=["token_signals"]), timeout=300)
        assert r["ok"], r
        g2, _ = check_shape(r)
        print("answer:", repr(r["answer"]), "grounding:", g2)
        refused = r["answer"].strip().lower().startswith(
            "i cannot find the answer in the provided documents")
        assert g2["abstained"] == refused
        if refused:
            assert not g2["flagged"]
