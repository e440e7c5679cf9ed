#!/usr/bin/env python3
"""Calibrates and evaluates diffragd's groundedness detector (docs/groundedness.md) on cases
whose truth holds by construction: needle facts inside SQuAD haystacks (present, absent,
distractor, conflict) and SQuAD 2.0 questions over their gold paragraph.

  generate   write labelled cases (JSON lines) for the fit and test splits
  run        send them to diffragd (started here on loopback, or at --endpoint) and keep
             each reply's answer, grounding figures and token_signals (resumable)
  fit        logistic regression on the fit split's answer windows -> a calibration file
  report     held-out AUROC, AUPRC, F1, FPR per condition, length and signal set -> markdown
             and a ROC plot (PNG)
  all        the four in order: what `make eval-grounding` runs

Label rules, splits and sizes are documented in docs/groundedness.md (Evaluation).
"""
import argparse
import hashlib
import json
import os
import pathlib
import re
import shlex
import struct
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import venv_python  # noqa: E402
venv_python.use_project_venv("numpy", "gguf")

import numpy as np  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import grounding_features as gf  # noqa: E402
import eval_common as ec  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SQUAD = ec.DEFAULT_SQUAD
DEFAULT_WORK = ROOT / "build" / "grounding-eval"
REFUSAL = "i cannot find the answer in the provided documents"

# Feature sets compared in the report; "combined" is the calibration the daemon loads.
# the engine's and the lexical signals; the hidden-state probe joins them when one is fitted
BASE = [f for f in gf.FEATURES if f not in ("self_check", "context_reliance", "hidden_probe")]
SIGNAL_SETS = {
    "combined": BASE,
    "combined + reliance": BASE + ["context_reliance"],
    "combined + self-check": BASE + ["self_check"],
    "log-probability": ["mean_logprob", "min_logprob", "mean_entropy", "mean_margin"],
    "lexical": ["unsupported_ratio"],
    "attention": ["lookback", "diff_doc_mass"],
    "self-check": ["self_check"],
    "context reliance": ["context_reliance"],
}
SET_COLOURS = {"combined": (0, 0, 0), "combined + self-check": (148, 103, 189),
               "combined + reliance": (140, 86, 75), "context reliance": (227, 119, 194),
               "log-probability": (31, 119, 180),
               "lexical": (255, 127, 14), "attention": (44, 160, 44),
               "self-check": (214, 39, 40), "combined without the probe": (127, 127, 127),
               "hidden-state probe": (23, 190, 207)}
CONDITIONS = ("present", "absent", "distractor", "conflict", "squad-answerable",
              "squad-unanswerable", "squad-other-paragraph")
# the condition reported apart from the held-out totals: a retrieval that missed, whose answers
# the detector separates far more easily than SQuAD 2.0's own questions
APART = "squad-other-paragraph"

# ---------------------------------------------------------------------------------------------
# case generation

# Needle templates. Fit and test use disjoint templates, entity names, values and haystack
# articles. Each title shares a word with its question so that BM25 places the haystack even
# when the needle is absent (a chunk matching no question term is never retrieved).
TEMPLATES = {
    "fit": [
        {"title": "Vault register",
         "needle": "The access code of the {name} vault is {value}.",
         "question": "What is the access code of the {name} vault?"},
        {"title": "Expedition notes",
         "needle": "The {name} expedition catalogued its last specimen under number {value}.",
         "question": "Under which number did the {name} expedition catalogue its last specimen?"},
        {"title": "Shipping register",
         "needle": "The freighter of {name} Shipping is registered under hull number {value}.",
         "question": "What hull number is the freighter of {name} Shipping registered under?"},
        {"title": "Lighthouse staff records",
         "needle": "The lighthouse keeper {name} wore badge number {value}.",
         "question": "Which badge number did the lighthouse keeper {name} wear?"},
    ],
    "test": [
        {"title": "Locker assignments",
         "needle": "The locker assigned to {name} in the east wing is number {value}.",
         "question": "Which locker number is assigned to {name} in the east wing?"},
        {"title": "Observatory log",
         "needle": "The {name} observatory logged the comet under catalogue entry {value}.",
         "question": "Under which catalogue entry did the {name} observatory log the comet?"},
        {"title": "Harbour reports",
         "needle": "Inspector {name} filed the harbour report with reference {value}.",
         "question": "What reference did Inspector {name} file the harbour report with?"},
        {"title": "Laboratory inventory",
         "needle": "The {name} laboratory keeps its reference sample in freezer slot {value}.",
         "question": "In which freezer slot does the {name} laboratory keep its reference "
                     "sample?"},
    ],
}
NAMES = {
    "fit": ["Halvorsen", "Brennick", "Castellane", "Dunmore", "Ekwall", "Fairholt", "Garroway",
            "Hesketh", "Isberg", "Jarrow", "Kellerman", "Lindqvist", "Marchetti", "Norgaard",
            "Ostrander", "Pendry", "Quarles", "Rosenvald", "Thorsby", "Vasquez", "Wexford",
            "Yardley", "Zelinski", "Abernath", "Birkeland", "Crowther", "Dalgaard", "Eastwick",
            "Falkenberg", "Greaves"],
    "test": ["Ashdown", "Blomqvist", "Carraway", "Delacroix", "Engstrom", "Fenwick", "Gilchrist",
             "Holmberg", "Janssen", "Kowalczyk", "Larkspur", "Mortensen", "Nyberg", "Oakhurst",
             "Ravensworth", "Sandoval", "Tennant", "Underhill", "Valdemar", "Whitcombe",
             "Zamora", "Albrecht", "Bergstrom", "Cunliffe", "Ellery", "Fairbanks", "Hartigan",
             "Lindgren", "Moncrieff", "Pemberton"],
}
SEEDS = {"fit": 1001, "test": 2002}
LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"  # no I or O: never read as 1 or 0
# A value the answer asserts: a run of letters, digits and inner hyphens containing a digit.
VALUE_RE = re.compile(r"[A-Za-z0-9]+(?:-[A-Za-z0-9]+)*")
CITATION_RE = re.compile(r"\[\d+(?:\s*,\s*\d+)*\]")


# a user-facing failure: missing data, a daemon that does not start, a bad file
EvalError = ec.EvalError


article_split = ec.article_split


def load_squad(squad_dir):
    """(passages in file order, questions in file order)."""
    by_id, questions = ec.load_squad(squad_dir)
    return list(by_id.values()), questions


def tokenizer(model):
    """A Hugging Face BPE tokenizer from the GGUF's vocabulary and merges (SmolLM2's
    pre-tokenizer), used only to size haystacks; the reply's usage gives exact counts."""
    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    r = gguf.GGUFReader(str(model))

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    vocab = {t: i for i, t in enumerate(strings("tokenizer.ggml.tokens"))}
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    tk = Tokenizer(models.BPE(vocab, merges))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    return tk


