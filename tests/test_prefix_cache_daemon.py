"""The prefix cache through diffragd, as a user meets it: two different questions over the same
SQuAD paragraphs (chunks in document order), then the first again. With prefix_cache = 1 the
later questions take the documents' pages from the cache (usage.cached_tokens), and every
answer, citation and groundedness figure equals that of a daemon with the cache off; /metrics
counts the reused tokens and the pool is back at idle afterwards."""
import json

from daemon_util import Daemon, query, squad_article
from test_batching import settle


def ask(d, docs, questions):
    out = []
    c = d.client()
    for i, q in enumerate(questions):
        _, r = c.call(query(q, docs, id=i, order="document", top_k=100, max_tokens=24,
                            include=["token_signals"]), timeout=300)
        assert r["ok"], r
        out.append(r)
    return out


def test_cached_answers_equal_cold_answers(tmp_path, default_model, squad_dir):
    paras, (q1, q2) = squad_article(squad_dir)
    docs = [{"id": p["id"], "title": p["title"], "text": p["text"]} for p in paras]
    questions = [q1, q2, q1]
    runs = {}
    for cache in (1, 0):
        (tmp_path / f"cache{cache}").mkdir()
        # relevance_floor 0: the two questions place the same chunks, whatever their scores
        with Daemon(tmp_path / f"cache{cache}", default_model, workers=1, threads=2,
                    max_context_tokens=3072, max_tokens=64, prefix_cache=cache,
                    relevance_floor=0) as d:
            runs[cache] = ask(d, docs, questions)
            _, bad = d.client().call(query(q1, docs, id="bad", order="sideways"), timeout=60)
            assert not bad["ok"] and bad["error"]["code"] == "bad_request", bad
            assert "order" in bad["error"]["message"], bad
            if cache:
                hit = d.metric("diffrag_prefix_cache_hit_tokens_total")
                queried = d.metric("diffrag_prefix_cache_queried_tokens_total")
                # the worker gives a sequence's pages back just after its final reply
                used = settle(d, "diffrag_kv_pool_pages", 0.0, state="used")
                cached_pages = d.metric("diffrag_kv_pool_pages", state="cached")
            assert d.stop() == 0
    warm, cold = runs[1], runs[0]
    for r in warm + cold:
        print(r["usage"], r["timings"]["prefill_ms"], repr(r["answer"]))
    cached = [r["usage"]["cached_tokens"] for r in warm]
    assert cached[0] == 0 and all(r["usage"]["cached_tokens"] == 0 for r in cold), cached
    # the second question reuses the documents (everything up to the question's page)
    ctx = warm[1]["usage"]["context_tokens"]
    assert cached[1] >= ctx - 128 and cached[1] % 64 == 0, (cached, ctx)
    # the first again: all but its last page
    assert cached[2] >= warm[2]["usage"]["prompt_tokens"] - 64, cached
    for w, c in zip(warm, cold):
        assert w["answer"] == c["answer"]
        assert w["citations"] == c["citations"]
        assert w["usage"]["prompt_tokens"] == c["usage"]["prompt_tokens"]
        for k in ("lookback_ratio", "unsupported_token_ratio", "mean_logprob", "min_logprob",
                  "score", "flagged", "abstained"):
            assert w["grounding"][k] == c["grounding"][k], k
        assert w["token_signals"] == c["token_signals"]
    assert hit == sum(cached)
    assert queried == sum(r["usage"]["prompt_tokens"] for r in warm)
    assert used == 0 and cached_pages > 0, (used, cached_pages)


