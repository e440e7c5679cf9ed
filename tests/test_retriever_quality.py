"""Retrieval quality on SQuAD 2.0 passages: index all 1,216 passages (title + text) and, for every
answerable question, check whether the gold passage is among the top 1, 5 and 20 documents.
diffrag without stemming must stay within 1 point of the independent reference BM25 in
tests/ref/bm25_ref.py (same k1 and b, no stemming) at every k; the default configuration
(Snowball stemming) must reach recall@20 >= 0.93. Prints the table."""
import json
import subprocess
import time

import pytest

from ref.bm25_ref import BM25Ref

KS = (1, 5, 20)


def load(squad_dir):
    passages = [json.loads(l) for l in open(squad_dir / "passages.jsonl", encoding="utf-8")]
    questions = [json.loads(l) for l in open(squad_dir / "questions.jsonl", encoding="utf-8")]
    return passages, [q for q in questions if not q["is_impossible"]]


def recall(ranked_lists, gold):
    out = {}
    for k in KS:
        hit = sum(1 for docs, g in zip(ranked_lists, gold) if g in docs[:k])
        out[k] = hit / len(gold)
    return out


def diffrag_rankings(build_dir, root, tmp_path, name, passages_file, questions, extra):
    store = build_dir / "diffrag-store"
    data = tmp_path / name
    t0 = time.time()
    r = subprocess.run([str(store), "--data-dir", str(data), "-c", "squad", *extra, "ingest",
                        str(passages_file)], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    t_ingest = time.time() - t0
    queries = "".join(q["question"].replace("\n", " ").replace("\r", " ") + "\n" for q in questions)
    t0 = time.time()
    r = subprocess.run([str(store), "--data-dir", str(data), "-c", "squad", "search-batch", "-k", "100"],
                       cwd=root, input=queries, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    t_search = time.time() - t0
    lines = r.stdout.splitlines()
    assert len(lines) == len(questions)
    ranked = []
    for i, line in enumerate(lines):
        obj = json.loads(line)
        assert obj["query"] == i
        docs = []
        for h in obj["hits"]:
            if h["doc_id"] not in docs:  # a passage may be split into several chunks
                docs.append(h["doc_id"])
        ranked.append(docs)
    return ranked, t_ingest, t_search


def test_squad_recall(build_dir, root, squad_dir, tmp_path):
    passages, questions = load(squad_dir)
    assert len(passages) == 1216 and len(questions) > 1000
    gold = [q["gold_passage_id"] for q in questions]

    default, ti_d, ts_d = diffrag_rankings(build_dir, root, tmp_path, "default",
                                           squad_dir / "passages.jsonl", questions, [])
    nostem, ti_n, ts_n = diffrag_rankings(build_dir, root, tmp_path, "nostem",
                                          squad_dir / "passages.jsonl", questions, ["--no-stem"])
    t0 = time.time()
    ref = BM25Ref(k1=0.9, b=0.4).index((p["id"], p["title"] + " " + p["text"]) for p in passages)
    ref_ranked = [[d for d, _ in ref.search(q["question"], 20)] for q in questions]
    t_ref = time.time() - t0

    r_def, r_nostem, r_ref = recall(default, gold), recall(nostem, gold), recall(ref_ranked, gold)
    print()
    print(f"SQuAD 2.0 dev passages: {len(passages)}, answerable questions: {len(questions)}")
    print(f"{'configuration':<40}" + "".join(f"{'R@' + str(k):>9}" for k in KS))
    for name, r in (("diffrag default (stemming)", r_def), ("diffrag --no-stem", r_nostem),
                    ("reference BM25 (tests/ref, no stemming)", r_ref)):
        print(f"{name:<40}" + "".join(f"{r[k]:>9.4f}" for k in KS))
    print("difference no-stem - reference        " + "".join(f"{r_nostem[k] - r_ref[k]:>+9.4f}" for k in KS))
    print(f"timings: ingest {ti_d:.2f} s / {ti_n:.2f} s, {len(questions)} searches {ts_d:.2f} s / {ts_n:.2f} s "
          f"(including process start), reference {t_ref:.2f} s")

    for k in KS:
        assert abs(r_nostem[k] - r_ref[k]) <= 0.01, f"no-stem recall@{k} {r_nostem[k]:.4f} vs reference {r_ref[k]:.4f}"
    assert r_def[20] >= 0.93, f"default recall@20 {r_def[20]:.4f} < 0.93"
