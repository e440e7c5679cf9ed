"""The groundedness score of docs/groundedness.md in NumPy: answer windows, window features,
the calibrated logistic score and the calibration file format, plus the detector metrics
(AUROC, AUPRC, F1 and false-positive rate at a threshold). The evaluation tool fits and
reports with it; the daemon tests compare the daemon's score with it."""
import math
import re

import numpy as np

FEATURES = ("mean_logprob", "min_logprob", "mean_entropy", "mean_margin", "lookback",
            "diff_doc_mass", "unsupported_ratio", "self_check", "context_reliance",
            "hidden_probe", "quote_removed", "log_context_tokens")

# the self-check's log-odds are clipped to +-CHECK_CLIP (daemon/grounding.h GR_CHECK_CLIP)
CHECK_CLIP = 20.0
# and the hidden-state probe's logit to +-PROBE_CLIP (GR_PROBE_CLIP)
PROBE_CLIP = 40.0

MAGIC = "diffrag-grounding"
VERSION = 1
KEYS = ("name", "model_sha256", "window", "stride", "threshold", "watch", "features", "mean",
        "scale", "weights", "bias")
# the hidden-state probe's keys: all three or none
PROBE_KEYS = ("probe_layer", "probe_weights", "probe_bias")
# the length offset's keys: both or none (daemon/grounding.h GR_MAX_KNOTS numbers at most)
LENGTH_KEYS = ("length_tokens", "length_offset")
# the probes for long and for short prompts: all three or none, and only with the probe
LONG_PROBE_KEYS = ("long_probe_from", "long_probe_weights", "long_probe_bias")
SHORT_PROBE_KEYS = ("short_probe_until", "short_probe_weights", "short_probe_bias")
MAX_KNOTS = 16

# token_signals arrays a score needs
SIGNALS = ("logprob", "entropy", "margin", "doc_mass", "gen_mass", "diff_doc_mass",
           "unsupported")


# ---------------------------------------------------------------------------------------------
# calibration file

# A window's logit over finite features stays finite: no weight over a tiny scale (the C
# parser's GR_MAX_COEF and GR_MIN_SCALE).
MAX_COEF = 1e12
MIN_SCALE = 1e-12


def _number(text, lineno, key):
    try:
        v = float(text)
    except ValueError:
        raise ValueError("line %d: %s: %r is not a number" % (lineno, key, text)) from None
    if not math.isfinite(v):
        raise ValueError("line %d: %s: %r is not finite" % (lineno, key, text))
    return v


def _integer(text, lineno, key, lo):
    if not re.fullmatch(r"[0-9]+", text):
        raise ValueError("line %d: %s: %r is not a non-negative integer" % (lineno, key, text))
    v = int(text)
    if v < lo:
        raise ValueError("line %d: %s must be at least %d, got %d" % (lineno, key, lo, v))
    return v


