"""tools/grounding_features.py, the NumPy score of docs/groundedness.md: answer windows at the
edges, window features against hand-computed values, the calibration file (round trip and
every refusal with its line number), and the detector metrics against known values."""
import itertools
import math
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import grounding_features as gf  # noqa: E402


# ---- windows ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n,expect", [
    (0, []),
    (1, [(0, 1)]),
    (7, [(0, 7)]),
    (8, [(0, 8)]),                                  # n == window: one window
    (9, [(0, 8), (1, 9)]),                          # the last window overlaps all but one
    (12, [(0, 8), (4, 12)]),                        # start 4: 4 + 8 == n, so it is the last
    (13, [(0, 8), (4, 12), (5, 13)]),
    (16, [(0, 8), (4, 12), (8, 16)]),
    (17, [(0, 8), (4, 12), (8, 16), (9, 17)]),
])
def test_windows_default_size(n, expect):
    assert gf.windows(n, 8, 4) == expect


def test_windows_cover_every_token_and_have_full_length():
    for window, stride, n in itertools.product(range(1, 10), range(1, 12), range(0, 60)):
        ws = gf.windows(n, window, stride)
        covered = set()
        for a, b in ws:
            assert 0 <= a < b <= n
            assert b - a == min(window, n)
            covered.update(range(a, b))
        assert covered == set(range(n)) or stride > window, (n, window, stride, ws)
        if n:
            assert ws[-1][1] == n and ws[0][0] == 0
            # starts are increasing and unique
            assert all(x[0] < y[0] for x, y in zip(ws, ws[1:])), ws


def test_windows_refuse_nonpositive_sizes():
    with pytest.raises(ValueError):
        gf.windows(5, 0, 4)
    with pytest.raises(ValueError):
        gf.windows(5, 8, 0)


# ---- features and score -------------------------------------------------------------------------

def signals(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"text": ["t%d" % i for i in range(n)],
            "logprob": list(-rng.exponential(1.0, n)),
            "entropy": list(rng.uniform(0, 4, n)),
            "margin": list(rng.uniform(0, 1, n)),
            "doc_mass": list(rng.uniform(0, 0.6, n)),
            "gen_mass": list(rng.uniform(0, 0.4, n)),
            "diff_doc_mass": list(rng.uniform(-0.2, 0.6, n)),
            "lookback": list(rng.uniform(0, 1, n)),
            "unsupported": [bool(x) for x in rng.integers(0, 2, n)]}


def test_window_features_by_hand():
    s = signals(10)
    f = gf.window_features(s, 2, 7)
    sl = slice(2, 7)
    doc, gen = sum(s["doc_mass"][sl]), sum(s["gen_mass"][sl])
    expect = [sum(s["logprob"][sl]) / 5, min(s["logprob"][sl]), sum(s["entropy"][sl]) / 5,
              sum(s["margin"][sl]) / 5, doc / (doc + gen), sum(s["diff_doc_mass"][sl]) / 5,
              sum(s["unsupported"][sl]) / 5]
    assert len(f) == len(gf.FEATURES) == 12
    np.testing.assert_allclose(f[:7], expect, rtol=0, atol=1e-12)
    # without a self-check its feature is NaN; with one, the clipped log-odds of P(yes)
    assert math.isnan(f[7]) and math.isnan(f[8]) and math.isnan(f[9]) and math.isnan(f[10])
    # a quoted answer's removed mass: its window mean
    removed = [0.05 * i for i in range(10)]
    assert abs(gf.window_features(dict(s, quote_removed=removed), 2, 7)[10] - 0.2) < 1e-12
    # the documents' length: ln(1 + tokens), NaN when not given
    assert math.isnan(f[11])
    assert abs(gf.window_features(dict(s, context_tokens=2047), 2, 7)[11] - math.log(2048)) < 1e-12
    assert gf.window_features(dict(s, context_reliance=1.75), 2, 7)[8] == 1.75
    assert gf.window_features(dict(s, hidden_probe=-2.5), 2, 7)[9] == -2.5
    for p, want in ((0.8, math.log(4.0)), (0.5, 0.0), (1e-12, -20.0), (1.0, 20.0), (0.0, -20.0)):
        got = gf.window_features(dict(s, self_check=p), 2, 7)[7]
        assert abs(got - want) < 1e-9, (p, got, want)