def make_value(rng, used):
    """A fresh code in one of three shapes (7Q-4412, KX-20917, 4471-B), never seen before."""
    while True:
        shape = rng.integers(3)
        if shape == 0:
            v = "%d%s-%04d" % (rng.integers(1, 10), LETTERS[rng.integers(len(LETTERS))],
                               rng.integers(10000))
        elif shape == 1:
            v = "%s%s-%05d" % (LETTERS[rng.integers(len(LETTERS))],
                               LETTERS[rng.integers(len(LETTERS))], rng.integers(100000))
        else:
            v = "%04d-%s" % (rng.integers(1000, 10000), LETTERS[rng.integers(len(LETTERS))])
        if v not in used:
            used.add(v)
            return v


def build_haystack(rng, pool, n_tokens, tok_count):
    """Paragraphs drawn from pool (no repeats) until within 16 tokens of n_tokens; one that
    would overshoot is cut at a sentence end (or skipped). Returns (paragraphs, token counts,
    each with its paragraph break)."""
    paras, counts, total = [], [], 0
    for i in rng.permutation(len(pool)):
        left = n_tokens - total
        if left < 16:
            break
        text = pool[i]["text"].strip()
        n = tok_count(text) + 1
        if n > left:
            part = ""
            for sentence in re.split(r"(?<=[.!?])\s+", text):
                cand = (part + " " + sentence).strip()
                if tok_count(cand) + 1 > left:
                    break
                part = cand
            if not part:
                continue
            text, n = part, tok_count(part) + 1
        paras.append(text)
        counts.append(n)
        total += n
    if total < n_tokens - 16:
        raise EvalError("the article pool is too small for a %d-token haystack" % n_tokens)
    return paras, counts


def boundary_at(counts, depth):
    """Index of the sentence boundary (0..len) nearest to depth (0..1) of the tokens."""
    cum = np.r_[0, np.cumsum(counts)]
    return int(np.argmin(np.abs(cum - depth * cum[-1])))


def sentences_of(paras, tok_count):
    """Each paragraph as its list of sentences, and the token count of every sentence in
    order (paragraph breaks and spaces counted as one token each)."""
    sents = [re.split(r"(?<=[.!?])\s+", p) for p in paras]
    return sents, [tok_count(x) + 1 for ss in sents for x in ss]


def join_with(sents, insert):
    """The haystack text with each (global sentence boundary, text) of insert placed there as
    a sentence of the paragraph it falls in (the start of a paragraph when it falls between
    two)."""
    sents = [list(ss) for ss in sents]
    starts = np.cumsum([0] + [len(ss) for ss in sents[:-1]])
    for g, text in sorted(insert, key=lambda x: -x[0]):
        p = int(np.searchsorted(starts, g, side="right") - 1)
        sents[p].insert(g - int(starts[p]), text)
    return "\n\n".join(" ".join(ss) for ss in sents)


def needle_cases(split, lengths, per_length, passages, tok_count, used_values):
    rng = np.random.default_rng(SEEDS[split])
    pool = [p for p in passages if article_split(p["title"]) == split]
    all_text = " ".join(p["text"] for p in passages)
    names = [n for n in NAMES[split] if not re.search(r"\b%s\b" % n, all_text)]
    templates = TEMPLATES[split]
    cases = []
    serial = 0
    for length, count in zip(lengths, per_length):
        for i in range(count):
            depth = i / (count - 1) if count > 1 else 0.5
            t = templates[serial % len(templates)]
            serial += 1
            name, other = rng.choice(names, 2, replace=False)
            value, value2, dvalue = (make_value(rng, used_values) for _ in range(3))
            paras, _ = build_haystack(rng, pool, length, tok_count)
            sents, counts = sentences_of(paras, tok_count)
            at = boundary_at(counts, depth)
            at2 = boundary_at(counts, (depth + 0.5) % 1.0)
            if at2 == at:  # both statements at one place: put the second one after the first
                at2 = at + 1 if at < len(counts) else at - 1
            needle = t["needle"].format(name=name, value=value)
            conflict = t["needle"].format(name=name, value=value2)
            distractor = t["needle"].format(name=other, value=dvalue)
            near = (distractor + " " + needle) if rng.integers(2) else (needle + " " + distractor)
            question = t["question"].format(name=name)
            base = {"split": split, "kind": "needle", "length": length,
                    "depth": round(float(np.r_[0, np.cumsum(counts)][at] / sum(counts)), 3),
                    "template": templates.index(t), "entity": name, "question": question}

            def doc(insert):
                return [{"id": "haystack", "title": t["title"],
                         "text": join_with(sents, insert)}]
            cid = "%s-n%d-%02d" % (split, length, i)
            cases.append(dict(base, id=cid + "-present", condition="present",
                              docs=doc([(at, needle)]), supported=[value], other=[]))
            cases.append(dict(base, id=cid + "-absent", condition="absent", docs=doc([]),
                              supported=[], other=[]))
            cases.append(dict(base, id=cid + "-distractor", condition="distractor",
                              docs=doc([(at, near)]), supported=[value], other=[dvalue]))
            # the second statement at the opposite depth
            cases.append(dict(base, id=cid + "-conflict", condition="conflict",
                              docs=doc([(at, needle), (at2, conflict)]),
                              supported=[value, value2], other=[]))
    return cases


def squad_cases(split, count, passages, questions):
    """`count` SQuAD questions of the split's articles, half of them unanswerable."""
    rng = np.random.default_rng(SEEDS[split] + 1)
    by_id = {p["id"]: p for p in passages}
    mine = [q for q in questions if article_split(by_id[q["gold_passage_id"]]["title"]) == split]
    cases = []
    for impossible in (False, True):
        qs = [q for q in mine if q["is_impossible"] == impossible]
        n = count // 2 if not impossible else count - count // 2
        for j in rng.choice(len(qs), min(n, len(qs)), replace=False):
            q = qs[j]
            p = by_id[q["gold_passage_id"]]
            cases.append({"id": "%s-squad-%s" % (split, q["id"]), "split": split,
                          "kind": "squad",
                          "condition": "squad-unanswerable" if impossible else "squad-answerable",
                          "length": "squad", "question": q["question"],
                          "docs": [{"id": p["id"], "title": p["title"].replace("_", " "),
                                    "text": p["text"]}],
                          "answers": q["answers"]})
    return cases


def other_paragraph_cases(split, squad, passages):
    """For each answerable question among the split's SQuAD cases, the question asked over
    another paragraph of its article, one that holds none of its gold answers: the paragraph a
    retrieval that missed would place. An answer other than the refusal is unsupported."""
    rng = np.random.default_rng(SEEDS[split] + 2)
    by_id, by_title = {p["id"]: p for p in passages}, {}
    for p in passages:
        by_title.setdefault(p["title"], []).append(p)
    cases = []
    for c in squad:
        if c["condition"] != "squad-answerable":
            continue
        gold = c["docs"][0]["id"]
        golds = [" %s " % normalise(a) for a in c["answers"] if normalise(a)]
        pool = [p for p in by_title[by_id[gold]["title"]] if p["id"] != gold and
                not any(g in " %s " % normalise(p["text"]) for g in golds)]
        if not pool:
            continue
        p = pool[rng.integers(len(pool))]
        cases.append(dict(c, id=c["id"].replace("-squad-", "-other-"),
                          condition="squad-other-paragraph",
                          docs=[{"id": p["id"], "title": c["docs"][0]["title"],
                                 "text": p["text"]}]))
    return cases


