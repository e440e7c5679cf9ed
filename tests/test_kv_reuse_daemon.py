"""Chunk KV reuse through diffragd (kv_reuse, docs/kv-reuse.md), as a user meets it: questions
over the same SQuAD paragraphs, inline. With kv_reuse_recompute = 1 every answer, citation,
groundedness figure and token signal equals that of a daemon with reuse off (the blend then
computes what the prefill does, bit for bit), while the chunk store makes each chunk's KV once
and finds it for the later questions; with a share of 0.15 most document tokens keep their
stored KV, and /metrics counts the reused and recomputed tokens, the chunks found and made, and
the store's size; the chunks retrieval ranks best can be computed in full instead. For stored documents the copies are also kept as records beside their chunks
in the document store: they outlive a restart, leave with their documents, and survive kill -9
with the store consistent."""
import random
import re
import shutil
import subprocess
import time

from daemon_util import Daemon, query, slow_model, squad_article


def ask(d, docs, questions, order="rank"):
    """The questions' replies; the order named, so that daemons with reuse on and off (whose
    defaults differ) lay out the same prompts."""
    out = []
    c = d.client()
    for i, q in enumerate(questions):
        _, r = c.call(query(q, docs, id=i, top_k=100, max_tokens=16, order=order,
                            include=["token_signals"]), timeout=600)
        assert r["ok"], r
        out.append(r)
    return out


def kv_metrics(d):
    return {
        "reused": d.metric("diffrag_kv_reuse_tokens_total", kind="reused"),
        "recomputed": d.metric("diffrag_kv_reuse_tokens_total", kind="recomputed"),
        "made": d.metric("diffrag_kv_reuse_tokens_total", kind="made"),
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
                    kv_reuse=reuse, kv_reuse_recompute=1, kv_reuse_full_chunks=0) as d:
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
    # every chunk made once (the first question), found by the two others, but for a first
    # chunk that the prefix cache holds in part: a copy's prefill publishes the frame, its copy
    # label [1] Title and its chunk, which is how a prompt opening with that chunk starts
    assert m["miss"] == m["chunks"] == n_chunks, m
    assert 2 * (n_chunks - 1) <= m["hit"] <= 2 * n_chunks, m
    assert all(r["usage"]["cached_tokens"] > 0 for r in on[1:]), [r["usage"] for r in on]
    assert m["reused"] == 0 and m["recomputed"] > 0 and m["bytes"] > 0, m
    assert all(r["usage"]["reused_tokens"] == 0 for r in on + off)
    assert m["used"] == 0, m


def test_blend_reuses_most_document_tokens(tmp_path, default_model, squad_dir):
    paras, (q1, q2) = squad_article(squad_dir, nth=1)
    paras = paras[:4]
    docs = [{"id": p["id"], "title": p["title"], "text": p["text"]} for p in paras]
    with Daemon(tmp_path, default_model, workers=1, threads=2, max_context_tokens=2048,
                max_tokens=32, relevance_floor=0, kv_reuse=1, kv_reuse_recompute=0.15,
                kv_reuse_full_chunks=0) as d:
        rs = ask(d, docs, [q1, q2])
        m = kv_metrics(d)
        assert d.stop() == 0
    print(m, [r["answer"] for r in rs])
    # the first question finds no copy: what it keeps of the copies made for it is "made",
    # not reused; the second keeps most of its documents' stored KV
    assert rs[0]["usage"]["reused_tokens"] == 0 and m["made"] > 0, (rs[0]["usage"], m)
    assert rs[1]["usage"]["reused_tokens"] > 0.6 * rs[1]["usage"]["context_tokens"], rs[1]["usage"]
    # the replies say what /metrics counts
    assert sum(r["usage"]["reused_tokens"] for r in rs) == m["reused"], [r["usage"] for r in rs]
    assert m["read"] > 0 and m["hit"] > 0 and m["miss"] > 0, m
    assert all(r["answer"].strip() for r in rs), rs