def test_a_missing_self_check_adds_nothing_to_the_score():
    s = signals(12, seed=4)
    cal = calibration()
    without, _ = gf.score(cal, s)
    at_mean = dict(s, self_check=1 / (1 + math.exp(-cal["mean"][7])))
    assert abs(gf.score(cal, at_mean)[0] - without) < 1e-9
    worse = dict(s, self_check=0.01)   # a confident "no" raises a positive weight's score
    assert gf.score(cal, worse)[0] > without


def test_window_lookback_is_zero_without_mass():
    s = signals(4)
    s["doc_mass"] = [0.0] * 4
    s["gen_mass"] = [0.0] * 4
    assert gf.window_features(s, 0, 4)[gf.FEATURES.index("lookback")] == 0.0


def test_window_features_refuse_bad_input():
    s = signals(6)
    with pytest.raises(ValueError):
        gf.window_features(s, 3, 3)
    with pytest.raises(ValueError):
        gf.window_features(s, 2, 9)
    bad = dict(s, margin=s["margin"][:-1])
    with pytest.raises(ValueError, match="margin"):
        gf.window_features(bad, 0, 4)
    del bad["margin"]
    with pytest.raises(ValueError, match="margin"):
        gf.window_features(bad, 0, 4)


def calibration(**kw):
    cal = {"name": "unit-v1", "model_sha256": "ab" * 32, "window": 8, "stride": 4,
           "threshold": 0.5, "watch": [(15, 0), (22, 8)],
           "features": [f for f in gf.FEATURES
                        if f not in ("hidden_probe", "quote_removed", "log_context_tokens")],
           "mean": np.linspace(-1, 1, 9), "scale": np.linspace(0.5, 2, 9),
           "weights": np.array([-0.8, -0.3, 0.4, -0.5, -1.2, -0.7, 2.0, -0.6, 0.3]),
           "bias": -0.25}
    cal.update(kw)
    return cal


def test_score_is_the_max_of_logistic_windows():
    s = dict(signals(19, seed=3), self_check=0.3, context_reliance=-0.4)
    cal = calibration()
    score, per_window = gf.score(cal, s)
    ws = gf.windows(19, 8, 4)
    assert len(per_window) == len(ws) == 4  # [0,8) [4,12) [8,16) [11,19)
    for (a, b), got in zip(ws, per_window):
        f = gf.window_features(s, a, b)
        z = cal["bias"] + sum(w * (x - m) / sc for w, x, m, sc in
                              zip(cal["weights"], f, cal["mean"], cal["scale"]))
        assert abs(got - 1 / (1 + math.exp(-z))) < 1e-12
    assert score == max(per_window) and 0 <= score <= 1


def test_score_uses_the_named_features_in_their_order():
    s = signals(11, seed=5)
    full = calibration(weights=np.zeros(9), bias=0.0)
    full["weights"][gf.FEATURES.index("unsupported_ratio")] = 1.5
    full["weights"][gf.FEATURES.index("lookback")] = -2.0
    i, j = gf.FEATURES.index("lookback"), gf.FEATURES.index("unsupported_ratio")
    sub = calibration(features=["unsupported_ratio", "lookback"],
                      mean=full["mean"][[j, i]], scale=full["scale"][[j, i]],
                      weights=np.array([1.5, -2.0]), bias=0.0)
    a, wa = gf.score(full, s)
    b, wb = gf.score(sub, s)
    assert abs(a - b) < 1e-12 and np.allclose(wa, wb, rtol=0, atol=1e-12)


def test_score_of_an_empty_answer_is_none():
    assert gf.score(calibration(), signals(0)) == (None, [])


def test_extreme_logits_stay_finite():
    cal = calibration(features=["mean_logprob"], mean=np.zeros(1), scale=np.ones(1),
                      weights=np.array([1e6]), bias=0.0)
    s = signals(3)
    s["logprob"] = [-5.0] * 3
    assert gf.score(cal, s)[0] == 0.0
    s["logprob"] = [5.0] * 3
    assert gf.score(cal, s)[0] == 1.0


# ---- calibration file ---------------------------------------------------------------------------

GOOD = """# a comment line
diffrag-grounding 1
name smollm2-135m-v1   # trailing comment
model_sha256 %s
window 8
stride 4
threshold 0.5
watch 15:0 15:1 22:8

features lookback unsupported_ratio mean_logprob
mean 0.5 0.1 -1
scale 0.2 0.3 1.5
weights -1 2 -0.5
bias 0.25
""" % ("0123456789abcdef" * 4)


