"""The groundedness detector at a small size (tools/grounding-eval.py): held-out needle cases of
about 512 tokens and SQuAD 2.0 questions over their gold paragraph go through diffragd with
the default model and the committed calibration; both labels occur, the daemon's
`grounding.score` separates them (AUROC >= 0.70), and every reply's score equals the NumPy
score of its token_signals (tools/grounding_features.py) to 1e-5."""
import importlib.util
import json
import re

import numpy as np
import pytest

from conftest import ROOT, SMALL
from daemon_util import Daemon

CALIBRATION = ROOT / "deploy" / "grounding" / "SmolLM2-135M-Instruct.Q4_1.grounding"
# DIFFRAG_TEST_SCALE=small (conftest.py): 16 cases instead of 52, every reply still checked
# against the NumPy score; too few for the AUROC bound, which the full run checks.
HAYSTACKS = 3 if SMALL else 10       # of ~512 tokens, each asked in the four needle conditions
SQUAD_QUESTIONS = 4 if SMALL else 12  # half unanswerable
MAX_CONTEXT = 1024


def load_tool():
    spec = importlib.util.spec_from_file_location("grounding_eval",
                                                  ROOT / "tools" / "grounding-eval.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tool():
    return load_tool()


@pytest.fixture(scope="module")
def replies(tmp_path_factory, default_model, squad_dir, tool):
    """[(case, reply)] of the held-out (test split) slice."""
    tmp = tmp_path_factory.mktemp("grounding-eval")
    if not CALIBRATION.exists():
        pytest.fail("calibration missing: %s (make eval-grounding writes it)" % CALIBRATION)
    passages, questions = tool.load_squad(squad_dir)
    tk = tool.tokenizer(default_model)

    def tok_count(text):
        return len(tk.encode(text).ids)
    cases = tool.needle_cases("test", [512], [HAYSTACKS], passages, tok_count, set())
    cases += tool.squad_cases("test", SQUAD_QUESTIONS, passages, questions)
    results = tmp / "results.jsonl"
    d = Daemon(tmp, default_model, workers=1, threads=2, max_context_tokens=MAX_CONTEXT,
               chunk_tokens=2 * MAX_CONTEXT, chunk_overlap=0, max_tokens=64,
               grounding_calibration=CALIBRATION)
    with d:
        took = tool.run_cases(cases, d.endpoint, results, 48, MAX_CONTEXT, 120,
                              log=lambda *a: None)
        assert d.stop() == 0
    print("%d cases in %.0f s" % (len(cases), took))
    by_id = {r["id"]: r for r in tool.read_jsonl(results)}
    return [(c, by_id[c["id"]]) for c in cases]


def test_every_reply_is_scored_by_the_calibration(replies, tool):
    cal = tool.gf.read_calibration(CALIBRATION)
    worst = 0.0
    for case, r in replies:
        assert r["ok"], (case["id"], r.get("error"), r.get("message"))
        g, sig = r["grounding"], r["token_signals"]
        assert g["detector"] == cal["name"], g
        n = len(sig["logprob"])
        assert g["answer_tokens"] == n and all(len(v) == n for v in sig.values()), case["id"]
        if n == 0:
            assert g["score"] is None and g["flagged"] is None
            continue
        ours, per_window = tool.gf.score(cal, sig)
        worst = max(worst, abs(g["score"] - ours))
        assert abs(g["score"] - ours) <= 1e-5, (case["id"], g["score"], ours)
        assert g["flagged"] == (g["score"] >= cal["threshold"] and not g["abstained"]), g
        # each token's score is the highest of the windows that hold it
        tok = np.full(n, -1.0)
        for (a, b), s in zip(tool.gf.windows(n, cal["window"], cal["stride"]), per_window):
            tok[a:b] = np.maximum(tok[a:b], s)
        assert np.max(np.abs(np.asarray(sig["score"]) - tok)) <= 1e-5, case["id"]
    print("largest |daemon score - grounding_features.score| = %.2e over %d replies" %
          (worst, len(replies)))


def test_held_out_auroc(replies, tool):
    labels, scores, rows = [], [], []
    for case, r in replies:
        lab, note = tool.label(case, r)
        if lab is None or r["grounding"]["score"] is None:
            continue
        labels.append(lab)
        scores.append(r["grounding"]["score"])
        rows.append((case["condition"], lab, round(r["grounding"]["score"], 3), note,
                     r["answer"][:70]))
    for row in rows:
        print(json.dumps(row))
    assert 0 in labels and 1 in labels, labels
    auroc = tool.gf.auroc(labels, scores)
    print("held-out slice: %d answers, %d hallucinated, AUROC %.3f" %
          (len(labels), sum(labels), auroc))
    if SMALL:
        print("reduced scale (DIFFRAG_TEST_SCALE=small): %d answers are too few for the AUROC "
              "bound of 0.70; the full-scale run checks it" % len(labels))
        return
    assert auroc >= 0.70, auroc


# ---- without a daemon: the generator's splits and the label rules -----------------------------

def test_fit_and_test_cases_are_disjoint(tool, default_model, squad_dir):
    passages, questions = tool.load_squad(squad_dir)
    tk = tool.tokenizer(default_model)
    used = set()
    corpus = {"fit": "", "test": ""}
    for p in passages:
        corpus[tool.article_split(p["title"])] += " ".join(p["text"].split()) + " "
    seen = {"fit": {"names": set(), "values": set(), "questions": set(), "paras": set()},
            "test": {"names": set(), "values": set(), "questions": set(), "paras": set()}}
    for split in ("fit", "test"):
        cases = tool.needle_cases(split, [512], [4], passages,
                                  lambda t: len(tk.encode(t).ids), used)
        cases += tool.squad_cases(split, 10, passages, questions)
        assert len(cases) == 4 * 4 + 10
        s = seen[split]
        other_split = "test" if split == "fit" else "fit"
        for c in cases:
            s["questions"].add(c["question"])
            if c["kind"] == "squad":
                assert tool.article_split(c["docs"][0]["title"].replace(" ", "_")) == split
                continue
            s["names"].add(c["entity"])
            s["values"].update(c["supported"] + c["other"])
            text = c["docs"][0]["text"]
            for v in c["supported"]:
                assert text.count(v) == 1, (c["id"], v)
            if c["condition"] == "present":
                at = text.index(c["entity"]) / len(text)
                assert abs(at - c["depth"]) < 0.15, (c["id"], at, c["depth"])
            for para in text.split("\n\n"):
                # every paragraph, needle sentences aside, comes from an article of the split
                words = " ".join(x for x in re.split(r"(?<=[.!?])\s+", para)
                                 if not any(v in x for v in c["supported"] + c["other"]))
                head = " ".join(words.split())[:80]
                if head:
                    assert head in corpus[split] and head not in corpus[other_split], head
                    s["paras"].add(head)
    for key in ("names", "values", "questions", "paras"):
        assert seen["fit"][key] and not seen["fit"][key] & seen["test"][key], key
    fit_templates = {t["question"] for t in tool.TEMPLATES["fit"]}
    assert not fit_templates & {t["question"] for t in tool.TEMPLATES["test"]}
    assert not set(tool.NAMES["fit"]) & set(tool.NAMES["test"])


def test_other_paragraph_cases(tool, squad_dir):
    """Each answerable question once more, over another paragraph of its own article that holds
    none of its gold answers; unanswerable questions get none."""
    passages, questions = tool.load_squad(squad_dir)
    by_id = {p["id"]: p for p in passages}
    squad = tool.squad_cases("test", 20, passages, questions)
    other = tool.other_paragraph_cases("test", squad, passages)
    assert other == tool.other_paragraph_cases("test", squad, passages)   # a fixed draw
    asked = {c["question"]: c for c in squad if c["condition"] == "squad-answerable"}
    assert 0 < len(other) <= len(asked) and len({c["id"] for c in other}) == len(other)
    for c in other:
        assert c["condition"] == "squad-other-paragraph" and c["split"] == "test"
        own = asked[c["question"]]
        gold, para = by_id[own["docs"][0]["id"]], by_id[c["docs"][0]["id"]]
        assert para["id"] != gold["id"] and para["title"] == gold["title"]
        assert c["docs"][0]["text"] == para["text"] and c["answers"] == own["answers"]
        text = " %s " % tool.normalise(para["text"])
        assert not any(" %s " % tool.normalise(a) in text for a in c["answers"]), c["id"]


def needle(condition, supported, other=(), text=None):
    text = text or "Filler about rivers. The code of the Brennick vault is 7Q-4412. More filler."
    return {"kind": "needle", "condition": condition, "supported": list(supported),
            "other": list(other), "docs": [{"text": text}]}


def reply(answer, case, abstained=False):
    return {"ok": True, "answer": answer, "grounding": {"abstained": abstained},
            "citations": [{"offsets": [0, len(case["docs"][0]["text"].encode())]}]}


@pytest.mark.parametrize("condition,supported,other,answer,expect", [
    ("present", ["7Q-4412"], [], "The code of the Brennick vault is 7Q-4412 [1].", 0),
    ("present", ["7Q-4412"], [], "It is 7q-4412.", 0),                       # case folded
    ("present", ["7Q-4412"], [], "The code is 7Q-4413 [1].", 1),              # invented value
    ("present", ["7Q-4412"], [], "It is 7Q-4412 or 5K-1000.", 1),             # one invented
    ("present", ["7Q-4412"], [], "The vault is old.", 1),                     # no value given
    ("absent", [], [], "The code of the Brennick vault is 3B-2231.", 1),
    ("absent", [], [], "The Brennick vault is a secure digital vault.", 1),
    ("absent", [], [], "I cannot find the answer in the provided documents.", 0),
    ("distractor", ["7Q-4412"], ["EM-63010"], "It is EM-63010.", 1),          # the other entity's
    ("distractor", ["7Q-4412"], ["EM-63010"], "Vasquez: EM-63010; Brennick: 7Q-4412.", 0),
    ("conflict", ["7Q-4412", "2621-B"], [], "The code is 2621-B [2].", 0),
    ("conflict", ["7Q-4412", "2621-B"], [], "The code is 2621-C.", 1),
])
def test_needle_labels(tool, condition, supported, other, answer, expect):
    text = ("Filler about rivers. The code of the Brennick vault is 7Q-4412. "
            "The code of the Vasquez vault is EM-63010. Later: the Brennick vault code is 2621-B.")
    case = needle(condition, supported, other, text)
    r = reply(answer, case, abstained=answer.startswith("I cannot find"))
    assert tool.label(case, r)[0] == expect, tool.label(case, r)


def test_needle_labels_need_the_whole_haystack(tool):
    case = needle("present", ["7Q-4412"])
    r = reply("It is 7Q-4412.", case)
    r["citations"] = [{"offsets": [0, 20]}]
    assert tool.label(case, r) == (None, "haystack not placed whole")
    r["citations"] = []
    assert tool.label(case, r)[0] is None
    assert tool.label(case, {"ok": False, "error": "internal"})[0] is None


@pytest.mark.parametrize("condition,answer,abstained,expect", [
    ("squad-answerable", "The Normans were in Normandy.", False, 0),    # gold "Normandy"
    ("squad-answerable", "It was in NORMANDY!", False, 0),               # case and punctuation
    ("squad-answerable", "They lived in Rouen.", False, 1),
    ("squad-answerable", "I cannot find the answer in the provided documents.", True, 0),
    ("squad-unanswerable", "They lived in Rouen.", False, 1),
    ("squad-unanswerable", "I cannot find the answer in the provided documents", True, 0),
    # over a paragraph without the answer, even a right answer is not the document's
    ("squad-other-paragraph", "They were in Normandy.", False, 1),
    ("squad-other-paragraph", "I cannot find the answer in the provided documents.", True, 0),
])
def test_squad_labels(tool, condition, answer, abstained, expect):
    case = {"kind": "squad", "condition": condition,
            "answers": [] if condition == "squad-unanswerable" else ["Normandy", "in Normandy"],
            "docs": [{"text": "The Normans gave their name to Normandy, a region in France."}]}
    assert tool.label(case, reply(answer, case, abstained))[0] == expect


def test_probe_fit_recovers_a_planted_direction(tool):
    """train_probe on rows whose label follows one direction of the [first ; mean] rows, over
    groups the cross-validation keeps whole: the held-out folds separate the labels, the
    weights come back in the rows' raw units (gf.probe_logit over the rows gives the logits a
    refit would), and a row without the layer gets no logit."""
    rng = np.random.default_rng(3)
    dim, n = 16, 240
    direction = rng.normal(size=2 * dim)
    rows = []
    for i in range(n):
        x = rng.normal(size=2 * dim) * rng.uniform(0.5, 3.0, 2 * dim) + 5.0
        y = int(x @ direction + rng.normal() * 2.0 > direction.sum() * 5.0)
        case = {"kind": "squad", "docs": [{"title": "article %d" % (i % 12)}]}
        h = {"layers": [7], "first": [list(x[:dim])], "mean": [list(x[dim:])]}
        rows.append((case, {"hidden_states": h}, y))
    rows.append(({"kind": "squad", "docs": [{"title": "article 0"}]},
                 {"hidden_states": {"layers": [3], "first": [[0] * dim], "mean": [[0] * dim]}}, 1))
    probe, logits, info = tool.train_probe(rows, 7)
    assert probe["probe_layer"] == 7 and len(probe["probe_weights"]) == 2 * dim
    assert np.isnan(logits[-1]) and np.all(np.isfinite(logits[:-1]))
    y = np.array([lab for _, _, lab in rows[:-1]])
    assert 0 < y.sum() < n and info["n"] == n
    assert tool.gf.auroc(y, logits[:-1]) > 0.9 and info["cv_auroc"] > 0.9, info
    full = np.array([tool.gf.probe_logit(probe, r["hidden_states"]) for _, r, _ in rows[:-1]])
    assert tool.gf.auroc(y, full) > 0.95
    # the bias is not penalised, so at the optimum the mean probability is the base rate: the
    # raw-unit weights and bias reproduce the standardised fit, offsets included
    assert abs(np.mean(1 / (1 + np.exp(-full))) - y.mean()) < 1e-3
    assert np.isnan(tool.gf.probe_logit(probe, rows[-1][1]["hidden_states"]))


def test_probe_of_three_rows_reads_the_last_row(tool):
    """--probe-rows first,mean,last: with the label in the last row alone, a probe of the first
    two rows cannot separate the held-out folds and one of three can; its weights (three rows)
    give the daemon's logit through gf.probe_logit."""
    rng = np.random.default_rng(4)
    dim, n = 8, 240
    direction = rng.normal(size=dim)
    rows = []
    for i in range(n):
        x = rng.normal(size=3 * dim)
        y = int(x[2 * dim:] @ direction + rng.normal() * 0.5 > 0)
        case = {"kind": "squad", "docs": [{"title": "article %d" % (i % 12)}]}
        h = {"layers": [5], "first": [list(x[:dim])], "mean": [list(x[dim:2 * dim])],
             "last": [list(x[2 * dim:])]}
        rows.append((case, {"hidden_states": h}, y))
    y = np.array([lab for _, _, lab in rows])
    _, two, info2 = tool.train_probe(rows, 5)
    probe, three, info3 = tool.train_probe(rows, 5, tool.gf.HIDDEN_ROWS)
    assert info2["cv_auroc"] < 0.7 and info3["cv_auroc"] > 0.9, (info2, info3)
    assert len(probe["probe_weights"]) == 3 * dim
    full = np.array([tool.gf.probe_logit(probe, r["hidden_states"]) for _, r, _ in rows])
    assert tool.gf.auroc(y, full) > 0.95
    # a reply without the last row has no logit from a probe of three rows
    h = dict(rows[0][1]["hidden_states"])
    del h["last"]
    assert np.isnan(tool.gf.probe_logit(probe, h))