def test_best_ranked_chunks_computed_in_full(tmp_path, default_model, squad_dir):
    """kv_reuse_full_chunks: the chunks retrieval ranks best are computed in the blend in full,
    neither taking nor making a copy. With every chunk so (and no share), the answers are
    those of reuse off and no copy exists; with the best two, two chunks fewer a question are
    looked up, and their tokens are not reused."""
    paras, (q1, q2) = squad_article(squad_dir, nth=1)
    docs = [{"id": p["id"], "title": p["title"], "text": p["text"]} for p in paras[:4]]
    runs, ms = {}, {}
    for name, keys in (("off", dict(kv_reuse=0)),
                       ("all", dict(kv_reuse=1, kv_reuse_recompute=0, kv_reuse_full_chunks=100)),
                       ("two", dict(kv_reuse=1, kv_reuse_recompute=0, kv_reuse_full_chunks=2)),
                       ("none", dict(kv_reuse=1, kv_reuse_recompute=0, kv_reuse_full_chunks=0))):
        (tmp_path / name).mkdir()
        with Daemon(tmp_path / name, default_model, workers=1, threads=2,
                    max_context_tokens=2048, max_tokens=16, relevance_floor=0, **keys) as d:
            runs[name] = ask(d, docs, [q1, q2])
            ms[name] = kv_metrics(d)
            assert d.stop() == 0
    print(ms, {k: [r["usage"] for r in v] for k, v in runs.items()})
    n_chunks = len(runs["off"][0]["citations"])
    assert n_chunks >= 4
    assert [r["answer"] for r in runs["all"]] == [r["answer"] for r in runs["off"]]
    assert ms["all"]["hit"] == ms["all"]["miss"] == ms["all"]["chunks"] == 0, ms["all"]
    assert all(r["usage"]["reused_tokens"] == 0 for r in runs["all"])
    # each question looks up all but its best two (a first chunk the prefix cache holds in
    # part is not looked up either); a copy is made once, at its chunk's first look-up
    looked_up = ms["two"]["hit"] + ms["two"]["miss"]
    assert ms["two"]["chunks"] == ms["two"]["miss"] <= n_chunks, ms["two"]
    assert 2 * (n_chunks - 2) - 1 <= looked_up <= 2 * (n_chunks - 2), ms["two"]
    assert ms["none"]["hit"] + ms["none"]["miss"] > looked_up, (ms["none"], ms["two"])
    assert 0 < runs["two"][1]["usage"]["reused_tokens"] < runs["none"][1]["usage"]["reused_tokens"]


def test_a_blending_daemon_lays_chunks_out_best_last(tmp_path, default_model, squad_dir):
    """With kv_reuse on, a query that names no order gets "nearest": the chunks ranked best,
    which the blend computes in full, next to the question. A named order is kept."""
    paras, (q1, _) = squad_article(squad_dir, nth=1)
    docs = [{"id": p["id"], "title": p["title"], "text": p["text"]} for p in paras[:4]]
    with Daemon(tmp_path, default_model, workers=1, threads=2, max_context_tokens=2048,
                max_tokens=4, relevance_floor=0, kv_reuse=1) as d:
        c = d.client()
        got = {}
        for order in (None, "rank", "nearest"):
            extra = {} if order is None else {"order": order}
            _, r = c.call(query(q1, docs, id=str(order), top_k=100, max_tokens=4, **extra),
                          timeout=600)
            assert r["ok"], r
            got[order] = [(x["doc_id"], tuple(x["offsets"])) for x in r["citations"]]
        assert d.stop() == 0
    print(got)
    assert len(got["rank"]) >= 4 and got["rank"] != got["rank"][::-1], got
    assert got[None] == got["nearest"] == got["rank"][::-1], got


def test_a_blend_does_not_stop_other_answers(tmp_path, squad_dir):
    """A blend runs in steps between the other requests' steps: a stream that is decoding
    keeps getting tokens while another question's documents blend (a cold store: every copy
    made), and both answers are those each gets alone. The model is a slow random one (it
    never stops early), one worker, steps of 16 tokens while a request decodes."""
    model = slow_model(tmp_path)
    paras_a, (qa, _) = squad_article(squad_dir, nth=2)
    paras_b, (qb, _) = squad_article(squad_dir, nth=1)
    docs_a = [{"id": p["id"], "title": p["title"], "text": p["text"]} for p in paras_a[:2]]
    docs_b = [{"id": p["id"], "title": p["title"], "text": p["text"]} for p in paras_b[:4]]
    with Daemon(tmp_path, model, workers=1, threads=2, max_context_tokens=2048, max_tokens=400,
                relevance_floor=0, kv_reuse=1, kv_reuse_recompute=0.15, kv_reuse_full_chunks=0, step_ms=0,
                step_tokens=16, log_level="debug") as d:
        c = d.client()
        c.send(query(qa, docs_a, id="a", stream=True, max_tokens=400, top_k=100))
        for _ in range(3):
            r = c.recv(60)
            assert "delta" in r and "ok" not in r, r
        c.send(query(qb, docs_b, id="b", max_tokens=8, top_k=100))
        finals, deltas_before_b = {}, 0
        while len(finals) < 2:
            r = c.recv(120)
            if "ok" in r:
                finals[r["id"]] = r
            elif "b" not in finals:
                deltas_before_b += 1
        blended = re.findall(r'msg="documents blended".* made=(\d+) .* steps=(\d+) '
                             r'others_tokens=(\d+)', d.log_text())
        # alone, one after the other: the store now holds every copy
        alone = {i: d.client().call(query(q, docs, id=i, max_tokens=n, top_k=100), timeout=120)[1]
                 for i, q, docs, n in (("a", qa, docs_a, 400), ("b", qb, docs_b, 8))}
        assert d.stop() == 0
    print(blended, deltas_before_b, {i: r["usage"] for i, r in finals.items()})
    assert all(r["ok"] for r in list(finals.values()) + list(alone.values())), (finals, alone)
    # a's blend, then b's: b's copies were all made in its steps, and a decoded beside them
    assert len(blended) >= 2, blended
    made, steps, others = map(int, blended[1])
    assert made == len(finals["b"]["citations"]) and steps > 10 and others >= steps - 1, blended
    assert deltas_before_b > 10, deltas_before_b
    assert finals["a"]["usage"]["completion_tokens"] == 400
    for i in ("a", "b"):
        assert finals[i]["answer"] == alone[i]["answer"], i
        assert finals[i]["grounding"]["score"] == alone[i]["grounding"]["score"], i