def test_calibration_parses():
    cal = gf.parse_calibration(GOOD)
    assert cal["name"] == "smollm2-135m-v1"
    assert cal["model_sha256"] == "0123456789abcdef" * 4
    assert (cal["window"], cal["stride"], cal["threshold"], cal["bias"]) == (8, 4, 0.5, 0.25)
    assert cal["watch"] == [(15, 0), (15, 1), (22, 8)]
    assert cal["features"] == ["lookback", "unsupported_ratio", "mean_logprob"]
    np.testing.assert_array_equal(cal["scale"], [0.2, 0.3, 1.5])
    np.testing.assert_array_equal(cal["weights"], [-1, 2, -0.5])


def test_hidden_state_probe_keys_and_logit(tmp_path):
    probe = "probe_layer 3\nprobe_weights 0.5 -1 2 0.25\nprobe_bias -3\n"
    cal = gf.parse_calibration(GOOD + probe)
    assert cal["probe_layer"] == 3 and cal["probe_bias"] == -3
    np.testing.assert_array_equal(cal["probe_weights"], [0.5, -1, 2, 0.25])
    hidden = {"layers": [7, 3], "first": [[9, 9], [2, 1]], "mean": [[9, 9], [4, -8]]}
    assert gf.probe_logit(cal, hidden) == -3 + 0.5 * 2 - 1 * 1 + 2 * 4 + 0.25 * -8
    assert math.isnan(gf.probe_logit(cal, {"layers": [7], "first": [[1, 1]], "mean": [[1, 1]]}))
    assert math.isnan(gf.probe_logit(cal, None))
    assert math.isnan(gf.probe_logit(gf.parse_calibration(GOOD), hidden))
    big = {"layers": [3], "first": [[1e6, 0]], "mean": [[0, 0]]}
    assert gf.probe_logit(cal, big) == gf.PROBE_CLIP
    for p, want in ((0.5, 0.0), (1.0, gf.PROBE_CLIP), (None, math.nan)):
        got = gf.probe_from_reply(p)
        assert (math.isnan(got) and math.isnan(want)) or abs(got - want) < 1e-12, (p, got)
    path = tmp_path / "p.grounding"
    gf.write_calibration(path, cal)
    back = gf.read_calibration(path)
    assert back["probe_layer"] == 3 and back["probe_bias"] == -3
    np.testing.assert_array_equal(back["probe_weights"], cal["probe_weights"])
    with pytest.raises(ValueError, match="come together"):
        gf.parse_calibration(GOOD + "probe_layer 3\nprobe_bias 1\n")
    with pytest.raises(ValueError, match="two or three rows"):
        gf.parse_calibration(GOOD + "probe_layer 3\nprobe_weights 1 2 3 4 5\nprobe_bias 1\n")
    # three rows of weights take the last row too; a reply without it gives NaN
    cal3 = gf.parse_calibration(GOOD + "probe_layer 3\nprobe_weights 0.5 -1 2 0.25 0.125 -2\n"
                                "probe_bias -3\n")
    hidden3 = dict(hidden, last=[[0, 0], [100, 7]])
    assert gf.probe_logit(cal3, hidden3) == -3 + 0.5 * 2 - 1 * 1 + 2 * 4 + 0.25 * -8 + 12.5 - 14
    assert gf.probe_logit(cal, hidden3) == gf.probe_logit(cal, hidden)
    assert math.isnan(gf.probe_logit(cal3, hidden))
    with pytest.raises(ValueError, match="hidden_probe needs"):
        gf.parse_calibration(GOOD.replace("mean_logprob\n", "mean_logprob hidden_probe\n")
                             .replace("-1\nscale", "-1 0\nscale").replace("1.5\n", "1.5 1\n")
                             .replace("-0.5\n", "-0.5 1\n"))

