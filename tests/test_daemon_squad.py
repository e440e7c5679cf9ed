"""The default model behind diffragd answers a SQuAD 2.0 question (dev, CC BY-SA 4.0) about a
pasted paragraph, and the reply cites that paragraph; the same through a stored collection."""
import json

import pytest

from daemon_util import Daemon, query


def load(squad_dir):
    passages = [json.loads(l) for l in open(squad_dir / "passages.jsonl")]
    questions = [json.loads(l) for l in open(squad_dir / "questions.jsonl")]
    return {p["id"]: p for p in passages}, questions


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, default_model):
    d = Daemon(tmp_path_factory.mktemp("squad"), default_model, workers=1, threads=2,
               max_context_tokens=2048, max_tokens=64)
    with d:
        yield d
        assert d.stop() == 0


def test_pasted_paragraph_is_cited(daemon, squad_dir):
    passages, questions = load(squad_dir)
    q = next(q for q in questions if not q["is_impossible"])
    gold = passages[q["gold_passage_id"]]
    # three paragraphs of other articles around it, as a user might paste them
    others = [p for p in passages.values() if p["title"] != gold["title"]][:3]
    docs = [{"id": p["id"], "title": p["title"], "text": p["text"]} for p in others[:2] + [gold] +
            others[2:]]
    _, r = daemon.client().call(query(q["question"], docs, id="squad", max_tokens=48), timeout=300)
    assert r["ok"], r
    cites = [c["doc_id"] for c in r["citations"]]
    print("question:", q["question"])
    print("answer:", repr(r["answer"]), "expected one of", q["answers"])
    print("citations:", [(c["doc_id"], round(c["score"], 2), c["cited"]) for c in r["citations"]])
    print("usage:", r["usage"], "timings:", r["timings"])
    assert cites[0] == gold["id"], cites
    s, e = r["citations"][0]["offsets"]
    assert gold["text"].encode()[s:e].decode().strip(), (s, e)
    assert r["answer"].strip()


def test_collection_question_cites_the_gold_paragraph(daemon, squad_dir):
    passages, questions = load(squad_dir)
    q = next(q for q in questions if not q["is_impossible"] and
             passages[q["gold_passage_id"]]["title"] == "Packet_switching")
    gold_title = passages[q["gold_passage_id"]]["title"]
    titles = [gold_title] + sorted({p["title"] for p in passages.values()} - {gold_title})[:3]
    docs = [{"id": p["id"], "title": p["title"], "text": p["text"]}
            for p in passages.values() if p["title"] in titles]
    c = daemon.client()
    for i in range(0, len(docs), 50):
        _, r = c.call({"v": 1, "op": "ingest", "collection": "squad", "id": i,
                       "docs": docs[i:i + 50]}, timeout=120)
        assert r["ok"], r
    _, r = c.call(query(q["question"], collection="squad", id="coll", top_k=3, max_tokens=32),
                  timeout=300)
    assert r["ok"], r
    cites = [x["doc_id"] for x in r["citations"]]
    print("collection of %d paragraphs; question: %s" % (len(docs), q["question"]))
    print("answer:", repr(r["answer"]), "expected one of", q["answers"])
    print("citations:", cites, "gold:", q["gold_passage_id"], "timings:", r["timings"])
    assert q["gold_passage_id"] in cites, (cites, q["gold_passage_id"])
