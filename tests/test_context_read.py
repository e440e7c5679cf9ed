"""How much of the documents a query reads, as a user meets it: the token budget decides, not a
chunk count. Documents that fit the budget together go in whole, in order (one citation each,
spanning the document); otherwise the best chunks fill the budget. Every reply says what it
read (`context`), and the CLI prints one line when part of the documents was left out.
Documents are SQuAD 2.0 paragraphs (dev, CC BY-SA 4.0); the model is the tests' small one."""
import json
import subprocess

import pytest

from conftest import BUILD, ROOT
from daemon_util import Daemon, query


def article(squad_dir, n_paras):
    """The first article (file order) with n_paras paragraphs and an answerable question."""
    passages = [json.loads(l) for l in open(squad_dir / "passages.jsonl")]
    questions = [json.loads(l) for l in open(squad_dir / "questions.jsonl")]
    by_title = {}
    for p in passages:
        by_title.setdefault(p["title"], []).append(p)
    for title, ps in by_title.items():
        ids = {p["id"] for p in ps[:n_paras]}
        qs = [q["question"] for q in questions
              if q["gold_passage_id"] in ids and not q["is_impossible"]]
        if len(ps) >= n_paras and len(qs) >= 2:
            return title, ps[:n_paras], qs
    pytest.fail("no SQuAD article with %d paragraphs and 2 answerable questions" % n_paras)


def ask(c, question, docs=None, **kw):
    _, r = c.call(query(question, docs, max_tokens=8, temperature=0, **kw), timeout=300)
    assert r["ok"], r
    return r


def placed(r):
    return sum(1 for _ in r["citations"])


def test_documents_that_fit_go_in_whole(tmp_path, default_model, squad_dir):
    title, paras, qs = article(squad_dir, 8)
    text = "\n\n".join(p["text"] for p in paras)
    big = [{"id": "article", "title": title, "text": text}]
    small = [{"id": "z-first", "text": paras[0]["text"]},
             {"id": "a-second", "text": paras[1]["text"]}]
    # relevance_floor 0 here: the budget alone decides how many chunks fill the prompt (the
    # floor has its own test below)
    with Daemon(tmp_path, default_model, workers=1, threads=2, max_context_tokens=6144,
                max_tokens=64, relevance_floor=0) as d:
        c = d.client()
        # one document that fits: whole, one citation spanning it, nothing left out
        r1 = ask(c, qs[0], big)
        cx = r1["context"]
        assert cx["whole"] and cx["documents"] == 1 and cx["chunks_left_out"] == 0, cx
        assert cx["doc_tokens"] == cx["placed_tokens"] > 800, cx
        (cite,) = r1["citations"]
        assert cite["whole"] and cite["doc_id"] == "article", cite
        assert cite["offsets"] == [0, len(text.encode())], cite
        # the same documents, another question: the prompt is the same up to the question,
        # so the prefix cache serves the documents
        r2 = ask(c, qs[1], big)
        assert r2["context"]["whole"], r2["context"]
        assert r2["usage"]["cached_tokens"] >= r2["usage"]["context_tokens"] - 128, r2["usage"]
        # several documents that fit: whole, best first; in document order as sent
        r3 = ask(c, paras[1]["text"][:80], small)
        assert [x["doc_id"] for x in r3["citations"]] == ["a-second", "z-first"], r3["citations"]
        assert all(x["whole"] for x in r3["citations"]) and r3["context"]["documents"] == 2
        r4 = ask(c, paras[1]["text"][:80], small, order="document")
        assert [x["doc_id"] for x in r4["citations"]] == ["z-first", "a-second"], r4["citations"]
        # nearest: best last, next to the question, markers in prompt order
        r4n = ask(c, paras[1]["text"][:80], small, order="nearest")
        assert [x["doc_id"] for x in r4n["citations"]] == ["z-first", "a-second"], r4n["citations"]
        assert [x["marker"] for x in r4n["citations"]] == [1, 2]
        # then another question over them gets the same prompt up to the question
        r4b = ask(c, paras[0]["text"][:80], small, order="document")
        assert r4b["usage"]["cached_tokens"] >= r4b["usage"]["context_tokens"] - 128, r4b["usage"]
        # a budget too small for the whole document: the best chunks fill it, and the reply
        # says what was left out
        r5 = ask(c, qs[0], big, max_context_tokens=600)
        cx = r5["context"]
        assert not cx["whole"] and cx["chunks_left_out"] > 0, cx
        assert cx["doc_tokens"] == r1["context"]["doc_tokens"], cx
        assert 0 < cx["placed_tokens"] < 600 and r5["usage"]["prompt_tokens"] <= 600, (cx, r5["usage"])
        assert cx["chunks_placed"] == placed(r5) and not any(x["whole"] for x in r5["citations"])
        # the same chunks nearest the question: as many prompt tokens, the citations reversed
        # (their markers follow the prompt, and what the answer cites may differ)
        r5n = ask(c, qs[0], big, max_context_tokens=600, order="nearest")
        assert r5n["context"] == cx and r5n["usage"]["prompt_tokens"] == r5["usage"]["prompt_tokens"]
        strip = lambda cs: [{k: v for k, v in x.items() if k not in ("marker", "cited")} for x in cs]
        assert strip(r5n["citations"]) == strip(r5["citations"])[::-1], (r5n["citations"],
                                                                         r5["citations"])
        # the labels and separators take the rest of the documents' part of the prompt
        assert cx["placed_tokens"] < r5["usage"]["context_tokens"], (cx, r5["usage"])
        # a top_k caps the chunks even when the document would fit
        r6 = ask(c, qs[0], big, top_k=2)
        assert not r6["context"]["whole"] and placed(r6) <= 2, r6["context"]
        assert d.stop() == 0