def test_long_probe_keys_and_logit(tmp_path):
    """From long_probe_from documents' tokens on, the long probe's weights and bias take the
    probe's place, as the daemon's gr_probe_logit does."""
    probe = "probe_layer 3\nprobe_weights 0.5 -1 2 0.25\nprobe_bias -3\n"
    long_probe = "long_probe_from 4000\nlong_probe_weights 1 1 -1 0.5\nlong_probe_bias 2\n"
    cal = gf.parse_calibration(GOOD + probe + long_probe)
    assert cal["long_probe_from"] == 4000 and cal["long_probe_bias"] == 2
    hidden = {"layers": [3], "first": [[2, 1]], "mean": [[4, -8]]}
    short = -3 + 0.5 * 2 - 1 * 1 + 2 * 4 + 0.25 * -8
    assert gf.probe_logit(cal, hidden) == short
    assert gf.probe_logit(cal, hidden, 3999) == short
    assert gf.probe_logit(cal, hidden, 4000) == 2 + 1 * 2 + 1 * 1 - 1 * 4 + 0.5 * -8
    assert gf.probe_logit(cal, hidden, 4000) != short
    path = tmp_path / "l.grounding"
    gf.write_calibration(path, cal)
    back = gf.read_calibration(path)
    assert back["long_probe_from"] == 4000 and back["long_probe_bias"] == 2
    np.testing.assert_array_equal(back["long_probe_weights"], cal["long_probe_weights"])
    with pytest.raises(ValueError, match="come together"):
        gf.parse_calibration(GOOD + probe + "long_probe_from 4000\nlong_probe_bias 2\n")
    with pytest.raises(ValueError, match="needs the probe"):
        gf.parse_calibration(GOOD + long_probe)
    with pytest.raises(ValueError, match="long_probe_weights has 6 numbers; probe_weights has 4"):
        gf.parse_calibration(GOOD + probe + long_probe.replace("0.5\n", "0.5 1 1\n"))
    with pytest.raises(ValueError, match="long_probe_from"):
        gf.parse_calibration(GOOD + probe + long_probe.replace("from 4000", "from 0"))



def test_short_probe_keys_and_logit(tmp_path):
    """Under short_probe_until documents' tokens, the short probe's weights and bias take the
    probe's place; from it on the probe, then the long probe, as the daemon's gr_probe_logit
    reads them. The short probe's bound may not pass the long probe's."""
    probe = "probe_layer 3\nprobe_weights 0.5 -1 2 0.25\nprobe_bias -3\n"
    long_probe = "long_probe_from 4000\nlong_probe_weights 1 1 -1 0.5\nlong_probe_bias 2\n"
    short_probe = "short_probe_until 500\nshort_probe_weights -1 0 0 1\nshort_probe_bias 0.5\n"
    cal = gf.parse_calibration(GOOD + probe + long_probe + short_probe)
    hidden = {"layers": [3], "first": [[2, 1]], "mean": [[4, -8]]}
    mid = -3 + 0.5 * 2 - 1 * 1 + 2 * 4 + 0.25 * -8
    under = 0.5 - 1 * 2 + 1 * -8
    assert gf.probe_logit(cal, hidden) == under and gf.probe_logit(cal, hidden, 499) == under
    assert gf.probe_logit(cal, hidden, 500) == mid and gf.probe_logit(cal, hidden, 3999) == mid
    assert gf.probe_logit(cal, hidden, 4000) == 2 + 1 * 2 + 1 * 1 - 1 * 4 + 0.5 * -8
    path = tmp_path / "s.grounding"
    gf.write_calibration(path, cal)
    back = gf.read_calibration(path)
    assert back["short_probe_until"] == 500 and back["short_probe_bias"] == 0.5
    np.testing.assert_array_equal(back["short_probe_weights"], cal["short_probe_weights"])
    for text, message in (
            (probe + "short_probe_until 500\nshort_probe_bias 2\n", "come together"),
            (short_probe, "short_probe_until needs the probe"),
            (probe + short_probe.replace("-1 0 0 1", "1 2"),
             "short_probe_weights has 2 numbers; probe_weights has 4"),
            (probe + short_probe.replace("until 500", "until 0"), "short_probe_until"),
            (probe + long_probe.replace("from 4000", "from 400") + short_probe,
             "short_probe_until 500 is above long_probe_from 400")):
        with pytest.raises(ValueError, match=message):
            gf.parse_calibration(GOOD + text)