def test_cli_order_document_shares_the_prefix(tmp_path, default_model, squad_dir):
    """`diffrag ask --order document`: two different questions over the same files get the
    same prompt up to the question, and the second says how much came from the cache."""
    import subprocess

    from conftest import BUILD, ROOT
    paras, (q1, q2) = squad_article(squad_dir)
    files = []
    for i, p in enumerate(paras[:3]):
        f = tmp_path / ("p%d.txt" % i)
        f.write_text(p["text"])
        files += ["-d", str(f)]
    (tmp_path / "d").mkdir()
    with Daemon(tmp_path / "d", default_model, workers=1, threads=2, max_context_tokens=3072,
                max_tokens=64, relevance_floor=0) as d:
        def ask(q, *extra):
            return subprocess.run([str(BUILD / "diffrag"), "--endpoint", d.endpoint, "ask", "--json",
                                   "--max-tokens", "8", "--top-k", "50", *extra, *files, q],
                                  cwd=ROOT, capture_output=True, text=True, timeout=300)
        r1 = ask(q1, "--order", "document")
        r2 = ask(q2, "--order", "document")
        bad = ask(q1, "--order", "sideways")
        assert d.stop() == 0
    assert r1.returncode == 0 and r2.returncode == 0, (r1.stderr, r2.stderr)
    u1, u2 = json.loads(r1.stdout)["usage"], json.loads(r2.stdout)["usage"]
    print(u1, u2)
    assert u1["cached_tokens"] == 0 and u2["cached_tokens"] >= u2["context_tokens"] - 128, (u1, u2)
    assert bad.returncode == 2 and "--order" in bad.stderr, bad.stderr


def long_document(squad_dir, min_chars):
    """One SQuAD article's paragraphs joined: at least min_chars characters."""
    ps = [json.loads(l) for l in open(squad_dir / "passages.jsonl")]
    by_title = {}
    for p in ps:
        by_title.setdefault(p["title"], []).append(p["text"])
    for texts in by_title.values():
        text = "\n\n".join(texts)
        if len(text) >= min_chars:
            return text
    raise AssertionError("no SQuAD article of %d characters" % min_chars)


def test_every_chunk_placed_reads_the_document_whole(tmp_path, default_model, squad_dir):
    """A ~3K-token document sent inline with a top_k that places all its chunks and no
    relevance floor goes in whole, in its own order, whatever the question ranked best: two
    different questions get the same prompt up to the question, and the second takes the
    document from the prefix cache."""
    text = long_document(squad_dir, 12000)[:12000]
    doc = [{"text": text}]
    with Daemon(tmp_path, default_model, workers=1, threads=2, max_context_tokens=6144,
                max_tokens=8, relevance_floor=0) as d:
        c = d.client()
        rs = []
        for i, q in enumerate(["Which people and which century does the text tell of?",
                               "What happened to the people, and when, in the text?"]):
            _, r = c.call(query(q, doc, id=i, top_k=100, max_tokens=4,
                                     max_context_tokens=6144), timeout=300)
            assert r["ok"], r
            rs.append(r)
        assert d.stop() == 0
    for r in rs:
        print(r["context"], r["usage"])
    ctx = [r["context"] for r in rs]
    u1, u2 = rs[0]["usage"], rs[1]["usage"]
    assert all(x["whole"] and x["chunks_left_out"] == 0 for x in ctx), ctx
    assert [len(r["citations"]) for r in rs] == [1, 1] and rs[0]["citations"][0]["whole"]
    assert ctx[0]["placed_tokens"] == ctx[0]["doc_tokens"] > 2000, ctx
    assert u1["cached_tokens"] == 0, u1
    # everything up to the question's page comes from the cache: the document
    assert u2["cached_tokens"] >= ctx[1]["doc_tokens"] and u2["cached_tokens"] % 64 == 0, u2