def cmd_generate(args):
    passages, questions = load_squad(args.squad)
    tk = tokenizer(args.model)
    cache = {}

    def tok_count(text):
        if text not in cache:
            cache[text] = len(tk.encode(text).ids)
        return cache[text]
    if len(args.per_length) != len(args.lengths):
        raise EvalError("--per-length needs one count per --lengths entry")
    used = set()
    cases = []
    for split in args.splits:
        cases += needle_cases(split, args.lengths, args.per_length, passages, tok_count, used)
        count = args.squad_questions
        if split == "fit" and args.fit_squad_questions is not None:
            count = args.fit_squad_questions
        squad = squad_cases(split, count, passages, questions)
        cases += squad
        if split in args.other_paragraph:
            cases += other_paragraph_cases(split, squad, passages)
    out = pathlib.Path(args.cases)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for c in cases:
            f.write(json.dumps(c) + "\n")
    print("wrote %d cases to %s" % (len(cases), out))


# ---------------------------------------------------------------------------------------------
# running cases through diffragd

def daemon_keys(calibration, threads, max_context, extra):
    """The config keys of the run's diffragd (eval_common.LocalDaemon adds the loopback
    endpoints, the store and the log)."""
    # one chunk per haystack: the chunker ends a chunk at the first paragraph break past half
    # of chunk_tokens, so chunk_tokens is twice the prompt budget; no overlap
    keys = {"threads": threads, "max_context_tokens": max_context,
            "chunk_tokens": min(2 * max_context, 65536), "chunk_overlap": 0, "max_tokens": 256,
            # every signal is collected, the self-check too, so that the report measures each
            # one's worth
            "grounding_self_check": 1, "grounding_reliance": 1,
            # without a calibration the daemon watches its default heads (grounding_heads auto)
            "grounding_calibration": calibration or "none"}
    for kv in extra:
        k, _, v = kv.partition("=")
        keys[k] = v
    return keys


def query_message(case, max_tokens, max_context, hidden=False):
    return {"v": 1, "op": "query", "id": case["id"], "question": case["question"],
            "docs": case["docs"], "top_k": 1, "max_context_tokens": max_context,
            "max_tokens": max_tokens, "temperature": 0,
            "include": ["token_signals"] + (["hidden_states"] if hidden else [])}


def ask(sock, msg, timeout):
    import msgpack
    sock.send(msgpack.packb(msg))
    end = time.time() + timeout
    while True:
        left = end - time.time()
        if left <= 0 or not sock.poll(int(left * 1000)):
            raise EvalError("no reply to %s within %.0f s" % (msg["id"], timeout))
        r = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
        if r.get("id") == msg["id"] and ("ok" in r):
            return r


def error_code(reply):
    e = reply.get("error")
    return e.get("code") if isinstance(e, dict) else e


def run_cases(cases, endpoint, results_path, max_tokens, max_context, timeout, log=print,
              hidden=False):
    """Send each case not yet in results_path; append one JSON line per reply (with the
    residual stream of the daemon's grounding_hidden_layers when `hidden`)."""
    import zmq
    done = set()
    if results_path.exists():
        for line in open(results_path):
            done.add(json.loads(line)["id"])
    todo = [c for c in cases if c["id"] not in done]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    t_all = time.time()
    try:
        with open(results_path, "a") as out:
            for i, c in enumerate(todo):
                t = time.time()
                r = ask(sock, query_message(c, max_tokens, max_context, hidden), timeout)
                retried = not r.get("ok") and error_code(r) == "internal"
                if retried:  # a lost worker: once more, as the daemon itself would
                    r = ask(sock, query_message(c, max_tokens, max_context, hidden), timeout)
                rec = {"id": c["id"], "wall_s": round(time.time() - t, 3), "ok": r.get("ok"),
                       "retried": retried,
                       "error": r.get("error"),
                       "answer": r.get("answer"), "finish_reason": r.get("finish_reason"),
                       "usage": r.get("usage"), "citations": r.get("citations"),
                       "grounding": r.get("grounding"), "token_signals": r.get("token_signals")}
                if hidden:
                    rec["hidden_states"] = r.get("hidden_states")
                out.write(json.dumps(rec) + "\n")
                out.flush()
                if (i + 1) % 10 == 0 or i + 1 == len(todo):
                    log("  %d/%d cases, %.0f s" % (i + 1, len(todo), time.time() - t_all))
    finally:
        sock.close(0)
        ctx.term()
    return time.time() - t_all


def read_jsonl(path):
    path = pathlib.Path(path)
    if not path.exists():
        raise EvalError("%s missing" % path)
    return [json.loads(line) for line in open(path) if line.strip()]


def read_results(path):
    """The replies, each one's grounding.self_check and grounding.context_reliance carried
    into its token_signals map, where tools/grounding_features.py reads them."""
    out = read_jsonl(path)
    for r in out:
        if r.get("token_signals") is not None:
            g = r.get("grounding") or {}
            r["token_signals"]["self_check"] = g.get("self_check")
            r["token_signals"]["context_reliance"] = g.get("context_reliance")
            z = gf.probe_from_reply(g.get("hidden_probe"))
            r["token_signals"]["hidden_probe"] = None if np.isnan(z) else z
    return out


def cmd_run(args):
    cases = read_jsonl(args.cases)
    results = pathlib.Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    if args.fresh and results.exists():
        results.unlink()
    hidden = bool(args.hidden_layers)
    if args.endpoint:
        took = run_cases(cases, args.endpoint, results, args.max_tokens, args.max_context,
                         args.timeout, hidden=hidden)
    else:
        extra = args.daemon_arg + (["grounding_hidden_layers=" + args.hidden_layers]
                                   if hidden else [])
        with ec.LocalDaemon(results.parent / "daemon", args.model,
                            **daemon_keys(args.calibration, args.threads, args.max_context,
                                          extra)) as d:
            took = run_cases(cases, d.endpoint, results, args.max_tokens, args.max_context,
                             args.timeout, hidden=hidden)
    print("ran %d cases in %.0f s" % (len(cases), took))


# ---------------------------------------------------------------------------------------------
# labels

def normalise(text):
    """SQuAD-style: lowercase, punctuation and articles dropped, spaces collapsed."""
    text = re.sub(r"[^\w\s]", " ", text.lower())
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def own_abstained(answer):
    a = answer.strip().lower()
    return a.startswith(REFUSAL)


def asserted_values(answer):
    """Values (upper-cased) the answer states: digit-bearing runs, citation markers removed."""
    text = CITATION_RE.sub(" ", answer)
    return {m.group(0).upper() for m in VALUE_RE.finditer(text) if re.search(r"\d", m.group(0))}


def placed_text(case, res):
    """The document text the prompt held (the cited byte range of the one document)."""
    text = case["docs"][0]["text"].encode()
    cites = res.get("citations") or []
    return "".join(text[c["offsets"][0]:c["offsets"][1]].decode(errors="replace")
                   for c in cites)


