#!/usr/bin/env python3
"""Answers a user can trust, measured through diffragd on held-out SQuAD 2.0 articles (the
test split of tools/grounding-eval.py: articles the calibration never saw), answerable and
unanswerable questions, over contexts of a band of lengths each (by default about 2K and about
16K tokens), in both answer modes.

Contexts are whole SQuAD paragraphs sent inline, placed whole and in document order
(relevance_floor 0, order "document"), so the questions over one context share its prefill:
  up to 4K   the gold paragraph and the paragraphs around it in its article
  above      an article's paragraphs and those of the next articles of the split
Each question is asked greedily in `free` and in `quote` mode with policy `mark`; what policy
`decline` makes of the same answer is what it would decline: an answer the detector flags or a
refusal (retrieval always matches here, so no `no_match`).

With --other-questions K, each context is also asked K answerable questions of the split's
other articles, none of whose paragraphs it holds: questions the documents do not answer at
all, as a user asks of documents that are not about the thing asked (SQuAD's unanswerable
questions are written against their paragraph, and ask about what it mentions). They are
labelled as unanswerable questions are and reported in rows of their own ("free, others").

  right        an answerable question whose answer contains a gold answer (SQuAD's
               normalisation)
  hallucinated an answerable question answered wrong, or an unanswerable one answered
               without the refusal (the label of tools/grounding-eval.py)

Per band and mode: right answers; unanswerable questions declined; right answers kept under
`decline` (not flagged, not refused); right answers flagged; hallucinated answers flagged; AUROC
of the detector's score (hallucinated against not) and, in quote mode, of the removed mass
alone (its mean over the answer, and its largest token value). A second table says what the
targets ask of the model's answers: its wrong answers split into answerable questions answered
wrong and unanswerable ones answered; the AUROC of a detector that knew only which questions
are unanswerable; and the most any threshold on the score declines with 90% of the right
answers kept.

With --report FILE --refit FIT --lengths it fits a calibration's length offset on the fit
split's answers FIT (`make eval-trust`) and reports FILE's answers under it; with --long-probe
TOKENS it first fits a probe for prompts of at least TOKENS documents' tokens on FIT's answers
of that length, and with --short-probe TOKENS one for prompts under TOKENS on the answers the
calibration's own probe scores (they need their hidden states: --hidden-layers). The
calibration's earlier probes for long and short prompts are not kept: the offset is fitted on
the out-of-fold logits of the probes it will read. With --report FILE --calibration CAL alone,
FILE's answers are scored again under CAL (from the signals and rows they keep) and reported.

  tools/eval-trust.py --bands 2048,16384 --contexts 12,3 --per-context 4,16 --json out.jsonl
"""
import argparse
import json
import math
import pathlib
import random
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import eval_common as ec  # noqa: E402
import grounding_features as gf  # noqa: E402

CHARS_PER_TOKEN = 4.3   # English Wikipedia text in the default model's tokenizer
MAX_TOKENS = 48
MODEL_CONTEXT = 32768   # the default model's context
LOGIT_CLIP = 40.0       # a score of 0 or 1 as a logit, for the length offset's fit


def split_articles(passages, split):
    """[(title, [paragraphs in order])] of a split, in file order (passages: by id)."""
    arts = {}
    for p in passages.values():
        if ec.article_split(p["title"]) == split:
            arts.setdefault(p["title"], []).append(p)
    return list(arts.items())


def fill(paras, budget_chars):
    """The longest prefix of paras within budget_chars (at least one paragraph)."""
    out, n = [], 0
    for p in paras:
        if out and n + len(p["text"]) > budget_chars:
            break
        out.append(p)
        n += len(p["text"])
    return out


