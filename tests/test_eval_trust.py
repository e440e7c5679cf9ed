"""tools/eval-trust.py's length offset (`--refit --lengths`), on answers made up here: per band,
the threshold that flags at most --max-fpr of the band's right answers, moved onto the
calibration's threshold by an offset at the band's median documents' tokens; the combination
and the probe unchanged; an offset already in the calibration is not fitted on top of; too few
right answers in a band is an error."""
import importlib.util
import math

import numpy as np
import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("eval_trust", ROOT / "tools" / "eval-trust.py")
et = importlib.util.module_from_spec(spec)
spec.loader.exec_module(et)
gf = et.gf

CAL = gf.parse_calibration("""diffrag-grounding 1
name made-up
model_sha256 %s
window 4
stride 2
threshold 0.6
watch 0:0
features mean_logprob mean_entropy
mean -1 1
scale 1 1
weights -1.2 0.8
bias 0.3
""" % ("ab" * 32))


def answers(rng, band, tokens, n_right, n_wrong, shift):
    """Answers of one band: right ones score lower than wrong ones, and every answer of the
    band scores higher by `shift` (as a calibration fitted at other lengths would)."""
    out = []
    for k in range(n_right + n_wrong):
        right = k < n_right
        n = int(rng.integers(3, 12))
        lp = rng.normal(-0.4 if right else -1.6, 0.5, n) - shift
        out.append({"id": "%d-%d" % (band, k), "band": band, "mode": "free",
                    "article": "article %d" % (k % 10),
                    "is_impossible": False, "right": right, "abstained": False,
                    "hallucinated": not right,
                    "context_tokens": int(tokens * rng.uniform(0.9, 1.1)),
                    "hidden_probe": None,
                    "token_signals": {"logprob": list(lp), "entropy": list(rng.uniform(0, 2, n)),
                                      "margin": [0.5] * n, "doc_mass": [0.3] * n,
                                      "gen_mass": [0.1] * n, "diff_doc_mass": [0.3] * n,
                                      "lookback": [0.7] * n, "unsupported": [False] * n}})
    return out


def flagged_right(cal, rs):
    right = [r for r in rs if r["right"]]
    return sum(gf.score(cal, et.signals_of(r))[0] >= cal["threshold"] for r in right) / len(right)