def label(case, res):
    """(label, note): 1 hallucinated, 0 not, None unlabelled (note says why)."""
    if not res.get("ok"):
        e = res.get("error")
        return None, "error %s" % (e if not isinstance(e, dict) else
                                   "%s (%s)" % (e.get("code"), e.get("message")))
    if not res.get("citations"):
        return None, "no document placed"
    g = res.get("grounding") or {}
    abstained = g.get("abstained") if "abstained" in g else own_abstained(res["answer"])
    if abstained:
        return 0, "abstained"
    if case["kind"] == "needle":
        cites = res["citations"]
        if len(cites) != 1 or cites[0]["offsets"] != [0, len(case["docs"][0]["text"].encode())]:
            return None, "haystack not placed whole"
        # hallucinated: a code-shaped value that is nowhere in the documents, or none of the
        # values the documents give for the asked entity (a distractor's value is neither)
        placed = placed_text(case, res)
        in_docs = {m.group(0).upper() for m in VALUE_RE.finditer(placed)}
        own = {v.upper() for v in case["supported"]} & in_docs
        said = asserted_values(res["answer"])
        if said - in_docs:
            return 1, "value not in the documents"
        if not said & own:
            return 1, "no value of the entity"
        return 0, "the entity's value"
    answer = " %s " % normalise(res["answer"])
    if case["condition"] == "squad-unanswerable":
        return 1, "unanswerable answered"
    if case["condition"] == "squad-other-paragraph":
        return 1, "answered from a paragraph without the answer"
    if any(" %s " % normalise(a) in answer for a in case["answers"] if normalise(a)):
        return 0, "gold answer"
    return 1, "no gold answer"


# ---------------------------------------------------------------------------------------------
# logistic regression

def fit_logistic(x, y, w, lam):
    """Weighted L2-regularised logistic regression by Newton's method on standardised x:
    (weights, bias). The bias is not penalised."""
    n, d = x.shape
    xb = np.c_[x, np.ones(n)]
    beta = np.zeros(d + 1)
    reg = np.r_[np.full(d, lam), 0.0]
    for _ in range(100):
        p = 1.0 / (1.0 + np.exp(-np.clip(xb @ beta, -40, 40)))
        grad = xb.T @ (w * (p - y)) + reg * beta
        hess = (xb * (w * p * (1 - p))[:, None]).T @ xb + np.diag(reg) + 1e-9 * np.eye(d + 1)
        step = np.linalg.solve(hess, grad)
        beta -= step
        if np.max(np.abs(step)) < 1e-10:
            break
    return beta[:d], float(beta[d])


def answer_windows(items, window, stride):
    """Stack the windows of labelled answers: (features, label per window, answer index,
    weight per window = 1 / windows of its answer)."""
    feats, ys, idx, ws = [], [], [], []
    for k, (res, y) in enumerate(items):
        _, f = gf.request_windows(res["token_signals"], window, stride)
        feats.append(f)
        ys += [y] * len(f)
        idx += [k] * len(f)
        ws += [1.0 / len(f)] * len(f)
    return (np.vstack(feats), np.array(ys, float), np.array(idx), np.array(ws))


def request_scores(cal, items):
    return np.array([gf.score(cal, res["token_signals"])[0] for res, _ in items])


def group_folds(groups, folds):
    """Each answer's fold: the groups (case_group) spread over `folds` in an order drawn from a
    fixed seed, so that no group is in two folds."""
    names = sorted(set(groups))
    order = np.random.default_rng(0).permutation(len(names))
    at = {g: order[i] % folds for i, g in enumerate(names)}
    return np.array([at[g] for g in groups])


def train(rows, features, window, stride, lam_grid=(0.01, 0.1, 1.0, 10.0), folds=5,
          max_fpr=None):
    """Fit on labelled rows ([(case, result, label)]): L2 strength by k-fold cross-validation on
    request AUROC (folds by case_group), then a final fit on all; threshold = the out-of-fold
    request score (each fold's answers scored by the fit without them, at the chosen strength)
    with maximal F1 among those with a false-positive rate of at most max_fpr on them, when
    given: a bound that holds for answers the fit has seen holds less well for those it has
    not."""
    items = [(r, lab) for _, r, lab in rows]
    x_all, y, idx, w = answer_windows(items, window, stride)
    cols = [gf.FEATURES.index(f) for f in features]
    x = x_all[:, cols]
    labels = np.array([lab for _, lab in items])

    def fit(rows):
        # a self-check that did not run is NaN: left out of its mean and scale, and 0 (its
        # mean) once standardised, as the daemon scores it
        mean = np.nan_to_num(np.nanmean(x[rows], 0))
        scale = np.nan_to_num(np.nanstd(x[rows], 0))
        scale[scale < 1e-12] = 1.0
        return mean, scale

    def std(rows, mean, scale):
        return np.nan_to_num((x[rows] - mean) / scale)

    def make_cal(mean, scale, weights, bias, threshold=0.5):
        return {"name": "fit", "model_sha256": "0" * 64, "window": window, "stride": stride,
                "threshold": threshold, "watch": [], "features": list(features),
                "mean": mean, "scale": scale, "weights": weights, "bias": bias}
    fold_of = group_folds([case_group(c) for c, _, _ in rows], folds)
    best = None
    for lam in lam_grid:
        pred = np.zeros(len(items))
        for k in range(folds):
            tr = fold_of[idx] != k
            mean, scale = fit(tr)
            wt, b = fit_logistic(std(tr, mean, scale), y[tr], w[tr], lam)
            cal = make_cal(mean, scale, wt, b)
            held = [i for i in range(len(items)) if fold_of[i] == k]
            pred[held] = request_scores(cal, [items[i] for i in held])
        a = gf.auroc(labels, pred)
        if best is None or (a or 0) > best[1]:
            best = (lam, a or 0, pred)
    lam, _, oof = best
    rows = np.ones(len(y), bool)
    mean, scale = fit(rows)
    wt, b = fit_logistic(std(rows, mean, scale), y, w, lam)
    cal = make_cal(mean, scale, wt, b)
    threshold, f1 = gf.best_f1_threshold(labels, oof, max_fpr)
    cal["threshold"] = float(threshold)
    return cal, {"lambda": lam, "cv_auroc": best[1], "fit_f1": f1}


def labelled(cases, results, split):
    """[(case, result, label)] of one split with a label and answer tokens; and a count of the
    rest by reason."""
    by_id = {r["id"]: r for r in results}
    out, skipped = [], {}
    for c in cases:
        if c["split"] != split:
            continue
        r = by_id.get(c["id"])
        if r is None:
            skipped["not run"] = skipped.get("not run", 0) + 1
            continue
        lab, note = label(c, r)
        if lab is not None and not r.get("token_signals"):
            lab, note = None, "no token_signals in the reply"
        elif lab is not None and not r["token_signals"].get("logprob"):
            lab, note = None, "empty answer"
        if lab is None:
            skipped[note] = skipped.get(note, 0) + 1
            continue
        out.append((c, r, lab))
    return out, skipped