# ---- the chunk KV records kept beside stored chunks (kv_reuse_store_bytes) ----------------

def store_verify(build_dir, data_dir):
    """`diffrag-store verify`: (problems, KV records) from its summary line."""
    r = subprocess.run([str(build_dir / "diffrag-store"), "--data-dir", str(data_dir), "verify"],
                       capture_output=True, text=True, timeout=600)
    m = re.search(r"(\d+) KV records \((\d+) bytes\), (\d+) problems", r.stdout)
    assert m, r.stdout + r.stderr
    assert (r.returncode == 0) == (m.group(3) == "0"), r.stdout + r.stderr
    return int(m.group(3)), int(m.group(1)), r.stdout + r.stderr


def records(d):
    return {op: d.metric("diffrag_kv_reuse_records_total", op=op)
            for op in ("loaded", "written", "error")}


def ask_collection(d, questions, **kw):
    c = d.client()
    out = []
    for i, q in enumerate(questions):
        _, r = c.call(query(q, None, collection="art", id=i, max_tokens=16, **kw), timeout=600)
        assert r["ok"], r
        out.append(r)
    return out


def test_records_outlive_a_restart_and_leave_with_their_documents(tmp_path, build_dir,
                                                                   default_model, squad_dir):
    paras, (q1, q2) = squad_article(squad_dir, nth=2)
    docs = [{"id": p["id"], "title": p["title"], "text": p["text"]} for p in paras[:4]]
    data = tmp_path / "data"
    keys = dict(workers=1, threads=2, max_context_tokens=2048, max_tokens=16, relevance_floor=0,
                kv_reuse=1, kv_reuse_recompute=0.15, kv_reuse_full_chunks=0, data_dir=data)
    # with top_k as without it, the one-chunk paragraphs are placed whole (every chunk of a
    # document placed: the document whole)
    asks = [(q1, {"top_k": 100}), (q2, {})]
    (tmp_path / "a").mkdir()
    with Daemon(tmp_path / "a", default_model, **keys) as d:
        _, r = d.client().call({"v": 1, "op": "ingest", "collection": "art", "docs": docs},
                               timeout=120)
        assert r["ok"], r
        first = [ask_collection(d, [q], **kw)[0] for q, kw in asks]
        m1 = records(d)
        held = d.metric("diffrag_kv_reuse_records")
        # a question whose chunks are all in memory writes nothing to the store: the uses of
        # its records wait for the next write, here the worker's stop
        mdb = data / "data.mdb"
        before = (mdb.stat().st_mtime_ns, mdb.stat().st_size)
        hits = d.metric("diffrag_kv_reuse_chunks_total", result="hit")
        again_q1 = ask_collection(d, [q1], top_k=100)[0]
        assert d.metric("diffrag_kv_reuse_chunks_total", result="hit") > hits
        assert (mdb.stat().st_mtime_ns, mdb.stat().st_size) == before
        # (its answer need not be the first one's: q2 placed the same documents whole, in the
        # same order, so this prompt's prefix comes from the prefix cache, blended for q2)
        assert again_q1["answer"] and again_q1["usage"]["cached_tokens"] > 0, again_q1
        assert d.stop() == 0
        log_a = d.log_text()
    assert mdb.stat().st_mtime_ns != before[0]
    # one record a placed text: a one-chunk document placed whole is that chunk, the same record
    placed = {(c["doc_id"], tuple(c["offsets"])) for r in first for c in r["citations"]}
    n_placed = len(placed)
    print("first run:", m1, held, [r["answer"] for r in first])
    assert m1["written"] == n_placed == held and m1["loaded"] == 0 and m1["error"] == 0, m1
    problems, n_records, out = store_verify(build_dir, data)
    assert problems == 0 and n_records == n_placed, out

    # records computed with other arithmetic (the prefill products' path) are not taken: a
    # copy of the store under a daemon whose products run another way makes its copies anew
    numerics = re.search(r'numerics="([^"]*)"', log_a).group(1)
    other = {"DIFFRAG_GEMM": "native" if "openblas" in numerics else "openblas"}
    shutil.copytree(data, tmp_path / "data-other")
    (tmp_path / "o").mkdir()
    with Daemon(tmp_path / "o", default_model, env=other,
                **dict(keys, data_dir=tmp_path / "data-other")) as d:
        assert 'numerics="%s"' % numerics not in d.log_text()
        ask_collection(d, [q1], top_k=100)
        m_other = records(d)
        assert m_other["loaded"] == 0 and m_other["written"] > 0, m_other
        assert d.stop() == 0

    # a new daemon on the same store takes every copy from the records and makes none: the
    # same bytes blended the same way give the same answers
    (tmp_path / "b").mkdir()
    with Daemon(tmp_path / "b", default_model, **keys) as d:
        again = [ask_collection(d, [q], **kw)[0] for q, kw in asks]
        m2 = records(d)
        miss = d.metric("diffrag_kv_reuse_chunks_total", result="miss")
        # deleting a document and replacing another take their chunks' records with them
        c = d.client()
        _, r = c.call({"v": 1, "op": "delete", "collection": "art", "ids": [docs[0]["id"]]})
        assert r["ok"], r
        changed = dict(docs[1], text=docs[1]["text"] + " This sentence was added later.")
        _, r = c.call({"v": 1, "op": "ingest", "collection": "art", "docs": [changed]},
                      timeout=120)
        assert r["ok"], r
        left = d.metric("diffrag_kv_reuse_records")
        assert d.stop() == 0
    print("second run:", m2, "miss", miss, [r["answer"] for r in again], "left", left)
    assert m2["loaded"] == n_placed and m2["written"] == 0 and miss == 0, (m2, miss)
    assert [r["answer"] for r in again] == [r["answer"] for r in first]
    assert [r["citations"] for r in again] == [r["citations"] for r in first]
    gone = {docs[0]["id"], docs[1]["id"]}
    expect = sum(1 for doc_id, _ in placed if doc_id not in gone)
    problems, n_records, out = store_verify(build_dir, data)
    assert problems == 0 and n_records == expect == left, (expect, left, out)