def parse_calibration(text):
    """The calibration in `text` as a dict; ValueError naming the line for anything malformed:
    a missing or repeated key, an unknown key or feature, a count that does not match
    `features`, a value that is not a finite number, a non-positive scale or window, a stride
    above the window, a name that is not one word of [A-Za-z0-9._-]."""
    cal = {}
    seen = {}
    magic_line = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, _, rest = line.partition(" ")
        key = key.strip()
        vals = rest.split()
        if key == MAGIC:
            if magic_line is not None:
                raise ValueError("line %d: %s repeated (first on line %d)" %
                                 (lineno, MAGIC, magic_line))
            if vals != [str(VERSION)]:
                raise ValueError("line %d: unsupported format version %r (want %d)" %
                                 (lineno, rest.strip(), VERSION))
            magic_line = lineno
            continue
        if key not in KEYS + PROBE_KEYS + LENGTH_KEYS + LONG_PROBE_KEYS + SHORT_PROBE_KEYS:
            raise ValueError("line %d: unknown key %r" % (lineno, key))
        if key in seen:
            raise ValueError("line %d: key %s repeated (first on line %d)" %
                             (lineno, key, seen[key]))
        seen[key] = lineno
        if not vals:
            raise ValueError("line %d: key %s has no value" % (lineno, key))
        if key == "name":
            if len(vals) != 1 or not re.fullmatch(r"[A-Za-z0-9._-]+", vals[0]):
                raise ValueError("line %d: name must be one word of letters, digits, '.', '_' "
                                 "and '-'" % lineno)
            cal["name"] = vals[0]
        elif key == "model_sha256":
            if len(vals) != 1 or not re.fullmatch(r"[0-9a-fA-F]{64}", vals[0]):
                raise ValueError("line %d: model_sha256 must be 64 hex digits" % lineno)
            cal["model_sha256"] = vals[0].lower()
        elif key in ("window", "stride"):
            if len(vals) != 1:
                raise ValueError("line %d: %s takes one integer" % (lineno, key))
            cal[key] = _integer(vals[0], lineno, key, 1)
        elif key == "probe_layer":
            if len(vals) != 1:
                raise ValueError("line %d: probe_layer takes one integer" % lineno)
            cal[key] = _integer(vals[0], lineno, key, 0)
        elif key in ("probe_weights", "long_probe_weights", "short_probe_weights"):
            cal[key] = np.array([_number(v, lineno, key) for v in vals], dtype=np.float64)
            if not vals or (len(vals) % 2 and len(vals) % 3):
                raise ValueError("line %d: %s has %d numbers; it needs two or three rows of "
                                 "the model's dim" % (lineno, key, len(vals)))
        elif key in ("long_probe_from", "short_probe_until"):
            if len(vals) != 1:
                raise ValueError("line %d: %s takes one integer" % (lineno, key))
            cal[key] = _integer(vals[0], lineno, key, 1)
            if cal[key] > 100000000:
                raise ValueError("line %d: %s must be a token count from 1 to 100000000" %
                                 (lineno, key))
        elif key == "length_tokens":
            v = [_integer(x, lineno, key, 0) for x in vals]
            if len(v) > MAX_KNOTS or any(b <= a for a, b in zip(v, v[1:])) or v[-1] > 100000000:
                raise ValueError("line %d: length_tokens must be at most %d strictly ascending "
                                 "token counts up to 100000000" % (lineno, MAX_KNOTS))
            cal[key] = np.array(v, dtype=np.float64)
        elif key == "length_offset":
            cal[key] = np.array([_number(x, lineno, key) for x in vals], dtype=np.float64)
            if len(vals) > MAX_KNOTS or np.any(np.abs(cal[key]) > 1e3):
                raise ValueError("line %d: length_offset must be at most %d numbers from -1000 "
                                 "to 1000" % (lineno, MAX_KNOTS))
        elif key in ("threshold", "bias", "probe_bias", "long_probe_bias", "short_probe_bias"):
            if len(vals) != 1:
                raise ValueError("line %d: %s takes one number" % (lineno, key))
            cal[key] = _number(vals[0], lineno, key)
            if key == "threshold" and not 0.0 <= cal[key] <= 1.0:
                raise ValueError("line %d: threshold must be in [0, 1], got %s" %
                                 (lineno, vals[0]))
        elif key == "watch":
            watch = []
            for v in vals:
                m = re.fullmatch(r"([0-9]+):([0-9]+)", v)
                if not m:
                    raise ValueError("line %d: watch entry %r is not layer:head" % (lineno, v))
                pair = (int(m.group(1)), int(m.group(2)))
                if pair in watch:
                    raise ValueError("line %d: watch entry %s repeated" % (lineno, v))
                watch.append(pair)
            cal["watch"] = watch
        elif key == "features":
            for v in vals:
                if v not in FEATURES:
                    raise ValueError("line %d: unknown feature %r" % (lineno, v))
            if len(set(vals)) != len(vals):
                raise ValueError("line %d: a feature is named twice" % lineno)
            cal["features"] = list(vals)
        else:  # mean, scale, weights: bounded as diffragd bounds them (MAX_COEF, MIN_SCALE)
            cal[key] = np.array([_number(v, lineno, key) for v in vals], dtype=np.float64)
            if np.any(np.abs(cal[key]) > MAX_COEF):
                raise ValueError("line %d: %s: a number beyond %g" % (lineno, key, MAX_COEF))
    if magic_line is None:
        raise ValueError("line 1: not a calibration file (no '%s %d' line)" % (MAGIC, VERSION))
    end = len(text.splitlines()) + 1
    for key in KEYS:
        if key not in seen:
            raise ValueError("line %d: key %s missing" % (end, key))
    have = [k for k in PROBE_KEYS if k in seen]
    if have and len(have) != len(PROBE_KEYS):
        raise ValueError("line %d: %s come together" % (end, ", ".join(PROBE_KEYS)))
    have_len = [k for k in LENGTH_KEYS if k in seen]
    if have_len and len(have_len) != len(LENGTH_KEYS):
        raise ValueError("line %d: %s come together" % (end, ", ".join(LENGTH_KEYS)))
    if have_len and len(cal["length_tokens"]) != len(cal["length_offset"]):
        raise ValueError("line %d: length_offset has %d numbers; length_tokens has %d" % (
            seen["length_offset"], len(cal["length_offset"]), len(cal["length_tokens"])))
    for keys in (LONG_PROBE_KEYS, SHORT_PROBE_KEYS):
        have_range = [k for k in keys if k in seen]
        if have_range and len(have_range) != len(keys):
            raise ValueError("line %d: %s come together" % (end, ", ".join(keys)))
        if have_range and not have:
            raise ValueError("line %d: %s needs the probe (%s)" % (
                seen[keys[0]], keys[0], ", ".join(PROBE_KEYS)))
        if have_range and len(cal[keys[1]]) != len(cal["probe_weights"]):
            raise ValueError("line %d: %s has %d numbers; probe_weights has %d" % (
                seen[keys[1]], keys[1], len(cal[keys[1]]), len(cal["probe_weights"])))
    if "short_probe_until" in cal and "long_probe_from" in cal and \
            cal["short_probe_until"] > cal["long_probe_from"]:
        raise ValueError("line %d: short_probe_until %d is above long_probe_from %d" % (
            seen["short_probe_until"], cal["short_probe_until"], cal["long_probe_from"]))
    if "hidden_probe" in cal["features"] and not have:
        raise ValueError("line %d: feature hidden_probe needs %s" %
                         (seen["features"], ", ".join(PROBE_KEYS)))
    n = len(cal["features"])
    for key in ("mean", "scale", "weights"):
        if len(cal[key]) != n:
            raise ValueError("line %d: %s has %d numbers for %d features" %
                             (seen[key], key, len(cal[key]), n))
    if np.any(cal["scale"] < MIN_SCALE):
        raise ValueError("line %d: scale must be positive, at least %g" %
                         (seen["scale"], MIN_SCALE))
    if cal["stride"] > cal["window"]:
        raise ValueError("line %d: stride %d exceeds window %d (tokens would fall between "
                         "windows)" % (seen["stride"], cal["stride"], cal["window"]))
    return cal