def test_length_offset_keys_and_score(tmp_path):
    """length_tokens/length_offset: parsed, written back exactly, linear in ln(1 + tokens)
    between the knots and flat beyond them, added to every window's logit (as
    daemon/grounding.c's gr_length_offset, whose unit test checks the same values)."""
    cal = gf.parse_calibration(GOOD + "length_tokens 200 1700 15000\n"
                                      "length_offset 0.5 -1.5 -1\n")
    np.testing.assert_array_equal(cal["length_tokens"], [200, 1700, 15000])
    mid = (math.log1p(1700) + math.log1p(15000)) / 2
    for lc, want in ((0.0, 0.5), (math.log1p(200), 0.5), (math.log1p(1700), -1.5), (mid, -1.25),
                     (math.log1p(1e6), -1.0)):
        assert abs(float(gf.length_offset(cal, lc)) - want) < 1e-12, (lc, want)
    base = gf.parse_calibration(GOOD)
    s = signals(20, seed=4)
    for tokens in (50, 900, 1700, 6000, 40000):
        sig = dict(s, context_tokens=tokens)
        off = float(gf.length_offset(cal, math.log1p(tokens)))
        _, with_off = gf.score(cal, sig)
        _, without = gf.score(base, sig)
        for a, b in zip(with_off, without):
            assert abs(math.log(a / (1 - a)) - math.log(b / (1 - b)) - off) < 1e-9
    with pytest.raises(ValueError, match="needs context_tokens|need context_tokens"):
        gf.score(cal, s)
    path = tmp_path / "l.grounding"
    gf.write_calibration(path, cal)
    back = gf.read_calibration(path)
    np.testing.assert_array_equal(back["length_tokens"], cal["length_tokens"])
    np.testing.assert_array_equal(back["length_offset"], cal["length_offset"])
    for extra, message in (("length_tokens 200 1700\n", "come together"),
                           ("length_tokens 200 1700\nlength_offset 1\n", "has 1 numbers"),
                           ("length_tokens 1700 200\nlength_offset 1 2\n", "strictly ascending"),
                           ("length_tokens 5\nlength_offset 1e9\n", "from -1000 to 1000")):
        with pytest.raises(ValueError, match=message):
            gf.parse_calibration(GOOD + extra)


def test_calibration_round_trip_is_exact(tmp_path):
    cal = calibration(weights=np.array([1 / 3, -2 / 7, 1e-17, 3e5, -0.1, 0.7, 2.0, -1e-3, 5.0]))
    path = tmp_path / "c.grounding"
    gf.write_calibration(path, cal, comment="fitted on\nsomething")
    text = path.read_text()
    assert text.startswith("diffrag-grounding 1\n# fitted on\n# something\n")
    back = gf.read_calibration(path)
    for k in ("name", "model_sha256", "window", "stride", "threshold", "watch", "features",
              "bias"):
        assert back[k] == cal[k], k
    for k in ("mean", "scale", "weights"):
        np.testing.assert_array_equal(back[k], cal[k])


def replace_line(key, new):
    out = []
    for line in GOOD.splitlines():
        if line.split("#")[0].split(" ")[0] == key:
            if new is not None:
                out.append(new)
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def line_of(key):
    for i, line in enumerate(GOOD.splitlines(), 1):
        if line.split(" ")[0] == key:
            return i
    raise KeyError(key)


@pytest.mark.parametrize("key,new,message", [
    ("diffrag-grounding", "diffrag-grounding 2", "version"),
    ("name", "name two words", "one word"),
    ("name", "name smollm2/v1", "one word"),
    ("stride", "stride 9", "exceeds window"),
    ("model_sha256", "model_sha256 abc", "64 hex"),
    ("model_sha256", "model_sha256 " + "g" * 64, "64 hex"),
    ("window", "window 0", "at least 1"),
    ("window", "window 8.5", "integer"),
    ("stride", "stride -4", "integer"),
    ("threshold", "threshold 1.5", r"\[0, 1\]"),
    ("threshold", "threshold nan", "finite"),
    ("watch", "watch 15-0", "layer:head"),
    ("watch", "watch 15:0 15:0", "repeated"),
    ("features", "features lookback unsupported_ratio mean_logits", "unknown feature"),
    ("features", "features lookback lookback mean_logprob", "twice"),
    ("mean", "mean 0.5 0.1", "2 numbers for 3 features"),
    ("scale", "scale 0.2 0 1", "positive"),
    ("scale", "scale 0.2 1e-13 1", "at least 1e-12"),
    ("weights", "weights -1 1e300 2", "beyond 1e\\+12"),
    ("mean", "mean 0.5 0.1 -2e12", "beyond"),
    ("weights", "weights -1 2 x", "not a number"),
    ("bias", "bias 1 2", "one number"),
    ("bias", "bias", "no value"),
    ("name", "nmae x", "unknown key"),
])
def test_calibration_errors_name_the_line(key, new, message):
    text = replace_line(key, new)
    with pytest.raises(ValueError, match=message) as e:
        gf.parse_calibration(text)
    assert str(e.value).startswith("line %d:" % line_of(key)), str(e.value)