def test_a_long_stored_document_is_read_as_a_window(tmp_path, default_model, squad_dir):
    """A stored ~3.5K-token document asked with a 3K budget and no relevance floor, the query
    naming no order: each question reads the document's opening in order (the first citation,
    from byte 0, the same for both) and then its best chunks outside it, and the second
    question takes the opening from the prefix cache. Naming an order reads chunks instead.
    The CLI's read line says what was read."""
    import subprocess
    from conftest import BUILD
    text = long_document(squad_dir, 16000)[:16000]
    text = text[:text.rindex("\n\n")]
    qs = ["Which people and which century does the text tell of?",
          "What happened to the people, and when, in the text?"]
    with Daemon(tmp_path, default_model, workers=1, threads=2, max_context_tokens=3072,
                max_tokens=8, relevance_floor=0) as d:
        c = d.client()
        _, r = c.call({"v": 1, "op": "ingest", "id": "i", "collection": "long",
                       "docs": [{"id": "article", "title": "An article", "text": text}]},
                      timeout=120)
        assert r["ok"], r
        rs = []
        for i, q in enumerate(qs + qs[:1]):
            extra = {"order": "rank"} if i == 2 else {}
            _, r = c.call(query(q, collection="long", id=i, max_tokens=4,
                                max_context_tokens=3072, **extra), timeout=300)
            assert r["ok"], r
            rs.append(r)
        cli = subprocess.run([str(BUILD / "diffrag"), "--endpoint", d.endpoint, "ask", "-c",
                              "long", "--relevance-floor", "0", "--max-tokens", "4",
                              "--max-context-tokens", "3072", qs[1]],
                             capture_output=True, text=True, timeout=300)
        assert d.stop() == 0
    for r in rs:
        print(r["context"], r["usage"], [x["offsets"] for x in r["citations"]])
    w1, w2, ranked = rs
    for r in (w1, w2):
        cx, first = r["context"], r["citations"][0]
        assert cx["window"] and not cx["whole"] and first["offsets"][0] == 0, cx
        assert first["doc_id"] == "article" and not first["whole"] and len(r["citations"]) > 1
        assert cx["chunks_placed"] + cx["chunks_left_out"] == cx["chunks_matched"], cx
        # the chunks after the opening lie outside it
        assert all(x["offsets"][1] > first["offsets"][1] for x in r["citations"][1:])
    assert w1["citations"][0]["offsets"] == w2["citations"][0]["offsets"]
    opening = w1["citations"][0]["offsets"][1]
    assert 1024 * 3 < opening < len(text), opening
    u1, u2 = w1["usage"], w2["usage"]
    assert u1["cached_tokens"] == 0 and u2["cached_tokens"] >= u2["context_tokens"] - 800, (u1, u2)
    assert not ranked["context"]["window"] and len(ranked["citations"]) > 3
    assert cli.returncode == 0, cli.stderr
    assert "the best document's opening in order, then the best chunks outside it" in cli.stdout, \
        cli.stdout


def test_cli_and_openai_api_share_a_documents_prefix(tmp_path, default_model, squad_dir):
    """The same text asked about through `diffrag ask -d FILE` and then through the OpenAI API
    (diffrag.docs, a bare string) gets the same prompt up to the question: the API's request
    takes the document from the prefix cache, and so does the CLI's after the API's."""
    import http.client
    import subprocess

    from conftest import BUILD, ROOT
    text = long_document(squad_dir, 4000)[:4000]
    f = tmp_path / "article.txt"
    f.write_text(text)
    (tmp_path / "d").mkdir()
    with Daemon(tmp_path / "d", default_model, workers=1, threads=2, max_context_tokens=4096,
                max_tokens=8, relevance_floor=0) as d:
        def cli(q):
            p = subprocess.run([str(BUILD / "diffrag"), "--endpoint", d.endpoint, "ask",
                                "--json", "--max-tokens", "4", "-d", str(f), q],
                               cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert p.returncode == 0, p.stderr
            return json.loads(p.stdout)

        def api(q):
            body = json.dumps({"model": "m", "max_tokens": 4, "diffrag": {"docs": [text]},
                               "messages": [{"role": "user", "content": q}]})
            h = http.client.HTTPConnection("127.0.0.1", d.http_port, timeout=300)
            h.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            r = h.getresponse()
            assert r.status == 200
            return json.loads(r.read())
        a = cli("Who ruled the region?")
        b = api("Which century is it about?")
        e = cli("Where did they come from?")
        assert d.stop() == 0
    print(a["usage"], a["context"], b["usage"], e["usage"])
    assert a["context"]["whole"] and a["usage"]["cached_tokens"] == 0, a["usage"]
    doc_tokens = a["context"]["doc_tokens"]
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= doc_tokens, b["usage"]
    assert e["usage"]["cached_tokens"] >= doc_tokens, e["usage"]


def _api(d, body):
    import http.client
    h = http.client.HTTPConnection("127.0.0.1", d.http_port, timeout=300)
    h.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = h.getresponse()
    assert r.status == 200
    return json.loads(r.read())


def _python_client(d):
    import sys

    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "clients" / "python"))
    import diffrag
    return diffrag.Client(d.endpoint, timeout=300)


