"""Chunk KV reuse through diffragd (kv_reuse, docs/kv-reuse.md), as a user meets it: questions
over the same SQuAD paragraphs, inline. With kv_reuse_recompute = 1 every answer, citation,
groundedness figure and token signal equals that of a daemon with reuse off (the blend then
computes what the prefill does, bit for bit), while the chunk store makes each chunk's KV once
and finds it for the later questions; with a share of 0.15 most document tokens keep their
stored KV, and /metrics counts the reused and recomputed tokens, the chunks found and made, and
the store's size."""
from daemon_util import Daemon, query, squad_article


def ask(d, docs, questions):
    out = []
    c = d.client()
    for i, q in enumerate(questions):
        _, r = c.call(query(q, docs, id=i, top_k=100, max_tokens=16,
                            include=["token_signals"]), timeout=600)
        assert r["ok"], r
        out.append(r)
    return out


def kv_metrics(d):
    return {
        "reused": d.metric("diffrag_kv_reuse_tokens_total", kind="reused"),
        "recomputed": d.metric("diffrag_kv_reuse_tokens_total", kind="recomputed"),
        "hit": d.metric("diffrag_kv_reuse_chunks_total", result="hit"),
        "miss": d.metric("diffrag_kv_reuse_chunks_total", result="miss"),
        "read": d.metric("diffrag_kv_reuse_read_bytes_total"),
        "bytes": d.metric("diffrag_kv_reuse_store_bytes"),
        "chunks": d.metric("diffrag_kv_reuse_store_chunks"),
        "used": d.metric("diffrag_kv_pool_pages", state="used"),
    }


def test_blend_at_share_one_equals_the_exact_path(tmp_path, default_model, squad_dir):
    paras, (q1, q2) = squad_article(squad_dir, nth=1)
    paras = paras[:4]
    docs = [{"id": p["id"], "title": p["title"], "text": p["text"]} for p in paras]
    questions = [q1, q2, q1]
    runs, m = {}, None
    for reuse in (1, 0):
        (tmp_path / f"reuse{reuse}").mkdir()
        # relevance_floor 0: every question places every paragraph (in its own order)
        with Daemon(tmp_path / f"reuse{reuse}", default_model, workers=1, threads=2,
                    max_context_tokens=2048, max_tokens=32, relevance_floor=0,
                    kv_reuse=reuse, kv_reuse_recompute=1) as d:
            runs[reuse] = ask(d, docs, questions)
            if reuse:
                m = kv_metrics(d)
            assert d.stop() == 0
    on, off = runs[1], runs[0]
    for r in on + off:
        print(r["usage"], r["timings"]["prefill_ms"], repr(r["answer"]))
    print(m)
    for a, b in zip(on, off):
        assert a["answer"] == b["answer"]
        assert a["citations"] == b["citations"]
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
        for k in ("lookback_ratio", "unsupported_token_ratio", "mean_logprob", "min_logprob",
                  "score", "flagged", "abstained"):
            assert a["grounding"][k] == b["grounding"][k], k
        assert a["token_signals"] == b["token_signals"]
    n_chunks = len(on[0]["citations"])
    assert n_chunks >= 4
    # every chunk made once (the first question), found by the two others
    assert m["miss"] == m["chunks"] == n_chunks, m
    assert m["hit"] == 2 * n_chunks, m
    assert m["reused"] == 0 and m["recomputed"] > 0 and m["bytes"] > 0, m
    assert m["used"] == 0, m


def test_blend_reuses_most_document_tokens(tmp_path, default_model, squad_dir):
    paras, (q1, q2) = squad_article(squad_dir, nth=1)
    paras = paras[:4]
    docs = [{"id": p["id"], "title": p["title"], "text": p["text"]} for p in paras]
    with Daemon(tmp_path, default_model, workers=1, threads=2, max_context_tokens=2048,
                max_tokens=32, relevance_floor=0, kv_reuse=1, kv_reuse_recompute=0.15) as d:
        rs = ask(d, docs, [q1, q2])
        m = kv_metrics(d)
        assert d.stop() == 0
    print(m, [r["answer"] for r in rs])
    docs_tokens = m["reused"] + m["recomputed"]
    assert docs_tokens > 0 and m["reused"] / docs_tokens > 0.6, m
    assert m["read"] > 0 and m["hit"] > 0 and m["miss"] > 0, m
    assert all(r["answer"].strip() for r in rs), rs