def test_collection_reads_named_or_found_documents_whole(tmp_path, default_model, squad_dir):
    title, paras, qs = article(squad_dir, 6)
    docs = [{"id": "p%d" % i, "title": title, "text": p["text"]} for i, p in enumerate(paras)]
    with Daemon(tmp_path, default_model, workers=1, threads=2, max_context_tokens=4096,
                max_tokens=64) as d:
        c = d.client()
        _, r = c.call({"v": 1, "op": "ingest", "collection": "art", "docs": docs}, timeout=120)
        assert r["ok"], r
        # ids: those documents, whole, in document order as named
        r1 = ask(c, qs[0], collection="art", ids=["p3", "p1"], order="document")
        assert [x["doc_id"] for x in r1["citations"]] == ["p3", "p1"], r1["citations"]
        assert r1["context"]["whole"] and r1["context"]["documents"] == 2, r1["context"]
        # no ids: the documents the search found, whole when they fit (in document order: by id)
        r2 = ask(c, qs[0], collection="art", order="document")
        ids = [x["doc_id"] for x in r2["citations"]]
        assert r2["context"]["whole"] and ids == sorted(ids), (r2["context"], ids)
        assert r2["context"]["documents"] == len(ids) >= 1, r2["context"]
        # over the budget: chunks, and the documents' tokens still reported
        r3 = ask(c, qs[0], collection="art", max_context_tokens=300)
        assert not r3["context"]["whole"] and r3["context"]["doc_tokens"] > 300, r3["context"]
        # stored documents of more than 32 bytes a budget token are not counted (nil)
        big = {"id": "big", "title": title, "text": "\n\n".join(p["text"] for p in paras) * 3}
        assert len(big["text"].encode()) > 32 * 300
        _, r = c.call({"v": 1, "op": "ingest", "collection": "art", "docs": [big]}, timeout=120)
        assert r["ok"], r
        r4 = ask(c, qs[0], collection="art", max_context_tokens=300)
        assert r4["context"]["doc_tokens"] is None and r4["context"]["chunks_left_out"] > 0, \
            r4["context"]
        assert d.stop() == 0