def test_length_offset_flags_the_same_share_of_right_answers_at_every_length():
    rng = np.random.default_rng(3)
    fit = (answers(rng, 2048, 1700, 60, 40, 0.0) + answers(rng, 8192, 7000, 60, 40, 1.0) +
           answers(rng, 16384, 14000, 60, 40, 2.0))
    base_share = [flagged_right(CAL, [r for r in fit if r["band"] == b]) for b in (2048, 8192, 16384)]
    assert base_share[2] > base_share[0] + 0.2, base_share   # the base flags more at length
    cal, info = et.fit_length_offsets(fit, CAL, 0.15)
    assert [b for b, *_ in info] == [2048, 8192, 16384]
    for band, tok, n, th, off in info:
        rs = [r for r in fit if r["band"] == band]
        assert tok == sorted(r["context_tokens"] for r in rs)[len(rs) // 2] and n == 60
        share = flagged_right(cal, rs)
        # at most 15% of the band's right answers, and the bound is used (not far under it)
        assert 0.10 <= share <= 0.15, (band, share)
        assert abs(off - (math.log(0.6 / 0.4) - math.log(th / (1 - th)))) < 1e-12
    # the offset falls with length here, since the base's scores rise with it
    assert info[0][4] > info[1][4] > info[2][4], info
    for k in ("features", "mean", "scale", "weights", "bias", "threshold", "window", "stride"):
        assert np.array_equal(np.asarray(cal[k], dtype=object), np.asarray(CAL[k], dtype=object)), k
    # fitted again from a calibration that has an offset: the same offset, not one on top of it
    again, _ = et.fit_length_offsets(fit, cal, 0.15)
    np.testing.assert_allclose(again["length_offset"], cal["length_offset"], atol=1e-12)
    np.testing.assert_array_equal(again["length_tokens"], cal["length_tokens"])
    # it makes a calibration the daemon's parser takes
    gf.parse_calibration(gf.format_calibration(cal))


def test_length_offset_needs_right_answers_in_every_band():
    rng = np.random.default_rng(4)
    fit = answers(rng, 2048, 1700, 30, 20, 0.0) + answers(rng, 16384, 14000, 4, 40, 0.0)
    with pytest.raises(et.ec.EvalError, match="band 16384 has 4 right answers"):
        et.fit_length_offsets(fit, CAL, 0.15)


def test_the_bound_is_chosen_by_cross_validation_over_articles():
    """--choose-fpr: the largest bound whose out-of-fold share of right answers flagged stays
    within the target in every band; the table it chose from holds every bound and band."""
    rng = np.random.default_rng(5)
    fit = answers(rng, 2048, 1700, 80, 40, 0.0) + answers(rng, 16384, 14000, 80, 40, 1.5)
    bound, table = et.choose_bound(fit, CAL, 0.2)
    assert sorted(table) == [0.05, 0.1, 0.15, 0.2]
    assert all(sorted(v) == [2048, 16384] for v in table.values())
    ok = [b for b, v in table.items() if max(v.values()) <= 0.2]
    assert ok and bound == max(ok), (bound, table)
    # the out-of-fold share grows with the bound
    assert table[0.05][2048] <= table[0.2][2048] and table[0.05][16384] <= table[0.2][16384]
    # a target no bound meets: the smallest bound
    assert et.choose_bound(fit, CAL, -1.0)[0] == 0.05


def rescored_from_hidden_states(fit, cal):
    """The calibration is one the parser takes, and rescoring gives each answer the probe its
    length reads, from its hidden states."""
    gf.parse_calibration(gf.format_calibration(cal))
    test = [dict(r) for r in fit]
    et.rescore(test, cal)
    for r, t in zip(fit, test):
        z = gf.probe_logit(cal, r["hidden_states"], r["context_tokens"])
        assert abs(t["hidden_probe"] - 1 / (1 + math.exp(-z))) < 1e-12

def test_long_probe_is_fitted_on_long_answers_and_scored_out_of_fold():
    """--long-probe: a probe fitted on the answers of at least TOKENS documents' tokens (their
    hidden states), written as long_probe_* beside the base's probe; the fit answers it saw get
    their out-of-fold logit, the others keep the reply's; rescoring computes it from the hidden
    states, and an answer at that length without them is an error, not a silent score."""
    rng = np.random.default_rng(6)
    dim = 6
    probe_cal = dict(CAL, features=["mean_logprob", "hidden_probe"], mean=np.array([-1.0, 0.0]),
                     scale=np.array([1.0, 1.0]), weights=np.array([-0.5, 1.0]), probe_layer=2,
                     probe_weights=np.zeros(2 * dim), probe_bias=0.0,
                     length_tokens=np.array([100.0, 9000.0]), length_offset=np.array([0.0, 0.0]))
    fit = answers(rng, 2048, 1700, 40, 40, 0.0) + answers(rng, 16384, 14000, 60, 60, 0.0)
    for r in fit:
        # the wrong answers' first row leans one way along dimension 0
        first = rng.normal(0, 1, dim) + (1.5 if r["hallucinated"] else 0.0) * np.eye(dim)[0]
        r["hidden_states"] = {"layers": [2], "first": [list(first)],
                              "mean": [list(rng.normal(0, 1, dim))], "last": [[0.0] * dim]}
        r["hidden_probe"] = 0.5
    cal, out, info = et.fit_long_probe(fit, probe_cal, 5000)
    assert cal["long_probe_from"] == 5000 and len(cal["long_probe_weights"]) == 2 * dim
    assert "length_tokens" not in cal and cal["probe_bias"] == 0.0
    assert info["n"] == 120 and info["cv_auroc"] > 0.75, info
    w = cal["long_probe_weights"]
    assert w[0] > 3 * np.max(np.abs(w[1:])), w   # it found the dimension that tells them apart
    short = [o for o in out if o["context_tokens"] < 5000]
    assert len(short) == 80 and all(o["hidden_probe"] == 0.5 for o in short)
    long_ones = [(r, o) for r, o in zip(fit, out) if r["context_tokens"] >= 5000]
    oof = [gf.clipped_logit(o["hidden_probe"], gf.PROBE_CLIP) for _, o in long_ones]
    full = [gf.probe_logit(cal, r["hidden_states"], r["context_tokens"]) for r, _ in long_ones]
    assert not np.allclose(oof, full)   # out of fold: not the probe fitted on all of them
    assert np.corrcoef(oof, full)[0, 1] > 0.8
    rescored_from_hidden_states(fit, cal)
    with pytest.raises(et.ec.EvalError, match="without its hidden states"):
        et.rescore([dict(fit[-1], hidden_states=None)], cal)
    with pytest.raises(et.ec.EvalError, match="need their hidden states"):
        et.fit_long_probe([dict(r, hidden_states=None) for r in fit], probe_cal, 5000)


def test_short_probe_is_fitted_under_the_long_probe_and_scored_out_of_fold():
    """--short-probe: a probe fitted on the answers the base probe scores (under the long
    probe's length), written as short_probe_*; only the answers under its own length get their
    out-of-fold logit; rescoring reads it from the hidden states, and an answer under that
    length without them is an error."""
    rng = np.random.default_rng(7)
    dim = 6
    probe_cal = dict(CAL, features=["mean_logprob", "hidden_probe"], mean=np.array([-1.0, 0.0]),
                     scale=np.array([1.0, 1.0]), weights=np.array([-0.5, 1.0]), probe_layer=2,
                     probe_weights=np.zeros(2 * dim), probe_bias=0.0,
                     long_probe_from=5000, long_probe_weights=np.ones(2 * dim),
                     long_probe_bias=0.0)
    fit = answers(rng, 256, 200, 40, 40, 0.0) + answers(rng, 2048, 1700, 40, 40, 0.0) + \
        answers(rng, 16384, 14000, 40, 40, 0.0)
    for r in fit:
        # the wrong answers' mean row leans one way along dimension 1
        mean = rng.normal(0, 1, dim) + (1.5 if r["hallucinated"] else 0.0) * np.eye(dim)[1]
        r["hidden_states"] = {"layers": [2], "first": [list(rng.normal(0, 1, dim))],
                              "mean": [list(mean)], "last": [[0.0] * dim]}
        r["hidden_probe"] = 0.5
    cal, out, info = et.fit_short_probe(fit, probe_cal, 500)
    assert cal["short_probe_until"] == 500 and len(cal["short_probe_weights"]) == 2 * dim
    assert cal["long_probe_from"] == 5000 and "length_tokens" not in cal
    assert info["n"] == 160 and info["cv_auroc"] > 0.75, info   # the 256 and 2048 bands
    w = cal["short_probe_weights"]
    assert w[dim + 1] > 3 * np.max(np.abs(np.delete(w, dim + 1))), w
    under = [(r, o) for r, o in zip(fit, out) if r["context_tokens"] < 500]
    assert len(under) == 80 and all(o["hidden_probe"] != 0.5 for _, o in under)
    assert all(o["hidden_probe"] == 0.5 for r, o in zip(fit, out) if r["context_tokens"] >= 500)
    oof = [gf.clipped_logit(o["hidden_probe"], gf.PROBE_CLIP) for _, o in under]
    full = [gf.probe_logit(cal, r["hidden_states"], r["context_tokens"]) for r, _ in under]
    assert not np.allclose(oof, full) and np.corrcoef(oof, full)[0, 1] > 0.8
    rescored_from_hidden_states(fit, cal)
    with pytest.raises(et.ec.EvalError, match="cannot be scored by the short probe"):
        et.rescore([dict(fit[0], hidden_states=None)], cal)
    with pytest.raises(et.ec.EvalError, match="above --long-probe 5000"):
        et.fit_short_probe(fit, probe_cal, 6000)
    with pytest.raises(et.ec.EvalError, match="need their hidden states"):
        et.fit_short_probe([dict(r, hidden_states=None) for r in fit], probe_cal, 500)


def test_bounds_say_what_the_targets_ask_of_the_answers():
    """The report's second table: how the wrong answers split, the AUROC of knowing only which
    questions are unanswerable, and the most any threshold declines with 90 % of the right
    answers kept (a refusal declines whatever the threshold; an unscored answer is kept)."""
    def r(score, right=False, impossible=False, abstained=False):
        return {"band": 2048, "mode": "free", "score": score, "right": right,
                "is_impossible": impossible, "abstained": abstained,
                "hallucinated": not right and not abstained, "context_tokens": 2000,
                "flagged": score is not None and score > 0.6}
    rs = [r(k / 10, right=True) for k in range(1, 11)]
    rs += [r(0.95, impossible=True), r(0.5, impossible=True), r(None, impossible=True),
           r(0.05, impossible=True, abstained=True), r(0.3), r(0.99)]
    # a threshold at 0.9 keeps 9 of the 10 right answers and declines 0.95 and the refusal
    assert et.most_declined(rs) == (0.5, 0.9)
    assert et.most_declined(rs, keep=1.0) == (0.25, 1.0)
    assert all(math.isnan(x) for x in et.most_declined([x for x in rs if not x["right"]]))
    # hallucinated: 3 unanswerable answered, 2 answered wrong; not: 10 right and the refusal.
    # Knowing only which are unanswerable: 30 pairs won, 3 + 20 tied, 2 lost, of 55
    line = et.bounds(rs).splitlines()[2]
    assert line == "| 2048 | free | 10 | 2 | 3 | %.3f | 0.50 / 0.90 |" % (41.5 / 55), line
    assert "unanswerable declined / right kept" in et.report(rs)


def test_other_articles_questions_are_asked_as_the_documents_do_not_hold_them():
    """--other-questions: a context's K questions come from articles none of its paragraphs
    is from, each under an id of its own, labelled as unanswerable ones are; the report gives
    them rows of their own."""
    passages = {"a-0": {"id": "a-0", "title": "A"}, "b-0": {"id": "b-0", "title": "B"},
                "c-0": {"id": "c-0", "title": "C"}}
    pool = [{"id": "q%d" % i, "gold_passage_id": "%s-0" % t.lower(), "question": "?",
             "answers": ["x"], "is_impossible": False} for i, t in enumerate("AABBCA")]
    ctx = [passages["a-0"], passages["c-0"]]
    got, nxt = et.other_questions(ctx, 2, pool, passages, 0)
    assert [q["id"] for q in got] == ["q2@a-0", "q3@a-0"] and nxt == 4
    assert all(q["is_impossible"] and q["other_article"] for q in got)
    assert not pool[2].get("other_article")          # the pool's questions are not changed
    # going round from where the last context stopped; fewer when the pool has no more
    got, nxt = et.other_questions([passages["b-0"]], 3, pool, passages, 4)
    assert [q["id"] for q in got] == ["q4@b-0", "q5@b-0", "q0@b-0"] and nxt == 7
    got, _ = et.other_questions([passages["b-0"], passages["a-0"], passages["c-0"]], 2, pool,
                                passages, 0)
    assert got == []

    def r(other, abstained):
        return {"band": 2048, "mode": "free", "score": 0.9, "right": False,
                "is_impossible": True, "abstained": abstained, "other_article": other,
                "hallucinated": not abstained, "context_tokens": 2000, "flagged": not abstained}
    rows = et.report([r(False, False), r(True, False), r(True, True)]).splitlines()
    # the declined column: the SQuAD unanswerable one flagged; of the others, one flagged and
    # one refused
    assert rows[2].startswith("| 2048 | free | 1 | nan (0 of 0) | 1.00 (1 of 1) |"), rows[2]
    assert rows[3].startswith("| 2048 | free, others | 2 | nan (0 of 0) | 1.00 (2 of 2) |"), \
        rows[3]
    assert len(rows) == 4 + 1 + 4   # the second table: a row each too