def model_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def default_watch(model):
    """The daemon's default watched heads for a llama- or qwen2-architecture GGUF
    (`grounding_heads` auto, engine_default_watch): every query head of the layers at 1/2 and
    3/4 depth."""
    import gguf
    r = gguf.GGUFReader(str(model))

    def field(key):
        f = r.fields.get(key)
        if f is None:
            raise EvalError("%s has no %s" % (model, key))
        return f.parts[f.data[0]]
    arch = bytes(field("general.architecture")).decode()
    if arch not in ("llama", "qwen2"):
        raise EvalError("default heads are known for llama and qwen2 models only; give --watch")
    layers = int(field(arch + ".block_count")[0])
    heads = int(field(arch + ".attention.head_count")[0])
    picked = sorted({layers // 2, 3 * layers // 4})
    return [(l, h) for l in picked for h in range(heads)]


def parse_watch(text):
    out = []
    for p in re.split(r"[,\s]+", text.strip()):
        m = re.fullmatch(r"([0-9]+):([0-9]+)", p)
        if not m:
            raise EvalError("--watch: %r is not LAYER:HEAD" % p)
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def threshold_rule(args):
    """How thresholds were chosen, beyond max F1: "" or " with a false-positive rate of at most X"."""
    m = getattr(args, "max_fpr", None)
    return "" if m is None else " with a false-positive rate of at most %g" % m


def case_group(case):
    """What answers share that a probe could memorise: a SQuAD question's article, a needle
    case's haystack (its four conditions)."""
    if case["kind"] == "squad":
        return "squad " + case["docs"][0]["title"]
    return "needle " + case["id"].rsplit("-", 1)[0]


def probe_rows(rows, layer, kinds):
    """(X, y, groups) of the rows whose reply has the residual stream of `layer`: X = the
    reply's rows of that layer named by kinds ("first", "mean", "last"), one after the other;
    the others are left out."""
    xs, ys, gs, keep = [], [], [], []
    for k, (c, r, lab) in enumerate(rows):
        h = r.get("hidden_states")
        if not h or layer not in h["layers"] or any(kind not in h for kind in kinds):
            continue
        i = h["layers"].index(layer)
        xs.append(np.concatenate([h[kind][i] for kind in kinds]))
        ys.append(lab)
        gs.append(case_group(c))
        keep.append(k)
    return np.array(xs, np.float64), np.array(ys, np.float64), gs, keep


def train_probe(rows, layer, kinds=gf.HIDDEN_ROWS[:2],
                lam_grid=(30.0, 100.0, 300.0, 1000.0, 3000.0), folds=5):
    """The hidden-state probe: an L2-regularised logistic regression of the label on the
    standardised rows of `layer` that kinds names (by default [first ; mean]), its strength
    chosen by k-fold cross-validation grouped by case_group (request AUROC), then fitted on all
    rows and written back in the units of the raw rows. Returns (probe keys for the
    calibration, out-of-fold logit of each row (NaN for a row without the layer), info)."""
    x, y, groups, keep = probe_rows(rows, layer, kinds)
    if len(set(y.tolist())) < 2 or len(y) < 2 * folds:
        raise EvalError("the probe needs answers of both labels with the %s rows of the "
                        "residual stream at layer %d (run with --hidden-layers %d)" %
                        ("/".join(kinds), layer, layer))
    fold = group_folds(groups, folds)

    def fit(tr, lam):
        mu, sd = x[tr].mean(0), x[tr].std(0)
        sd[sd < 1e-6] = 1.0
        w, b = fit_logistic((x[tr] - mu) / sd, y[tr], np.ones(int(tr.sum())), lam)
        return w / sd, b - float((w / sd) @ mu)

    best = None
    for lam in lam_grid:
        oof = np.zeros(len(y))
        for k in range(folds):
            w, b = fit(fold != k, lam)
            oof[fold == k] = x[fold == k] @ w + b
        a = gf.auroc(y, oof) or 0.0
        if best is None or a > best[1]:
            best = (lam, a, oof)
    lam, cv_auroc, oof = best
    w, b = fit(np.ones(len(y), bool), lam)
    logits = np.full(len(rows), np.nan)
    logits[keep] = np.clip(oof, -gf.PROBE_CLIP, gf.PROBE_CLIP)
    probe = {"probe_layer": layer, "probe_weights": w.astype(np.float32).astype(np.float64),
             "probe_bias": b}
    return probe, logits, {"lambda": lam, "cv_auroc": cv_auroc, "n": len(y)}


def probe_kinds(cal, rows):
    """The rows a calibration's probe weighs: its weights are two or three rows of the dim the
    replies' rows have."""
    for _, r, _ in rows:
        h = r.get("hidden_states")
        if h and h.get("first"):
            return gf.HIDDEN_ROWS[:len(cal["probe_weights"]) // len(h["first"][0])]
    return gf.HIDDEN_ROWS[:2]


def with_probe(rows, logits):
    """Each row's token_signals get its probe logit (the daemon's feature hidden_probe)."""
    for (_, r, _), z in zip(rows, logits):
        if r.get("token_signals") is not None:
            r["token_signals"]["hidden_probe"] = None if np.isnan(z) else float(z)


def cmd_fit(args):
    cases = read_jsonl(args.cases)
    results = read_results(args.results)
    rows, skipped = labelled(cases, results, "fit")
    labels = [lab for _, _, lab in rows]
    if len(set(labels)) < 2:
        raise EvalError("the fit split needs both labels (got %d answers, labels %s; "
                        "skipped %s)" % (len(rows), sorted(set(labels)), skipped))
    features = list(SIGNAL_SETS["combined"])
    probe = None
    if args.probe_layer is not None:
        if args.probe_rows not in (gf.HIDDEN_ROWS[:2], gf.HIDDEN_ROWS[:3]):
            raise EvalError("--probe-rows: first,mean or first,mean,last (the daemon weighs "
                            "the rows in that order)")
        # out-of-fold logits feed the combination, so that it does not learn to trust the
        # probe's fit-split confidence
        probe, logits, pinfo = train_probe(rows, args.probe_layer, args.probe_rows)
        with_probe(rows, logits)
        features.append("hidden_probe")
    cal, info = train(rows, features, args.window, args.stride, max_fpr=args.max_fpr)
    cal["name"] = args.name
    cal["model_sha256"] = model_sha256(args.model)
    cal["watch"] = default_watch(args.model) if args.watch == "auto" else parse_watch(args.watch)
    comment = ("Fitted by tools/grounding-eval.py fit on %d answers of the fit split "
               "(%d hallucinated): L2 %g (5-fold CV AUROC %.3f); threshold = max F1 on the fit "
               "split's out-of-fold scores%s (F1 %.3f)." % (
                   len(rows), sum(labels), info["lambda"], info["cv_auroc"],
                   threshold_rule(args), info["fit_f1"]))
    if probe:
        cal.update(probe)
        comment += ("\nThe hidden-state probe: layer %d, rows %s, L2 %g, grouped 5-fold CV "
                    "AUROC %.3f over %d answers." % (args.probe_layer, "/".join(args.probe_rows),
                                                     pinfo["lambda"], pinfo["cv_auroc"],
                                                     pinfo["n"]))
    gf.write_calibration(args.calibration_out, cal, comment)
    print("wrote %s: %s" % (args.calibration_out, comment))


# ---------------------------------------------------------------------------------------------
# report

def fmt(x, digits=3):
    return "–" if x is None else ("%.*f" % (digits, x))


def group_metrics(labels, scores, threshold):
    labels, scores = np.asarray(labels), np.asarray(scores)
    m = gf.at_threshold(labels, scores, threshold)
    return dict(m, n=len(labels), pos=int(labels.sum()), auroc=gf.auroc(labels, scores),
                auprc=gf.auprc(labels, scores))


def length_bucket(case, res):
    return "SQuAD paragraph" if case["kind"] == "squad" else "%d" % case["length"]


def png_write(path, img):
    """An RGB uint8 image (h, w, 3) as a PNG (zlib, no filter)."""
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(tag, data):
        return (struct.pack(">I", len(data)) + tag + data +
                struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


# 3x5 glyphs for tick labels and axis names
FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001010010010", "8": "111101111101111",
    "9": "111101111001111", ".": "000000000000010", "F": "111100110100100",
    "P": "111101111100100", "R": "110101110101101", "T": "111010010010010",
    "(": "001010010010001", ")": "100010010010100", "E": "111100110100111",
    "A": "010101111101101", "L": "100100100100111", "S": "111100111001111",
    "U": "101101101101111", "N": "101111111111101", "C": "111100100100111",
    "O": "111101101101111", "H": "101101111101101", "I": "111010010010111",
    " ": "000000000000000",
}


class Canvas:
    def __init__(self, w, h):
        self.img = np.full((h, w, 3), 255, np.uint8)

    def dot(self, x, y, colour, r=1):
        h, w, _ = self.img.shape
        x0, x1 = max(0, int(x) - r + 1), min(w, int(x) + r)
        y0, y1 = max(0, int(y) - r + 1), min(h, int(y) + r)
        self.img[y0:y1, x0:x1] = colour

    def line(self, xa, ya, xb, yb, colour, r=1, dash=0):
        n = int(max(abs(xb - xa), abs(yb - ya))) + 1
        for i in range(n + 1):
            if dash and (i // dash) % 2:
                continue
            t = i / n
            self.dot(xa + (xb - xa) * t, ya + (yb - ya) * t, colour, r)

    def text(self, x, y, s, colour=(0, 0, 0), k=2):
        for ch in s:
            g = FONT[ch]
            for i, bit in enumerate(g):
                if bit == "1":
                    self.img[y + (i // 3) * k:y + (i // 3 + 1) * k,
                             x + (i % 3) * k:x + (i % 3 + 1) * k] = colour
            x += 4 * k


def roc_png(path, curves):
    """ROC curves {name: (fpr, tpr)} on one plot: axes with ticks, the diagonal, one colour per
    signal set (the legend is in the report's text)."""
    size, left, top, plot = 520, 60, 20, 440
    c = Canvas(size, size)
    grey = (200, 200, 200)
    for i in range(6):
        v = i / 5
        x, y = left + v * plot, top + plot - v * plot
        c.line(x, top, x, top + plot, (235, 235, 235))
        c.line(left, y, left + plot, y, (235, 235, 235))
        c.line(x, top + plot, x, top + plot + 5, (0, 0, 0))
        c.line(left - 5, y, left, y, (0, 0, 0))
        lab = "%.1f" % v
        c.text(int(x - len(lab) * 4), top + plot + 9, lab)
        c.text(left - 10 - len(lab) * 8, int(y - 5), lab)
    c.line(left, top, left, top + plot, (0, 0, 0))
    c.line(left, top + plot, left + plot, top + plot, (0, 0, 0))
    c.line(left, top + plot, left + plot, top, grey, dash=6)
    c.text(left + plot // 2 - 20, top + plot + 24, "FPR")
    for i, ch in enumerate("TPR"):
        c.text(6, top + plot // 2 - 15 + i * 12, ch)
    for name in sorted(curves, key=lambda n: n == "combined"):  # combined drawn last, on top
        fpr, tpr = curves[name]
        r = 3 if name == "combined" else 2
        for j in range(len(fpr) - 1):
            c.line(left + fpr[j] * plot, top + plot - tpr[j] * plot, left + fpr[j + 1] * plot,
                   top + plot - tpr[j + 1] * plot, SET_COLOURS[name], r=r)
    png_write(path, c.img)


def report_command(argv):
    """The command line as run, paths inside the repository relative to it."""
    words = []
    for a in argv:
        p = pathlib.Path(a)
        if p.is_absolute():
            try:
                a = str(p.resolve().relative_to(ROOT))
            except ValueError:
                pass
        words.append(a)
    return shlex.join(words)


def cmd_report(args, run_seconds=None):
    cases = read_jsonl(args.cases)
    results = read_results(args.results)
    by_case = {c["id"]: c for c in cases}
    cal = gf.read_calibration(args.calibration)
    fit_rows, fit_skipped = labelled(cases, results, "fit")
    test_rows, test_skipped = labelled(cases, results, "test")
    apart_rows = [t for t in test_rows if t[0]["condition"] == APART]
    test_rows = [t for t in test_rows if t[0]["condition"] != APART]
    if not test_rows:
        raise EvalError("no labelled answers in the test split (skipped: %s)" % test_skipped)
    signal_sets = dict(SIGNAL_SETS)
    if "probe_layer" in cal:
        # held out: the calibration's probe, as the daemon computes it; the fit split: the
        # out-of-fold logits the calibration was fitted with
        with_probe(test_rows + apart_rows, [
            gf.probe_logit(cal, r.get("hidden_states"), r.get("usage", {}).get("context_tokens", 0))
            for _, r, _ in test_rows + apart_rows])
        _, logits, _ = train_probe(fit_rows, cal["probe_layer"], probe_kinds(cal, fit_rows))
        with_probe(fit_rows, logits)
        signal_sets = {"combined": cal["features"], "combined without the probe": BASE}
        signal_sets.update((k, v) for k, v in SIGNAL_SETS.items() if k != "combined")
        signal_sets["hidden-state probe"] = ["hidden_probe"]
    test_items = [(r, lab) for _, r, lab in test_rows]
    y = np.array([lab for _, lab in test_items])

    sets = {}
    for name, features in signal_sets.items():
        if name == "combined":
            c, info = cal, None
        else:
            c, info = train(fit_rows, features, cal["window"], cal["stride"],
                            max_fpr=getattr(args, "max_fpr", None))
        s = request_scores(c, test_items)
        sets[name] = {"cal": c, "info": info, "scores": s,
                      "all": group_metrics(y, s, c["threshold"]),
                      "apart": request_scores(c, [(r, lab) for _, r, lab in apart_rows])}

    conds = [k for k in CONDITIONS if any(cs["condition"] == k for cs, _, _ in test_rows)]
    lens = []
    for cs, r, _ in test_rows:
        b = length_bucket(cs, r)
        if b not in lens:
            lens.append(b)

    def groups(key):
        out = {}
        for i, (cs, r, _) in enumerate(test_rows):
            out.setdefault(key(cs, r), []).append(i)
        return out
    by_cond = groups(lambda cs, r: cs["condition"])
    by_len = groups(length_bucket)
    ctx_tokens = {}
    for cs, r, _ in test_rows:
        ctx_tokens.setdefault(length_bucket(cs, r), []).append(r["usage"]["context_tokens"])

    L = []
    L.append("# Groundedness detector: evaluation report")
    L.append("")
    L.append("Written by `tools/grounding-eval.py`; how the cases are built and labelled is in "
             "[groundedness.md](groundedness.md#evaluation). Held-out figures: the calibration "
             "and every threshold were fitted on the fit split only (disjoint articles, "
             "entities, values and question templates).")
    L.append("")
    L.append("- Model: `%s` (SHA-256 `%s`)" % (pathlib.Path(args.model).name,
                                              cal["model_sha256"]))
    L.append("- Calibration: `%s` (name `%s`; window %d, stride %d, threshold %.4f; watched "
             "heads %s)" % (report_command([args.calibration]), cal["name"], cal["window"],
                            cal["stride"], cal["threshold"],
                            " ".join("%d:%d" % p for p in cal["watch"])))
    ran = report_command([sys.argv[0]] + sys.argv[1:])
    L.append("- Command: " + ("`%s` (which runs `%s`)" % (args.command, ran) if args.command
                               else "`%s`" % ran))
    if run_seconds is not None:
        L.append("- Wall time of the run: %.0f s (generate, query, fit and report)" % run_seconds)
    mine = [r for r in results if r["id"] in by_case]   # the file may hold other runs' too
    wall = sum(r.get("wall_s", 0) for r in mine)
    L.append("- Daemon time over the %d replies: %.0f s%s" % (
        len(mine), wall, "".join("; %d sent twice after a lost worker" % n for n in
                                 [sum(1 for r in mine if r.get("retried"))] if n)))
    png = pathlib.Path(args.png).name
    probe = (", grey combined without the probe, cyan hidden-state probe"
             if "probe_layer" in cal else "")
    L.append("- ROC plot: [%s](%s) (black combined, purple combined + self-check, brown "
             "combined + reliance, blue log-probability, orange lexical, green attention, red "
             "self-check, pink context reliance%s; dashed grey chance)" % (png, png, probe))
    L.append("")
    L.append("## Cases and labels")
    L.append("")
    L.append("| split | condition | answers | hallucinated | abstained | unlabelled |")
    L.append("|---|---|---|---|---|---|")
    for split, rows, skipped in (("fit", fit_rows, fit_skipped),
                                 ("test", test_rows + apart_rows, test_skipped)):
        for k in CONDITIONS:
            sel = [(cs, r, lab) for cs, r, lab in rows if cs["condition"] == k]
            n_all = sum(1 for cs in cases if cs["split"] == split and cs["condition"] == k)
            if not n_all:
                continue
            abst = sum(1 for cs, r, lab in sel if label(cs, r)[1] == "abstained")
            L.append("| %s | %s | %d | %d | %d | %d |" % (
                split, k, len(sel), sum(lab for _, _, lab in sel), abst, n_all - len(sel)))
    for split, skipped in (("fit", fit_skipped), ("test", test_skipped)):
        if skipped:
            L.append("")
            L.append("Unlabelled in the %s split: %s." % (split, ", ".join(
                "%d %s" % (v, k) for k, v in sorted(skipped.items()))))
    L.append("")
    L.append("Document tokens in the prompt (test split, from the replies' `usage`): " +
             "; ".join("%s: %d–%d" % (b, min(v), max(v)) for b, v in ctx_tokens.items()) + ".")
    L.append("")
    L.append("## Held-out results")
    L.append("")
    L.append("Request score = maximum over windows; flag = score ≥ the set's threshold (max F1 "
             "on the fit split's out-of-fold scores%s). Positive = hallucinated." %
             threshold_rule(args))
    L.append("")
    L.append("| signal set | features | AUROC | AUPRC | threshold | precision | recall | F1 | "
             "FPR |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    for name, s in sets.items():
        m = s["all"]
        L.append("| %s | %s | %s | %s | %.3f | %s | %s | %s | %s |" % (
            name, " ".join(signal_sets[name]), fmt(m["auroc"]), fmt(m["auprc"]),
            s["cal"]["threshold"], fmt(m["precision"]), fmt(m["recall"]), fmt(m["f1"]),
            fmt(m["fpr"])))
    L.append("")
    L.append("%d held-out answers, %d hallucinated (base rate %.3f)." % (
        len(y), int(y.sum()), y.mean()))
    for title, grp, order in (("condition", by_cond, conds), ("context length (haystack "
                                                               "tokens)", by_len, lens)):
        L.append("")
        L.append("### Per %s" % title)
        L.append("")
        L.append("AUROC / F1 / FPR at each set's threshold; – where a group lacks one label.")
        L.append("")
        L.append("| %s | answers | halluc. | %s |" % (title.split(" ")[0], " | ".join(sets)))
        L.append("|---|---|---|%s" % ("---|" * len(sets)))
        for g in order:
            ix = grp[g]
            cells = []
            for name, s in sets.items():
                m = group_metrics(y[ix], s["scores"][ix], s["cal"]["threshold"])
                cells.append("%s / %s / %s" % (fmt(m["auroc"], 2), fmt(m["f1"], 2),
                                               fmt(m["fpr"], 2)))
            L.append("| %s | %d | %d | %s |" % (g, len(ix), int(y[ix].sum()), " | ".join(cells)))
    if apart_rows:
        ya = np.array([lab for _, _, lab in apart_rows])
        abst = sum(1 for cs, r, _ in apart_rows if label(cs, r)[1] == "abstained")
        L.append("")
        L.append("### Apart from the totals: %s" % APART)
        L.append("")
        L.append("Each answerable held-out question asked over another paragraph of its article, "
                 "one without its gold answers: what a retrieval that missed places. %d answers, "
                 "%d declined; an answer that is not the refusal counts as hallucinated, a right "
                 "one too (%d contain a gold answer: the model's own knowledge, not the "
                 "document's). Not in the totals above: these are far easier to separate than "
                 "SQuAD 2.0's own questions." % (
                     len(apart_rows), abst, sum(1 for cs, r, lab in apart_rows
                                               if lab and ec.contains(r["answer"], cs["answers"]))))
        L.append("")
        L.append("| signal set | answers given that are flagged (recall) |")
        L.append("|---|---|")
        for name, s in sets.items():
            m = gf.at_threshold(ya, s["apart"], s["cal"]["threshold"])
            L.append("| %s | %s |" % (name, fmt(m["recall"])))
    L.append("")
    L.append("## Fitted weights (standardised features)")
    L.append("")
    L.append("| signal set | L2 | CV AUROC (fit split) | %s | bias |" % " | ".join(gf.FEATURES))
    L.append("|---|---|---|%s---|" % ("---|" * len(gf.FEATURES)))
    for name, s in sets.items():
        c = s["cal"]
        wmap = dict(zip(c["features"], c["weights"]))
        info = s["info"]
        L.append("| %s | %s | %s | %s | %.3f |" % (
            name, "calibration file" if info is None else "%g" % info["lambda"],
            "–" if info is None else fmt(info["cv_auroc"]),
            " | ".join("%.3f" % wmap[f] if f in wmap else "" for f in gf.FEATURES), c["bias"]))
    # the daemon's own score, where it ran with this calibration
    diffs = []
    for _, r, _ in test_rows + fit_rows:
        g = r.get("grounding") or {}
        if g.get("score") is not None and g.get("detector") == cal["name"]:
            diffs.append(abs(g["score"] - gf.score(cal, r["token_signals"])[0]))
    L.append("")
    if diffs:
        L.append("The daemon ran with this calibration: its `grounding.score` matches "
                 "`tools/grounding_features.py` within %.1e over %d replies." %
                 (max(diffs), len(diffs)))
    else:
        L.append("The replies were collected without this calibration loaded; scores are "
                 "computed from their `token_signals` by `tools/grounding_features.py`, as the "
                 "daemon computes them (`tests/test_grounding_eval.py` checks the two agree).")
    pathlib.Path(args.report).write_text("\n".join(L) + "\n")
    curves = {name: gf.roc_curve(y, s["scores"]) for name, s in sets.items()}
    roc_png(args.png, curves)
    print("wrote %s and %s" % (args.report, args.png))
    for name, s in sets.items():
        m = s["all"]
        print("  %-16s AUROC %s AUPRC %s F1 %s FPR %s" % (name, fmt(m["auroc"]),
                                                           fmt(m["auprc"]), fmt(m["f1"]),
                                                           fmt(m["fpr"])))
    return sets


def cmd_all(args):
    t0 = time.time()
    if args.probe_layer is not None and not args.hidden_layers:
        args.hidden_layers = str(args.probe_layer)
    cmd_generate(args)
    args.fresh = not args.resume
    args.calibration = None  # collect the signals without a calibration, then fit
    cmd_run(args)
    cmd_fit(args)
    args.calibration = args.calibration_out
    cmd_report(args, run_seconds=time.time() - t0)


# ---------------------------------------------------------------------------------------------

FULL_LENGTHS = [512, 1024, 2048, 4096, 7680]
FULL_PER_LENGTH = [14, 10, 6, 3, 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    work = DEFAULT_WORK

    def common(p, *what):
        cal_path = str(ROOT / "deploy" / "grounding" / "SmolLM2-135M-Instruct.Q4_1.grounding")
        p.add_argument("--model", default=str(DEFAULT_MODEL),
                       help="GGUF model (default: %(default)s)")
        p.add_argument("--cases", default=str(work / "cases.jsonl"), help="cases file")
        if {"run", "fit", "report"} & set(what):
            p.add_argument("--results", default=str(work / "results.jsonl"),
                           help="replies file (JSON lines)")
        if "generate" in what:
            p.add_argument("--squad", default=str(DEFAULT_SQUAD),
                           help="directory of passages.jsonl and questions.jsonl")
            p.add_argument("--splits", nargs="+", default=["fit", "test"],
                           choices=["fit", "test"])
            p.add_argument("--lengths", type=int, nargs="+", default=FULL_LENGTHS,
                           help="haystack sizes in tokens (default: %(default)s)")
            p.add_argument("--per-length", type=int, nargs="+", default=FULL_PER_LENGTH,
                           help="haystacks per size and split, each giving 4 cases "
                                "(default: %(default)s)")
            p.add_argument("--squad-questions", type=int, default=80,
                           help="SQuAD questions per split, half unanswerable "
                                "(default: %(default)s)")
            p.add_argument("--other-paragraph", nargs="*", default=[],
                           choices=["fit", "test"], metavar="SPLIT",
                           help="in these splits also ask each answerable SQuAD question over "
                           "another paragraph of its article, one without the answer (reported "
                           "apart, not in the held-out totals)")
            p.add_argument("--fit-squad-questions", type=int, default=None,
                           help="SQuAD questions of the fit split, if not --squad-questions "
                                "(a hidden-state probe learns from many)")
        if "run" in what:
            p.add_argument("--endpoint", help="a running diffragd instead of starting "
                           "build/diffragd (its chunk_tokens must be at least twice the longest "
                           "haystack, so that each is one chunk)")
            if "fit" not in what:
                p.add_argument("--calibration", help="calibration file for the started daemon")
            p.add_argument("--threads", type=int, default=2, help="compute threads")
            p.add_argument("--max-context", type=int, default=8192,
                           help="prompt budget in tokens (default: %(default)s)")
            p.add_argument("--max-tokens", type=int, default=48,
                           help="answer tokens at most (default: %(default)s)")
            p.add_argument("--timeout", type=float, default=600, help="seconds per reply")
            p.add_argument("--daemon-arg", action="append", default=[],
                           metavar="KEY=VALUE", help="extra diffragd setting (repeatable)")
            p.add_argument("--fresh", action="store_true", help="discard earlier results")
            p.add_argument("--hidden-layers", default="",
                           help="L,L,...: keep each reply's residual stream at these layers "
                                "(the daemon's grounding_hidden_layers), to fit the hidden-state "
                                "probe")
        if "fit" in what:
            p.add_argument("--calibration-out", default=cal_path,
                           help="calibration file to write (default: %(default)s)")
            p.add_argument("--name", default="smollm2-135m-v1", help="calibration name")
            p.add_argument("--window", type=int, default=8)
            p.add_argument("--stride", type=int, default=4)
            p.add_argument("--probe-layer", type=int, default=None,
                           help="fit a hidden-state probe on the residual stream entering this "
                                "layer (the replies must carry it: run --hidden-layers); "
                                "default: no probe")
            p.add_argument("--probe-rows", default="first,mean",
                           type=lambda s: tuple(k for k in s.split(",") if k),
                           help="the reply's rows of that layer the probe weighs: first,mean "
                                "(the default) or first,mean,last")
            p.add_argument("--watch", default="auto",
                           help="heads the replies were collected with: auto (the daemon's "
                                "default, every head of the layers at 1/2 and 3/4 depth) or "
                                "LAYER:HEAD,...")
        if "fit" in what or "report" in what:
            p.add_argument("--max-fpr", type=float, default=None,
                           help="thresholds: max F1 among those with at most this "
                                "false-positive rate on the fit split's out-of-fold scores "
                                "(default: max F1)")
        if "report" in what:
            if "fit" not in what:
                p.add_argument("--calibration", default=cal_path,
                               help="calibration to evaluate (default: %(default)s)")
            p.add_argument("--report", default=str(ROOT / "docs" / "grounding-eval.md"))
            p.add_argument("--png", default=str(ROOT / "docs" / "grounding-roc.png"))
            p.add_argument("--command", help="command line to quote in the report")

    common(sub.add_parser("generate", help="write labelled cases"), "generate")
    common(sub.add_parser("run", help="send the cases to diffragd"), "run")
    common(sub.add_parser("fit", help="fit the calibration on the fit split"), "fit")
    common(sub.add_parser("report", help="held-out report and ROC plot"), "report")
    p = sub.add_parser("all", help="generate, run, fit, report")
    common(p, "generate", "run", "fit", "report")
    p.add_argument("--resume", action="store_true", help="keep results already collected")
    args = ap.parse_args(argv)
    try:
        {"generate": cmd_generate, "run": cmd_run, "fit": cmd_fit, "report": cmd_report,
         "all": cmd_all}[args.cmd](args)
    except (EvalError, ValueError, OSError) as e:
        print("grounding-eval: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