def test_one_prompt_through_all_four_interfaces(tmp_path, default_model, squad_dir):
    """The same question over the same text through the CLI (`ask -d`), the msgpack protocol,
    the Python client and the OpenAI API frames the same prompt: each request after the first
    takes all of it but its last page from the prefix cache."""
    import subprocess

    from conftest import BUILD, ROOT
    text = long_document(squad_dir, 4000)[:4000]
    f = tmp_path / "article.txt"
    f.write_text(text)
    q = "Who ruled the region, and when?"
    (tmp_path / "d").mkdir()
    with Daemon(tmp_path / "d", default_model, workers=1, threads=2, max_context_tokens=4096,
                max_tokens=4, relevance_floor=0) as d:
        p = subprocess.run([str(BUILD / "diffrag"), "--endpoint", d.endpoint, "ask", "--json",
                            "--max-tokens", "4", "-d", str(f), q],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        cli = json.loads(p.stdout)["usage"]
        _, r = d.client().call(query(q, [{"text": text}], id=1, max_tokens=4), timeout=300)
        assert r["ok"], r
        raw = r["usage"]
        with _python_client(d) as c:
            a = c.query(q, docs=[text], max_tokens=4)
        py = {"prompt_tokens": a.usage.prompt_tokens, "cached_tokens": a.usage.cached_tokens}
        o = _api(d, {"model": "m", "max_tokens": 4, "diffrag": {"docs": [text]},
                     "messages": [{"role": "user", "content": q}]})["usage"]
        api = {"prompt_tokens": o["prompt_tokens"],
               "cached_tokens": o["prompt_tokens_details"]["cached_tokens"]}
        assert d.stop() == 0
    uses = {"cli": cli, "msgpack": raw, "python": py, "openai": api}
    print(uses)
    n = cli["prompt_tokens"]
    assert n > 900 and cli["cached_tokens"] == 0, uses
    for name in ("msgpack", "python", "openai"):
        u = uses[name]
        assert u["prompt_tokens"] == n, (name, uses)
        assert n - 64 <= u["cached_tokens"] < n, (name, uses)


def test_a_follow_up_reuses_the_question_it_follows(tmp_path, default_model, squad_dir):
    """A conversation over one inline document: the follow-up, sent with the first question
    and its answer as `history`, begins with the whole prompt of the first question and takes
    it from the prefix cache, through the msgpack protocol, the Python client and the OpenAI
    API's messages; the earlier turns are placed after the documents."""
    text = long_document(squad_dir, 4000)[:4000]
    q1, q2 = "Who ruled the region?", "And in which century?"
    (tmp_path / "d").mkdir()
    with Daemon(tmp_path / "d", default_model, workers=1, threads=2, max_context_tokens=4096,
                max_tokens=12, relevance_floor=0) as d:
        c = d.client()
        _, r1 = c.call(query(q1, [{"text": text}], id=1, max_tokens=12), timeout=300)
        assert r1["ok"], r1
        hist = [{"role": "user", "content": q1}, {"role": "assistant", "content": r1["answer"]}]
        _, r2 = c.call(query(q2, [{"text": text}], id=2, max_tokens=12, history=hist), timeout=300)
        assert r2["ok"], r2
        with _python_client(d) as pc:
            a3 = pc.query(q2, docs=[text], max_tokens=12, history=hist)
        third = hist + [{"role": "user", "content": q2}, {"role": "assistant", "content": a3.answer}]
        o = _api(d, {"model": "m", "max_tokens": 12, "diffrag": {"docs": [text]},
                     "messages": third + [{"role": "user", "content": "Who came after them?"}]})
        assert d.stop() == 0
    n1 = r1["usage"]["prompt_tokens"]
    u2 = r2["usage"]
    print(r1["usage"], u2, a3.usage, o["usage"], r2["context"])
    assert r1["usage"]["cached_tokens"] == 0 and r1["context"]["whole"], r1["usage"]
    assert r2["context"]["history_turns"] == 2 and r2["context"]["whole"], r2["context"]
    # the follow-up's prompt begins with all of the first one's
    assert u2["prompt_tokens"] > n1 and u2["cached_tokens"] >= n1 - 64, (n1, u2)
    # the same follow-up again, through Python: all but its last page
    assert a3.usage.prompt_tokens == u2["prompt_tokens"], (a3.usage, u2)
    assert a3.usage.cached_tokens >= u2["prompt_tokens"] - 64, a3.usage
    # a third turn through the API begins with the second turn's prompt
    ou = o["usage"]
    assert ou["prompt_tokens_details"]["cached_tokens"] >= u2["prompt_tokens"] - 64, ou
    assert o["diffrag"]["context"]["history_turns"] == 4, o["diffrag"]["context"]