def pick_questions(qs, n):
    """Up to n questions, half answerable, half not, in file order."""
    a = [q for q in qs if not q["is_impossible"]]
    u = [q for q in qs if q["is_impossible"]]
    k = min(n // 2, len(a), len(u))
    return a[:k] + u[:k]


def contexts(band, n_ctx, per_ctx, articles, by_passage):
    """[(paragraphs, questions)] for one band."""
    budget = band * CHARS_PER_TOKEN * 0.92   # the frame and the labels take the rest
    out = []
    if band <= 4096:
        # a context around each chosen gold paragraph, at most four an article
        for ai in range(len(articles)):
            if len(out) >= n_ctx:
                break
            title, paras = articles[ai]
            taken, n_taken = set(), 0
            for i, p in enumerate(paras):
                if n_taken >= 4 or len(out) >= n_ctx:
                    break
                qs = pick_questions(by_passage.get(p["id"], []), per_ctx)
                if len(qs) < 2 or i in taken:
                    continue
                n_taken += 1
                # the gold paragraph with its neighbours, before it and after it in turn
                lo = hi = i
                while True:
                    grown = False
                    for j in (hi + 1, lo - 1):
                        if 0 <= j < len(paras) and sum(len(x["text"]) for x in paras[min(lo, j):max(hi, j) + 1]) <= budget:
                            lo, hi = min(lo, j), max(hi, j)
                            grown = True
                    if not grown:
                        break
                out.append((paras[lo:hi + 1], qs))
                taken |= set(range(lo, hi + 1))
        return out
    ai = -1
    while len(out) < n_ctx and ai + 1 < len(articles):   # the later articles shrink below
        ai += 1
        title, paras = articles[ai]
        pool = list(paras)
        for _, more in articles[ai + 1:]:
            if sum(len(p["text"]) for p in pool) > budget:
                break
            pool += more
        ctx = fill(pool, budget)
        qs = []
        for p in ctx:
            qs += by_passage.get(p["id"], [])
        qs = pick_questions(qs, per_ctx)
        if len(qs) >= per_ctx // 2:
            out.append((ctx, qs))
        articles = articles[:ai + 1] + [a for a in articles[ai + 1:] if a[1][0] not in ctx]
    return out


def other_questions(ctx, k, questions, passages, start):
    """k answerable questions of the split whose articles have no paragraph in ctx: the
    documents do not hold their answers. They are asked as unanswerable ones are (right only
    when refused), under ids of their own ("QID@FIRST-PARAGRAPH"). Taken in the pool's order
    (main shuffles it once) from `start` on, going round; returns (questions, where the next
    context starts)."""
    titles = {p["title"] for p in ctx}
    out, i = [], start
    for _ in range(len(questions)):
        if len(out) == k:
            break
        q = questions[i % len(questions)]
        i += 1
        if passages[q["gold_passage_id"]]["title"] not in titles:
            out.append(dict(q, id="%s@%s" % (q["id"], ctx[0]["id"]), is_impossible=True,
                            other_article=True))
    return out, i


def daemon_context(bands):
    """The daemon's context: room for the largest band, within the default model's 32,768
    less the daemon's largest answer (max_tokens 1,024 by default)."""
    return min(max(bands) * 2, MODEL_CONTEXT - 1024)


def ask(asker, q, ctx, band, mode, timeout, hidden=False, context=MODEL_CONTEXT):
    msg = {"v": 1, "op": "query", "id": "%s-%d-%s" % (q["id"], band, mode),
           "question": q["question"],
           "docs": [{"id": p["id"], "title": p["title"].replace("_", " "), "text": p["text"]}
                    for p in ctx],
           "max_context_tokens": min(int(band * 1.25) + 512, context - MAX_TOKENS - 8),
           "relevance_floor": 0,
           "order": "document", "max_tokens": MAX_TOKENS, "temperature": 0,
           "answer_mode": mode, "unsupported": "mark",
           "include": ["token_signals"] + (["hidden_states"] if hidden else [])}
    r = asker.ask(msg, timeout)
    if not r.get("ok"):
        raise ec.EvalError("%s: %s" % (q["id"], r.get("error")))
    g = r["grounding"]
    text = r["answer"]
    abstained = bool(g["abstained"]) or ec.declined(text)
    right = not q["is_impossible"] and ec.contains(text, q["answers"])
    qr = r["token_signals"].get("quote_removed") or []
    return {"id": q["id"], "band": band, "mode": mode, "is_impossible": q["is_impossible"],
            "other_article": q.get("other_article", False), "article": ctx[0]["title"],
            "question": q["question"], "gold": q["answers"], "answer": text,
            "right": right, "abstained": abstained,
            "hallucinated": (not abstained) if q["is_impossible"] else not right,
            "score": g["score"], "flagged": g["flagged"],
            "quote_removed": g["quote_removed"], "quote_removed_max": max(qr) if qr else None,
            "hidden_probe": g["hidden_probe"], "token_signals": r["token_signals"],
            "context_tokens": r["usage"]["context_tokens"],
            "left_out": r["context"]["chunks_left_out"],
            "cached_tokens": r["usage"]["cached_tokens"],
            "total_ms": r["timings"]["total_ms"], "passages": [p["id"] for p in ctx],
            "hidden_states": r.get("hidden_states")}


def signals_of(r):
    """An answer's token_signals with what the calibration's scalar features read: the probe's
    logit (from the reply's hidden_probe) and the documents' tokens."""
    return dict(r["token_signals"], context_tokens=r["context_tokens"],
                hidden_probe=gf.probe_from_reply(r["hidden_probe"]))


def rescore(results, cal):
    """Each result's score and flag under another calibration (the signals are the reply's; the
    probe's logit is computed again from the reply's hidden states where it kept them, so that
    a new probe is the one scored)."""
    for r in results:
        keys = gf.probe_keys(cal, r["context_tokens"]) if "probe_layer" in cal else None
        if r.get("hidden_states") and keys:
            z = gf.probe_logit(cal, r["hidden_states"], r["context_tokens"])
            r["hidden_probe"] = None if math.isnan(z) else float(gf.sigmoid(z))
        elif keys and keys != gf.PROBE_KEYS:
            which = "long" if keys == gf.LONG_PROBE_KEYS else "short"
            raise ec.EvalError("%s: an answer over %d documents' tokens without its hidden "
                               "states cannot be scored by the %s probe (ask with "
                               "--hidden-layers)" % (r["id"], r["context_tokens"], which))
        r["score"] = float(gf.score(cal, signals_of(r))[0]) if r["token_signals"]["logprob"] \
            else None
        r["flagged"] = None if r["score"] is None else (r["score"] >= cal["threshold"] and
                                                        not r["abstained"])


def grounding_eval():
    """tools/grounding-eval.py as a module (its fits)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "grounding_eval", pathlib.Path(__file__).resolve().parent / "grounding-eval.py")
    ge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ge)
    return ge


def squad_case(r):
    """An answer as tools/grounding-eval.py's fits take its case (grouped by article)."""
    return {"kind": "squad", "id": r["id"], "docs": [{"title": r["article"]}]}


def prompts_of(lo, hi):
    """Words for the prompts of lo to under hi documents' tokens (hi = inf: lo or more; lo = 0:
    under hi)."""
    if hi == math.inf:
        return "of %d documents' tokens or more" % lo
    if lo == 0:
        return "under %d documents' tokens" % hi
    return "of %d to under %d documents' tokens" % (lo, hi)


def fit_ranged_probe(fit_results, base, keys, bound, lo, hi, applies):
    """A probe for a range of prompt lengths (keys: gf.LONG_PROBE_KEYS or gf.SHORT_PROBE_KEYS,
    the first one set to `bound`): tools/grounding-eval.py's probe fit (the base probe's layer
    and rows, L2 by cross-validation grouped by article) on the fit answers of lo to under hi
    documents' tokens. Returns (the base calibration with it and without a length offset, the
    fit answers with the hidden_probe of those it scores (`applies`) replaced by their
    out-of-fold logit, so that a length offset fitted on them is not fitted on the probe's own
    answers, the fit's info)."""
    if "probe_layer" not in base:
        raise ec.EvalError("--%s-probe needs a calibration with a probe" % keys[0].split("_")[0])
    chosen = [r for r in fit_results if lo <= r["context_tokens"] < hi]
    if any(not r.get("hidden_states") for r in chosen):
        raise ec.EvalError("the fit answers %s need their hidden states (ask with "
                           "--hidden-layers %d)" % (prompts_of(lo, hi), base["probe_layer"]))
    ge = grounding_eval()
    rows = [(squad_case(r), {"hidden_states": r["hidden_states"]}, int(r["hallucinated"]))
            for r in chosen]
    probe, oof, info = ge.train_probe(rows, base["probe_layer"], ge.probe_kinds(base, rows))
    cal = {k: v for k, v in base.items() if k not in gf.LENGTH_KEYS + keys}
    cal.update({keys[0]: int(bound), keys[1]: probe["probe_weights"],
                keys[2]: probe["probe_bias"]})
    logit = {id(r): float(z) for r, z in zip(chosen, oof) if applies(r)}
    out = [dict(r, hidden_probe=float(gf.sigmoid(logit[id(r)]))) if id(r) in logit else r
           for r in fit_results]
    return cal, out, info


def fit_long_probe(fit_results, base, tokens):
    """--long-probe: a probe for prompts of at least `tokens` documents' tokens, fitted on the
    fit answers of that length (fit_ranged_probe)."""
    return fit_ranged_probe(fit_results, base, gf.LONG_PROBE_KEYS, tokens, tokens, math.inf,
                            lambda r: True)


def fit_short_probe(fit_results, base, tokens):
    """--short-probe: a probe for prompts under `tokens` documents' tokens, fitted on every fit
    answer the base probe scores (those under the long probe's length, when it has one: the
    short range alone holds too few answers to fit one) and scored out of fold on those under
    `tokens` (fit_ranged_probe)."""
    hi = base.get("long_probe_from", math.inf)
    if tokens > hi:
        raise ec.EvalError("--short-probe %d is above --long-probe %d" % (tokens, hi))
    return fit_ranged_probe(fit_results, base, gf.SHORT_PROBE_KEYS, tokens, 0, hi,
                            lambda r: r["context_tokens"] < tokens)


def refit(fit_results, base, features, max_fpr):
    """The base calibration's combination fitted again on these answers (its watch and probes
    kept), with `features`: tools/grounding-eval.py's procedure (L2 by cross-validation grouped
    by article, threshold at the best out-of-fold F1 within max_fpr)."""
    ge = grounding_eval()
    if any("article" not in r for r in fit_results):
        passages, questions = ec.load_squad()
        title = {q["id"]: passages[q["gold_passage_id"]]["title"] for q in questions}
        for r in fit_results:
            r.setdefault("article", title[r["id"]])
    rows = [(squad_case(r), {"token_signals": signals_of(r)}, int(r["hallucinated"]))
            for r in fit_results if r["token_signals"]["logprob"]]
    cal, info = ge.train(rows, features, base["window"], base["stride"], max_fpr=max_fpr)
    for k in ("name", "model_sha256", "watch") + gf.PROBE_KEYS + gf.LONG_PROBE_KEYS + \
            gf.SHORT_PROBE_KEYS:
        if k in base:
            cal[k] = base[k]
    return cal, info, len(rows)


def fit_length_offsets(fit_results, base, max_fpr):
    """The base calibration with a length offset (length_tokens, length_offset) fitted on these
    answers, its combination and probe unchanged: a knot at each band's median documents'
    tokens, and each knot's offset the highest at which at most max_fpr of the band's right
    answers score at or above the base's threshold, the offset read at each answer's own
    length as the daemon reads it (between knots it is interpolated, so the knots are settled
    together, a band at a time until none moves). Returns (calibration, [(band, knot tokens,
    right answers, the base threshold the knot's offset amounts to, offset)])."""
    cal0 = {k: v for k, v in base.items() if k not in gf.LENGTH_KEYS}
    lt = gf.clipped_logit(base["threshold"], LOGIT_CLIP)
    bands = sorted({r["band"] for r in fit_results})
    knots, right = [], []   # right: per band, (ln(1 + tokens), logit of the base score)
    for band in bands:
        rs = [r for r in fit_results if r["band"] == band and r["token_signals"]["logprob"]]
        ok = [r for r in rs if not r["hallucinated"] and not r["abstained"]]
        if len(ok) < 5:
            raise ec.EvalError("band %d has %d right answers: too few to place its threshold" %
                               (band, len(ok)))
        tok = int(sorted(r["context_tokens"] for r in rs)[len(rs) // 2])
        if knots and tok <= knots[-1]:
            raise ec.EvalError("band %d: median documents' tokens %d not above the last band's "
                               "%d" % (band, tok, knots[-1]))
        knots.append(tok)
        right.append((np.log1p([r["context_tokens"] for r in ok]),
                      np.array([gf.clipped_logit(gf.score(cal0, signals_of(r))[0], LOGIT_CLIP)
                                for r in ok])))
    xk = np.log1p(knots)
    offsets = [0.0] * len(bands)

    def flagged_share(i, offs):
        lc, z = right[i]
        return float(np.mean(z + np.interp(lc, xk, offs) >= lt))
    for _ in range(50):
        moved = 0.0
        for i in range(len(bands)):
            lo, hi = -60.0, 60.0    # flags none at lo, all at hi
            for _ in range(100):
                mid = (lo + hi) / 2
                trial = offsets[:i] + [mid] + offsets[i + 1:]
                if flagged_share(i, trial) <= max_fpr:
                    lo = mid
                else:
                    hi = mid
            lo -= 1e-9   # off the crossing point, where rounding could still flag it
            moved = max(moved, abs(lo - offsets[i]))
            offsets[i] = lo
        if moved < 1e-9:
            break
    info = [(band, tok, len(right[i][1]), 1 / (1 + math.exp(offsets[i] - lt)), offsets[i])
            for i, (band, tok) in enumerate(zip(bands, knots))]
    cal = dict(cal0, length_tokens=np.array(knots, float), length_offset=np.array(offsets))
    return cal, info


def choose_bound(fit_results, base, target, bounds=(0.05, 0.1, 0.15, 0.2), folds=5):
    """The largest of `bounds` whose length offset, fitted on four fifths of the fit split's
    articles and tried on the rest (5 folds), flags at most `target` of the right answers of
    every band; the smallest when none does. Returns (bound, {bound: {band: share}})."""
    arts = sorted({r["article"] for r in fit_results})
    order = np.random.default_rng(0).permutation(len(arts))
    fold = {a: order[i] % folds for i, a in enumerate(arts)}
    table = {}
    for bound in bounds:
        hit = {}
        for k in range(folds):
            cal, _ = fit_length_offsets([r for r in fit_results if fold[r["article"]] != k],
                                        base, bound)
            for r in fit_results:
                if fold[r["article"]] == k and r["right"] and not r["abstained"] and \
                        r["token_signals"]["logprob"]:
                    f = gf.score(cal, signals_of(r))[0] >= cal["threshold"]
                    n = hit.setdefault(r["band"], [0, 0])
                    n[0] += f
                    n[1] += 1
        table[bound] = {b: f / n for b, (f, n) in sorted(hit.items())}
    ok = [b for b in bounds if all(v <= target for v in table[b].values())]
    return (max(ok) if ok else min(bounds)), table


def share(rs, key):
    return (sum(1 for r in rs if r[key]) / len(rs), len(rs)) if rs else (math.nan, 0)


def auroc(rs, key):
    xs = [(r[key], r["hallucinated"]) for r in rs if r[key] is not None]
    pos = [x for x, h in xs if h]
    neg = [x for x, h in xs if not h]
    if not pos or not neg:
        return math.nan
    v = gf.auroc([1] * len(pos) + [0] * len(neg), pos + neg)
    return math.nan if v is None else v


def cells(results):
    """(band, mode, its results) for every band and mode that has results, in band order; the
    questions of other articles (--other-questions) in rows of their own, their mode named
    "MODE, others"."""
    for band in sorted({r["band"] for r in results}):
        for mode in ("free", "quote"):
            for other in (False, True):
                rs = [r for r in results if r["band"] == band and r["mode"] == mode and
                      r.get("other_article", False) == other]
                if rs:
                    yield band, mode + (", others" if other else ""), rs


def most_declined(rs, keep=0.9):
    """What any threshold on the score can do under `decline`: the largest share of the
    unanswerable questions declined (flagged above the threshold, or refused) while at least
    `keep` of the right answers are kept, and that share kept. (nan, nan) without both."""
    right = [r for r in rs if r["right"]]
    u = [r for r in rs if r["is_impossible"]]
    if not right or not u:
        return math.nan, math.nan
    best = (math.nan, math.nan)
    scores = sorted({r["score"] for r in rs if r["score"] is not None}) + [math.inf]
    for t in scores:
        kept = sum(1 for r in right if not r["abstained"] and
                   (r["score"] is None or r["score"] <= t)) / len(right)
        if kept < keep:
            continue
        declined = sum(1 for r in u if r["abstained"] or
                       (r["score"] is not None and r["score"] > t)) / len(u)
        if not declined <= best[0]:   # also takes the first (nan)
            best = (declined, kept)
    return best


def bounds(results):
    """Per band and mode, what the targets ask of the model's answers: how its wrong answers
    split, the AUROC a detector would reach if it knew which questions are unanswerable and
    nothing else, and the most the score can decline with 90 % of the right answers kept."""
    lines = ["| band | mode | right | answerable, answered wrong | unanswerable, answered | "
             "AUROC knowing only which are unanswerable | at best under decline: unanswerable "
             "declined / right kept |", "|" + "---|" * 7]
    for band, mode, rs in cells(results):
        for r in rs:
            r["unanswerable"] = float(r["is_impossible"])
        # without answerable questions (the others' rows) there is nothing to rank against
        answerable = any(not r["is_impossible"] for r in rs)
        lines.append("| %d | %s | %d | %d | %d | %.3f | %.2f / %.2f |" % (
            band, mode, sum(1 for r in rs if r["right"]),
            sum(1 for r in rs if r["hallucinated"] and not r["is_impossible"]),
            sum(1 for r in rs if r["hallucinated"] and r["is_impossible"]),
            auroc(rs, "unanswerable") if answerable else math.nan, *most_declined(rs)))
    return "\n".join(lines)


def report(results):
    lines = ["| band | mode | n | right (answerable) | unanswerable declined | right kept under "
             "decline | right flagged | hallucinated flagged | AUROC score | AUROC removed mass "
             "(mean / max) | context tokens (median) |", "|" + "---|" * 11]
    for band, mode, rs in cells(results):
        a = [r for r in rs if not r["is_impossible"]]
        u = [r for r in rs if r["is_impossible"]]
        right = [r for r in a if r["right"]]
        hal = [r for r in rs if r["hallucinated"]]
        for r in rs:
            r["declines"] = bool(r["flagged"]) or r["abstained"]
            r["kept"] = not r["declines"]
        ctx = sorted(r["context_tokens"] for r in rs)
        rm = "%.3f / %.3f" % (auroc(rs, "quote_removed"), auroc(rs, "quote_removed_max")) \
            if mode == "quote" else "-"
        lines.append("| %d | %s | %d | %.2f (%d of %d) | %.2f (%d of %d) | %.2f (%d of %d) | "
                     "%.2f | %.2f (%d of %d) | %.3f | %s | %d |" % (
                         band, mode, len(rs), share(a, "right")[0], len(right), len(a),
                         share(u, "declines")[0], sum(r["declines"] for r in u), len(u),
                         share(right, "kept")[0], sum(r["kept"] for r in right), len(right),
                         share(right, "flagged")[0], share(hal, "flagged")[0],
                         sum(bool(r["flagged"]) for r in hal), len(hal),
                         auroc(rs, "score") if a else math.nan,
                         rm, ctx[len(ctx) // 2]))
    return "\n".join(lines) + "\n\n" + bounds(results)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ec.QWEN_MODEL))
    ap.add_argument("--bands", default="2048,16384", help="context sizes in tokens")
    ap.add_argument("--contexts", default="12,3", help="contexts per band")
    ap.add_argument("--per-context", default="4,16", help="questions per context, per band")
    ap.add_argument("--modes", default="free,quote")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--split", default="test", choices=("test", "fit"),
                    help="the articles asked about (default test: those no calibration saw)")
    ap.add_argument("--squad", default=str(ec.DEFAULT_SQUAD))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per question")
    ap.add_argument("--other-questions", default="0", metavar="K,...",
                    help="also ask, over every context of a band, K answerable questions of the "
                         "split's other articles (the documents do not hold them; reported in "
                         "rows of their own); one number per band, or one for all")
    ap.add_argument("--hidden-layers", help="the daemon's grounding_hidden_layers (e.g. 14): "
                    "every result keeps those layers' residual-stream rows, for a probe's fit")
    ap.add_argument("--json", help="append every result here (JSON lines); the questions "
                    "whose answers it holds already (at that band and mode) are not asked again")
    ap.add_argument("--report", help="only report the results of this JSON lines file")
    ap.add_argument("--refit", metavar="FIT_JSONL",
                    help="with --report: fit the calibration's combination again on these "
                         "(fit-split) answers, then report --report's answers under it")
    ap.add_argument("--lengths", action="store_true",
                    help="with --refit: fit only a length offset (the calibration's combination "
                         "and probe kept), its threshold per band at --max-fpr of the right "
                         "answers")
    ap.add_argument("--long-probe", type=int, metavar="TOKENS",
                    help="--refit --lengths: first fit a probe for prompts of at least TOKENS "
                         "documents' tokens on the fit answers of that length")
    ap.add_argument("--short-probe", type=int, metavar="TOKENS",
                    help="--refit --lengths: first fit a probe for prompts under TOKENS "
                         "documents' tokens on the fit answers the calibration's probe scores "
                         "(under --long-probe's TOKENS)")
    ap.add_argument("--calibration", help="the calibration --refit starts from; with "
                    "--report alone, the answers are scored again under it")
    ap.add_argument("--features", help="--refit's features (default: the calibration's)")
    ap.add_argument("--max-fpr", type=float, default=0.2, help="--refit's threshold bound")
    ap.add_argument("--choose-fpr", type=float, metavar="TARGET",
                    help="--refit --lengths: instead of --max-fpr, the largest bound of 0.05, "
                         "0.1, 0.15 and 0.2 that flags at most TARGET of every band's right "
                         "answers in 5-fold cross-validation over the fit split's articles")
    ap.add_argument("--name", help="--refit's calibration name")
    ap.add_argument("--write", help="--refit: write the calibration here")
    args = ap.parse_args()
    if args.report:
        results = [json.loads(l) for l in open(args.report)]
        if args.calibration and not args.refit:
            # the answers scored again under this calibration, from their signals and rows
            rescore(results, gf.read_calibration(args.calibration))
        if args.refit:
            base = gf.read_calibration(args.calibration)
            feats = args.features.split(",") if args.features else list(base["features"])
            fit = [json.loads(l) for l in open(args.refit)]
            if (args.long_probe is not None or args.short_probe is not None) and \
                    not args.lengths:
                raise SystemExit("eval-trust: --long-probe and --short-probe go with --refit "
                                 "--lengths")
            if args.lengths:
                # the base's probes for long and short prompts are fitted again or dropped: a
                # length offset is fitted on the out-of-fold logits of the probes it reads
                base = {k: v for k, v in base.items()
                        if k not in gf.LONG_PROBE_KEYS + gf.SHORT_PROBE_KEYS}
                probe_note = ""
                for which, tokens, fit_probe in (("long", args.long_probe, fit_long_probe),
                                                 ("short", args.short_probe, fit_short_probe)):
                    if tokens is None:
                        continue
                    base, fit, info = fit_probe(fit, base, tokens)
                    span = prompts_of(tokens, math.inf) if which == "long" else \
                        prompts_of(0, tokens)
                    print("%s probe (prompts %s): %d answers, L2 %g, grouped CV AUROC %.3f" %
                          (which, span, info["n"], info["lambda"], info["cv_auroc"]))
                    probe_note += (" A probe for prompts %s (layer %d, L2 %g, grouped 5-fold "
                                   "CV AUROC %.3f over %d answers), the offset fitted on its "
                                   "out-of-fold logits." % (span, base["probe_layer"],
                                                            info["lambda"], info["cv_auroc"],
                                                            info["n"]))
                if args.choose_fpr is not None:
                    args.max_fpr, table = choose_bound(fit, base, args.choose_fpr)
                    for bound, shares in table.items():
                        print("bound %.2f: right answers flagged out of fold %s" % (
                            bound, " ".join("%d:%.2f" % kv for kv in shares.items())))
                    print("bound %.2f: the largest that flags at most %.2f in every band" % (
                        args.max_fpr, args.choose_fpr))
                cal, info = fit_length_offsets(fit, base, args.max_fpr)
                if args.name:
                    cal["name"] = args.name
                for band, tok, n, th, off in info:
                    print("band %d: knot %d tokens, %d right answers, threshold %.4f, offset "
                          "%+.4f" % (band, tok, n, th, off))
                if args.write:
                    # the base's own comments (how its combination and probe were fitted) stay
                    kept = [l[1:].strip() for l in open(args.calibration) if l.startswith("#")
                            and "with a length offset fitted by" not in l]
                    gf.write_calibration(args.write, cal, comment="\n".join(kept + [
                        "The combination and probe of %s with a length offset fitted by "
                        "tools/eval-trust.py --refit --lengths"
                        " on %d answers of the fit split (%s): per band, the threshold that "
                        "flags at most %g of its right answers, moved onto the threshold." % (
                            base["name"], len(fit), ", ".join(
                                "%d tokens" % tok for _, tok, _, _, _ in info), args.max_fpr)
                        + probe_note]))
                rescore(results, cal)
                print(report(results))
                return 0
            cal, info, n = refit(fit, base, feats, args.max_fpr)
            if args.name:
                cal["name"] = args.name
            print("refit on %d answers: features %s; L2 %g, grouped CV AUROC %.3f; threshold "
                  "%.3f" % (n, ",".join(feats), info["lambda"], info["cv_auroc"],
                            cal["threshold"]))
            if args.write:
                gf.write_calibration(args.write, cal, comment=(
                    "Fitted by tools/eval-trust.py --refit on %d answers of the fit split at "
                    "2K-16K tokens in both answer modes (L2 %g, grouped 5-fold CV AUROC %.3f); "
                    "threshold = max F1 on out-of-fold scores with a false-positive rate of at "
                    "most %g. The hidden-state probe is the base calibration's (%s)." % (
                        n, info["lambda"], info["cv_auroc"], args.max_fpr, base["name"])))
            rescore(results, cal)
        print(report(results))
        return 0
    passages, questions = ec.load_squad(args.squad)
    by_passage = {}
    for q in questions:
        by_passage.setdefault(q["gold_passage_id"], []).append(q)
    articles = split_articles(passages, args.split)
    in_split = {t for t, _ in articles}
    others = [q for q in questions if not q["is_impossible"] and
              passages[q["gold_passage_id"]]["title"] in in_split]
    random.Random(1).shuffle(others)   # a context's K come from several articles
    next_other = 0
    bands = [int(x) for x in args.bands.split(",")]
    n_ctx = [int(x) for x in args.contexts.split(",")]
    per = [int(x) for x in args.per_context.split(",")]
    n_other = [int(x) for x in args.other_questions.split(",")]
    n_other = n_other * len(bands) if len(n_other) == 1 else n_other
    if len(n_other) != len(bands):
        raise SystemExit("eval-trust: --other-questions needs one number, or one per band")
    modes = args.modes.split(",")
    results = []
    done = set()   # answers already in --json are kept there and not asked again
    if args.json and pathlib.Path(args.json).exists():
        done = {(r["id"], r["band"], r["mode"]) for r in map(json.loads, open(args.json))}
    out = open(args.json, "a") if args.json else None
    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="eval-trust-") as work, \
                ec.LocalDaemon(work, args.model, threads=args.threads,
                               max_context_tokens=daemon_context(bands),
                               **({"grounding_hidden_layers": args.hidden_layers}
                                  if args.hidden_layers else {})) as d, \
                ec.Asker(d.endpoint, d.proc) as asker:
            for band, nc, pc, k in zip(bands, n_ctx, per, n_other):
                for ctx, qs in contexts(band, nc, pc, articles, by_passage):
                    if k:
                        more, next_other = other_questions(ctx, k, others, passages,
                                                           next_other)
                        qs = qs + more
                    for q in qs:
                        for mode in modes:
                            if (q["id"], band, mode) in done:
                                continue
                            r = ask(asker, q, ctx, band, mode, args.timeout,
                                    hidden=bool(args.hidden_layers),
                                    context=daemon_context(bands))
                            results.append(r)
                            print(json.dumps({k: r[k] for k in ("band", "mode", "right",
                                                                 "hallucinated", "score",
                                                                 "quote_removed", "answer",
                                                                 "context_tokens",
                                                                 "cached_tokens")}),
                                  file=sys.stderr, flush=True)
                            if out:
                                out.write(json.dumps(r) + "\n")
                                out.flush()
    except ec.EvalError as e:
        print("eval-trust: %s" % e, file=sys.stderr)
        return 2
    print("model %s; %d answers in %.0f s" % (pathlib.Path(args.model).name, len(results),
                                              time.time() - t0))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