def test_default_context_budget_and_cli_line(tmp_path, default_model, squad_dir):
    title, paras, qs = article(squad_dir, 8)
    f = tmp_path / "article.txt"
    f.write_text("\n\n".join(p["text"] for p in paras))
    (tmp_path / "d").mkdir()
    with Daemon(tmp_path / "d", default_model, workers=1, threads=2, max_context_tokens=6144,
                default_context_tokens=512, max_tokens=64, relevance_floor=0) as d:
        c = d.client()
        # a query that does not say gets default_context_tokens, inline documents or stored
        r = ask(c, qs[0], [{"id": "a", "text": f.read_text()}])
        assert r["usage"]["prompt_tokens"] <= 512 and not r["context"]["whole"], r["usage"]
        _, ing = c.call({"v": 1, "op": "ingest", "collection": "c",
                         "docs": [{"id": "a", "text": f.read_text()}]}, timeout=120)
        assert ing["ok"], ing
        r = ask(c, qs[0], collection="c")
        assert r["usage"]["prompt_tokens"] <= 512 and not r["context"]["whole"], r["usage"]
        assert r["context"]["chunks_left_out"] > 0, r["context"]

        def cli(*extra):
            p = subprocess.run([str(BUILD / "diffrag"), "--endpoint", d.endpoint, "ask",
                                "--max-tokens", "8", *extra, "-d", str(f), qs[0]],
                               cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert p.returncode == 0, p.stderr
            return p.stdout
        cut = cli("--max-context-tokens", "600")
        whole = cli("--max-context-tokens", "6144")
        assert d.stop() == 0
    print(cut, whole)
    (line,) = [l for l in cut.splitlines() if l.startswith("read: ")]
    assert "document tokens" in line and "left out" in line and "--max-context-tokens" in line
    assert not any(l.startswith("read: ") for l in whole.splitlines()), whole
    assert "whole document" in whole, whole


def test_relevance_floor_keeps_weak_chunks_out(tmp_path, default_model, squad_dir):
    """With the default relevance_floor (0.5), chunks scoring under half the best one's BM25
    score are not placed, however much budget is left, and do not count as matched; a query's
    relevance_floor overrides it, 0 letting every match fill the budget. Documents that fit the
    budget together still go in whole."""
    title, paras, qs = article(squad_dir, 8)
    docs = [{"id": "p%d" % i, "title": title, "text": p["text"]} for i, p in enumerate(paras)]
    with Daemon(tmp_path, default_model, workers=1, threads=2, max_context_tokens=6144,
                max_tokens=64) as d:
        c = d.client()
        # a budget under the documents' total, so chunks are chosen rather than the documents
        # placed whole (which the floor does not touch: documents that fit all go in)
        floor = ask(c, qs[0], docs, max_context_tokens=700)
        full = ask(c, qs[0], docs, max_context_tokens=700, relevance_floor=0)
        some = ask(c, qs[0], docs, max_context_tokens=700, relevance_floor=0.9)
        assert not floor["context"]["whole"] and not full["context"]["whole"], floor["context"]
        scores = [x["score"] for x in floor["citations"]]
        assert scores and min(scores) >= 0.5 * max(scores) - 1e-9, scores
        assert full["context"]["chunks_matched"] > floor["context"]["chunks_matched"], \
            (full["context"], floor["context"])
        assert floor["context"]["chunks_matched"] >= some["context"]["chunks_matched"] >= 1
        assert floor["usage"]["prompt_tokens"] < full["usage"]["prompt_tokens"]
        assert min(x["score"] for x in full["citations"]) < 0.5 * max(scores)
        # the chunks the floor dropped are counted: found, but not matched
        assert floor["context"]["chunks_below_floor"] == (
            full["context"]["chunks_matched"] - floor["context"]["chunks_matched"]), \
            (floor["context"], full["context"])
        assert full["context"]["chunks_below_floor"] == 0, full["context"]
        _, bad = c.call(query(qs[0], docs, relevance_floor=1.5), timeout=60)
        assert not bad["ok"] and bad["error"]["code"] == "bad_request", bad
        assert "relevance_floor" in bad["error"]["message"], bad
        assert d.stop() == 0