def test_sigkill_during_ingest_with_records(tmp_path, build_dir, default_model, squad_dir):
    """kill -9 while documents are replaced and questions write records: the store verifies
    (no record without its chunk, totals and checksums right) and opens again."""
    paras, (q1, q2) = squad_article(squad_dir, nth=3)
    docs = [{"id": p["id"], "title": p["title"], "text": p["text"]} for p in paras[:6]]
    data = tmp_path / "data"
    rng = random.Random(7)
    written = 0
    seen_records = 0
    for it in range(5):
        (tmp_path / str(it)).mkdir()
        with Daemon(tmp_path / str(it), default_model, workers=1, threads=2,
                    max_context_tokens=1536, max_tokens=8, relevance_floor=0, kv_reuse=1,
                    data_dir=data) as d:
            c = d.client()
            if it == 0:
                _, r = c.call({"v": 1, "op": "ingest", "collection": "art", "docs": docs},
                              timeout=120)
                assert r["ok"], r
                # one question answered first, so records exist before the kills
                _, r = c.call(query(q1, None, collection="art", top_k=100), timeout=600)
                assert r["ok"], r
            # questions and replacements in flight together, then the kill
            for j in range(12):
                if j % 2:
                    v = dict(rng.choice(docs))
                    v["text"] = v["text"] + " (revision %d.%d)" % (it, j)
                    c.send({"v": 1, "op": "ingest", "collection": "art", "docs": [v]})
                else:
                    c.send(query(rng.choice([q1, q2]), None, collection="art", top_k=100))
            time.sleep(rng.uniform(1.0, 5.0))
            written += records(d)["written"]
            d.proc.kill()
            d.proc.wait()
        problems, n_records, out = store_verify(build_dir, data)
        print("kill %d: %s" % (it, out.strip().splitlines()[0]))
        assert problems == 0, out
        seen_records = max(seen_records, n_records)
    assert written > 0 and seen_records > 0, (written, seen_records)