def read_calibration(path):
    """parse_calibration of a file; the ValueError message starts with the path."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return parse_calibration(text)
    except ValueError as e:
        raise ValueError("%s: %s" % (path, e)) from None


def format_calibration(cal, comment=None):
    """The file text of a calibration dict (the inverse of parse_calibration). Numbers are
    written with 17 significant digits so that a round trip is exact."""
    def nums(a):
        return " ".join(repr(float(x)) for x in a)
    lines = ["%s %d" % (MAGIC, VERSION)]
    for c in (comment or "").splitlines():
        lines.append("# " + c if c else "#")
    lines += ["name %s" % cal["name"],
              "model_sha256 %s" % cal["model_sha256"],
              "window %d" % cal["window"],
              "stride %d" % cal["stride"],
              "threshold %s" % repr(float(cal["threshold"])),
              "watch %s" % " ".join("%d:%d" % (l, h) for l, h in cal["watch"]),
              "features %s" % " ".join(cal["features"]),
              "mean %s" % nums(cal["mean"]),
              "scale %s" % nums(cal["scale"]),
              "weights %s" % nums(cal["weights"]),
              "bias %s" % repr(float(cal["bias"]))]
    def floats(a):   # a probe's weights, as the daemon keeps them
        return " ".join(repr(float(np.float32(x))) for x in a)
    if "probe_layer" in cal:
        lines += ["probe_layer %d" % cal["probe_layer"],
                  "probe_weights %s" % floats(cal["probe_weights"]),
                  "probe_bias %s" % repr(float(cal["probe_bias"]))]
    for keys in (LONG_PROBE_KEYS, SHORT_PROBE_KEYS):
        if keys[0] in cal:
            lines += ["%s %d" % (keys[0], cal[keys[0]]),
                      "%s %s" % (keys[1], floats(cal[keys[1]])),
                      "%s %s" % (keys[2], repr(float(cal[keys[2]])))]
    if "length_tokens" in cal:
        lines += ["length_tokens %s" % " ".join("%d" % x for x in cal["length_tokens"]),
                  "length_offset %s" % nums(cal["length_offset"])]
    text = "\n".join(lines) + "\n"
    parse_calibration(text)  # never write a file the parser would refuse
    return text


def write_calibration(path, cal, comment=None):
    with open(path, "w", encoding="utf-8") as f:
        f.write(format_calibration(cal, comment))


# ---------------------------------------------------------------------------------------------
# windows, features, score

def windows(n, window, stride):
    """[(a, b)] token ranges of the answer's windows: starts 0, stride, ... while
    start + window < n, then [n - window, n); one window [0, n) when n <= window; none when
    n == 0."""
    if window < 1 or stride < 1:
        raise ValueError("window and stride must be positive")
    if n <= 0:
        return []
    if n <= window:
        return [(0, n)]
    out = []
    a = 0
    while a + window < n:
        out.append((a, a + window))
        a += stride
    out.append((n - window, n))
    return out


def signal_arrays(sig):
    """The token_signals map as float64 arrays of one length; ValueError when an array is
    missing or the lengths differ."""
    out = {}
    n = None
    for k in SIGNALS:
        if k not in sig:
            raise ValueError("token_signals has no %r array" % k)
        a = np.asarray(sig[k], dtype=np.float64)
        if a.ndim != 1:
            raise ValueError("token_signals %r is not a flat array" % k)
        if n is None:
            n = len(a)
        elif len(a) != n:
            raise ValueError("token_signals %r has %d values, %r has %d" %
                             (k, len(a), SIGNALS[0], n))
        out[k] = a
    out["self_check"] = check_logodds(sig.get("self_check"))
    r = sig.get("context_reliance")
    out["context_reliance"] = math.nan if r is None else float(r)
    z = sig.get("hidden_probe")
    out["hidden_probe"] = math.nan if z is None else float(z)
    q = sig.get("quote_removed")   # a quoted answer's per-token array; absent: free text
    if q is not None:
        q = np.asarray(q, dtype=np.float64)
        if q.shape != (n,):
            raise ValueError("token_signals 'quote_removed' has %d values, not %d" % (len(q), n))
        out["quote_removed"] = q
    # the documents' tokens in the prompt (the reply's usage.context_tokens); absent: unknown
    c = sig.get("context_tokens")
    out["log_context_tokens"] = math.nan if c is None else math.log1p(float(c))
    return out


# the rows of a reply's hidden_states, in the order a probe's weights take them
HIDDEN_ROWS = ("first", "mean", "last")


def probe_keys(cal, context_tokens):
    """The keys of the probe a calibration reads for a prompt of context_tokens documents'
    tokens: LONG_PROBE_KEYS from long_probe_from on, SHORT_PROBE_KEYS under short_probe_until,
    else PROBE_KEYS (daemon/grounding.c gr_probe_logit)."""
    if "long_probe_from" in cal and context_tokens >= cal["long_probe_from"]:
        return LONG_PROBE_KEYS
    if "short_probe_until" in cal and context_tokens < cal["short_probe_until"]:
        return SHORT_PROBE_KEYS
    return PROBE_KEYS


def probe_logit(cal, hidden, context_tokens=0):
    """The calibration's hidden-state probe over a reply's hidden_states (the residual stream
    of its layers: "first", "mean" and "last" rows; weights of two rows take the first two),
    clipped as the daemon clips it; the probe that probe_keys picks for context_tokens (the
    prompt's documents' tokens). NaN when the reply has no row of the probe's layer or its rows
    are not of the probe's dim."""
    if not hidden or "probe_layer" not in cal or cal["probe_layer"] not in hidden["layers"]:
        return math.nan
    i = hidden["layers"].index(cal["probe_layer"])
    keys = probe_keys(cal, context_tokens)
    w = np.asarray(cal[keys[1]], np.float64)
    bias = cal[keys[2]]
    dim = len(hidden["first"][i])
    if not dim or len(w) not in (2 * dim, 3 * dim):
        return math.nan
    rows = HIDDEN_ROWS[:len(w) // dim]
    if any(k not in hidden for k in rows):
        return math.nan
    x = np.concatenate([np.asarray(hidden[k][i], np.float64) for k in rows])
    return float(np.clip(bias + x @ w, -PROBE_CLIP, PROBE_CLIP))


def clipped_logit(p, clip):
    """log(p / (1 - p)) clipped to +-clip; None: NaN."""
    if p is None:
        return math.nan
    p = float(p)
    if p <= 0.0:
        return -clip
    if p >= 1.0:
        return clip
    return min(clip, max(-clip, math.log(p) - math.log1p(-p)))


def probe_from_reply(p):
    """The probe's logit from a reply's grounding.hidden_probe (its sigmoid); None: NaN."""
    return clipped_logit(p, PROBE_CLIP)


def check_logodds(p):
    """The self_check feature, log P(yes) - log P(no) clipped, from the reply's
    grounding.self_check, P(yes) / (P(yes) + P(no)); None (the check did not run): NaN."""
    return clipped_logit(p, CHECK_CLIP)


def window_features(sig, a, b):
    """The 12 features of tokens [a, b) in FEATURES order (sig: token_signals map, or the
    arrays of signal_arrays). The token_signals map may carry the reply's
    grounding.self_check under "self_check" and grounding.context_reliance under
    "context_reliance"; without them those features are NaN."""
    if not 0 <= a < b:
        raise ValueError("empty window [%d, %d)" % (a, b))
    s = sig if all(isinstance(sig.get(k), np.ndarray) for k in SIGNALS) else signal_arrays(sig)
    lp = s["logprob"][a:b]
    if len(lp) != b - a:
        raise ValueError("window [%d, %d) past the %d tokens" % (a, b, len(s["logprob"])))
    doc = s["doc_mass"][a:b].sum()
    gen = s["gen_mass"][a:b].sum()
    lookback = doc / (doc + gen) if doc + gen != 0 else 0.0
    return np.array([lp.mean(), lp.min(), s["entropy"][a:b].mean(), s["margin"][a:b].mean(),
                     lookback, s["diff_doc_mass"][a:b].mean(), s["unsupported"][a:b].mean(),
                     s.get("self_check", math.nan), s.get("context_reliance", math.nan),
                     s.get("hidden_probe", math.nan),
                     s["quote_removed"][a:b].mean() if "quote_removed" in s else math.nan,
                     s.get("log_context_tokens", math.nan)],
                    dtype=np.float64)


def request_windows(sig, window, stride):
    """(list of (a, b), matrix of window features in FEATURES order) of one answer."""
    s = signal_arrays(sig)
    ws = windows(len(s["logprob"]), window, stride)
    feats = np.array([window_features(s, a, b) for a, b in ws], dtype=np.float64)
    return ws, feats.reshape(len(ws), len(FEATURES))


def sigmoid(z):
    """The logistic function, stable at both ends (an array, or a number as a 0-d array)."""
    z = np.asarray(z, dtype=np.float64)
    return np.where(z >= 0, 1.0 / (1.0 + np.exp(-np.abs(z))),
                    np.exp(-np.abs(z)) / (1.0 + np.exp(-np.abs(z))))


def length_offset(cal, log_context):
    """The calibration's length offset at log_context = ln(1 + the documents' tokens) (an array
    or a number): 0 without length_tokens; linear in log_context between the knots, the end
    knots' offsets beyond them (daemon/grounding.c gr_length_offset)."""
    if "length_tokens" not in cal:
        return np.zeros_like(np.asarray(log_context, dtype=np.float64))
    if np.any(np.isnan(log_context)):
        raise ValueError("calibration %s has a length offset: the signals need context_tokens "
                         "(the reply's usage.context_tokens)" % cal.get("name"))
    return np.interp(log_context, np.log1p(cal["length_tokens"]), cal["length_offset"])


def window_scores(cal, feats):
    """Logistic scores of rows of window features (FEATURES order) under a calibration; a NaN
    feature (a self-check that did not run) adds nothing, as in the daemon. The length offset
    is read at the rows' log_context_tokens."""
    feats = np.asarray(feats, dtype=np.float64)
    cols = [FEATURES.index(f) for f in cal["features"]]
    x = (feats[:, cols] - cal["mean"]) / cal["scale"]
    x = np.where(np.isnan(x), 0.0, x)
    off = length_offset(cal, feats[:, FEATURES.index("log_context_tokens")])
    return sigmoid(cal["bias"] + off + x @ cal["weights"])


def score(cal, sig):
    """(request score, [window scores]) of one answer's token_signals; (None, []) for an
    answer of no tokens, or without the probe's logit when the calibration weighs it (the
    daemon does not score such an answer)."""
    _, feats = request_windows(sig, cal["window"], cal["stride"])
    if len(feats) == 0:
        return None, []
    if "hidden_probe" in cal["features"] and np.isnan(feats[0][FEATURES.index("hidden_probe")]):
        return None, []
    ws = window_scores(cal, feats)
    return float(ws.max()), [float(x) for x in ws]


# ---------------------------------------------------------------------------------------------
# detector metrics (label 1 = hallucinated, higher score = more likely hallucinated)

def _check(labels, scores):
    y = np.asarray(labels, dtype=np.int64)
    s = np.asarray(scores, dtype=np.float64)
    if y.shape != s.shape or y.ndim != 1:
        raise ValueError("labels and scores must be flat arrays of one length")
    if np.any((y != 0) & (y != 1)):
        raise ValueError("labels must be 0 or 1")
    return y, s


def roc_curve(labels, scores):
    """(fpr, tpr) arrays from (0, 0) to (1, 1), one point per distinct score (ties step
    diagonally)."""
    y, s = _check(labels, scores)
    order = np.argsort(-s, kind="mergesort")
    y, s = y[order], s[order]
    last = np.r_[np.nonzero(np.diff(s))[0], len(s) - 1] if len(s) else np.array([], int)
    tp = np.cumsum(y)[last]
    fp = (last + 1) - tp
    pos, neg = y.sum(), len(y) - y.sum()
    tpr = np.r_[0.0, tp / pos] if pos else np.r_[0.0, np.zeros(len(tp))]
    fpr = np.r_[0.0, fp / neg] if neg else np.r_[0.0, np.zeros(len(fp))]
    return fpr, tpr


def auroc(labels, scores):
    """Area under the ROC curve (Mann-Whitney: ties count one half); None without both
    labels."""
    y, s = _check(labels, scores)
    pos, neg = int(y.sum()), int(len(y) - y.sum())
    if pos == 0 or neg == 0:
        return None
    # average ranks of the scores, ties shared
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    ss = s[order]
    i = 0
    while i < len(ss):
        j = i
        while j + 1 < len(ss) and ss[j + 1] == ss[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return float((ranks[y == 1].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def auprc(labels, scores):
    """Average precision (the step-wise area under the precision-recall curve, ties taken
    together); None without a positive label."""
    y, s = _check(labels, scores)
    pos = int(y.sum())
    if pos == 0:
        return None
    order = np.argsort(-s, kind="mergesort")
    y, s = y[order], s[order]
    last = np.r_[np.nonzero(np.diff(s))[0], len(s) - 1]
    tp = np.cumsum(y)[last].astype(np.float64)
    precision = tp / (last + 1)
    recall = tp / pos
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def at_threshold(labels, scores, threshold):
    """Confusion figures of flag = score >= threshold: dict of tp, fp, fn, tn, precision,
    recall, f1 and fpr (None where undefined)."""
    y, s = _check(labels, scores)
    flag = s >= threshold
    tp = int(np.sum(flag & (y == 1)))
    fp = int(np.sum(flag & (y == 0)))
    fn = int(np.sum(~flag & (y == 1)))
    tn = int(np.sum(~flag & (y == 0)))
    precision = tp / (tp + fp) if tp + fp else None
    recall = tp / (tp + fn) if tp + fn else None
    f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else None
    fpr = fp / (fp + tn) if fp + tn else None
    return {"tp": tp, "fp": fp, "fn": fn, "tn": tn, "precision": precision, "recall": recall,
            "f1": f1, "fpr": fpr}


def f1_at(labels, scores, threshold):
    return at_threshold(labels, scores, threshold)["f1"]


def fpr_at(labels, scores, threshold):
    return at_threshold(labels, scores, threshold)["fpr"]


def best_f1_threshold(labels, scores, max_fpr=None):
    """(threshold, f1): the score threshold among the observed scores that maximises F1
    (the lowest such threshold on ties); (0.5, None) without a positive label. With max_fpr,
    only thresholds whose false-positive rate is at most max_fpr compete (the highest observed
    score above every score when none is: nothing flagged)."""
    y, s = _check(labels, scores)
    if y.sum() == 0:
        return 0.5, None
    best = (None, -1.0)
    for t in np.unique(s):
        m = at_threshold(y, s, t)
        if max_fpr is not None and m["fpr"] is not None and m["fpr"] > max_fpr:
            continue
        f = m["f1"]
        if f is not None and f > best[1]:
            best = (float(t), f)
    if best[0] is None:
        return float(np.nextafter(s.max(), np.inf)), 0.0
    return best