def test_calibration_missing_and_repeated_keys():
    n = len(GOOD.splitlines())
    for key in gf.KEYS:
        with pytest.raises(ValueError, match="key %s missing" % key):
            gf.parse_calibration(replace_line(key, None))
    with pytest.raises(ValueError, match=r"line %d: key bias repeated \(first on line %d\)" %
                       (n + 1, n)):
        gf.parse_calibration(GOOD + "bias 1\n")
    with pytest.raises(ValueError, match="not a calibration file"):
        gf.parse_calibration(replace_line("diffrag-grounding", None))
    with pytest.raises(ValueError, match="not a calibration file"):
        gf.parse_calibration("")


def test_read_calibration_names_the_file(tmp_path):
    p = tmp_path / "bad.grounding"
    p.write_text(replace_line("window", "window zero"))
    with pytest.raises(ValueError, match=r"bad\.grounding: line %d: window" % line_of("window")):
        gf.read_calibration(p)


# ---- metrics ------------------------------------------------------------------------------------

def test_auroc_known_values():
    assert gf.auroc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == 0.75
    assert gf.auroc([0, 1], [0.2, 0.9]) == 1.0
    assert gf.auroc([0, 1], [0.9, 0.2]) == 0.0
    assert gf.auroc([0, 1, 0, 1], [0.5] * 4) == 0.5           # ties count one half
    assert gf.auroc([1, 1], [0.1, 0.2]) is None
    # against the pairwise definition on random data with ties
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 300)
    s = rng.integers(0, 20, 300) / 20
    pairs = [(1.0 if a > b else 0.5 if a == b else 0.0)
             for a in s[y == 1] for b in s[y == 0]]
    assert abs(gf.auroc(y, s) - sum(pairs) / len(pairs)) < 1e-12


def test_roc_curve_area_matches_auroc():
    rng = np.random.default_rng(2)
    y = rng.integers(0, 2, 200)
    s = rng.normal(size=200) + y
    fpr, tpr = gf.roc_curve(y, s)
    assert fpr[0] == tpr[0] == 0 and fpr[-1] == tpr[-1] == 1
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0)
    trapezoid = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))
    assert abs(trapezoid - gf.auroc(y, s)) < 1e-12


def test_auprc_known_values():
    # ranks: 0.8 (pos) -> P=1 R=.5 ; 0.4 (neg) ; 0.35 (pos) -> P=2/3 R=1
    assert abs(gf.auprc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) - (0.5 * 1 + 0.5 * 2 / 3)) < 1e-12
    assert gf.auprc([0, 1, 1], [0.1, 0.5, 0.9]) == 1.0
    assert gf.auprc([0, 0], [0.1, 0.2]) is None


def test_at_threshold_counts():
    m = gf.at_threshold([0, 0, 1, 1, 1], [0.1, 0.6, 0.5, 0.7, 0.2], 0.5)
    assert (m["tp"], m["fp"], m["fn"], m["tn"]) == (2, 1, 1, 1)
    assert m["precision"] == 2 / 3 and m["recall"] == 2 / 3 and m["fpr"] == 0.5
    assert m["f1"] == 2 / 3 == gf.f1_at([0, 0, 1, 1, 1], [0.1, 0.6, 0.5, 0.7, 0.2], 0.5)
    none = gf.at_threshold([0, 0], [0.1, 0.2], 0.5)
    assert none["precision"] is None and none["recall"] is None and none["fpr"] == 0.0


def test_best_f1_threshold():
    t, f = gf.best_f1_threshold([0, 0, 1, 1, 1], [0.1, 0.6, 0.5, 0.7, 0.2])
    # candidates: 0.5 -> tp2 fp1 fn1 (f1 2/3); 0.2 -> tp3 fp1 fn0 (f1 6/7)
    assert t == 0.2 and abs(f - 6 / 7) < 1e-12


def test_metrics_refuse_bad_labels():
    with pytest.raises(ValueError):
        gf.auroc([0, 2], [0.1, 0.2])
    with pytest.raises(ValueError):
        gf.auroc([0, 1, 1], [0.1, 0.2])
