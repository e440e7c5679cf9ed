"""Continuous batching through diffragd, as a user meets it: many queries at once over SQuAD 2.0
paragraphs (dev, CC BY-SA 4.0) get the same greedy answers, citations, groundedness figures and
token signals as the same queries asked one at a time of a daemon with max_running = 1; a
cancel and a deadline in a running batch leave the other answers unchanged; a KV pool of a few
pages, overcommitted on purpose (admitted by their projected needs, the queries would run a few
at a time and none would be preempted: tests/test_sched_pool.py), preempts and recomputes
sequences without changing an answer, answers every query, and is back at idle afterwards; a
prompt that can never fit the pool is answered `overloaded`."""
import json
import time

import gguf
import pytest
import zmq

from conftest import SMALL
from daemon_util import Daemon, query

# the daemons' prompt budget and cap of a query's max_tokens: the same for every daemon of this
# file, so a query gets the same prompt from each (and the automatic pool stays small)
CONTEXT = 1024
MAX_TOKENS = 256
# the self-check and context reliance on: they too must not depend on the batch. step_ms 0:
# the steps' sizes then do not depend on the machine's speed (under a sanitizer a 100 ms
# budget leaves 8 prefill tokens a step), so the step counts below mean the same everywhere
COMMON = dict(workers=1, threads=2, max_context_tokens=CONTEXT, max_tokens=MAX_TOKENS,
              grounding_self_check=1, grounding_reliance=1, step_ms=0)
# compared between a batched reply and the one-at-a-time reply of the same query
SAME = ("answer", "finish_reason", "citations", "token_signals", "grounding")
SAME_USAGE = ("prompt_tokens", "context_tokens", "completion_tokens")
# queries sent at once to the batching daemon, and to the one with a small pool (fewer at
# DIFFRAG_TEST_SCALE=small, still more than run at once or fit the pool)
N_BATCH = 8 if SMALL else 16
N_PREEMPT = 12 if SMALL else 32


def load(squad_dir):
    passages = [json.loads(l) for l in open(squad_dir / "passages.jsonl")]
    questions = [json.loads(l) for l in open(squad_dir / "questions.jsonl")]
    return passages, questions


def doc(p):
    return {"id": p["id"], "title": p["title"], "text": p["text"]}


def one_paragraph_queries(squad_dir, n, skip=0, max_chars=900):
    """(question, [paragraph]) for n different short paragraphs, each with an answerable
    question about it, in file order after the first `skip` of them."""
    passages, questions = load(squad_dir)
    by_id = {p["id"]: p for p in passages}
    out, seen = [], set()
    for q in questions:
        p = by_id.get(q["gold_passage_id"])
        if q["is_impossible"] or p is None or p["id"] in seen or len(p["text"]) > max_chars:
            continue
        seen.add(p["id"])
        out.append((q["question"], [doc(p)]))
    if len(out) < skip + n:
        pytest.fail("only %d short SQuAD paragraphs with a question" % len(out))
    return out[skip:skip + n]


def two_paragraph_queries(squad_dir, n, min_chars=1200, max_chars=2300):
    """(question, [paragraph, paragraph]) for n different pairs of consecutive paragraphs of
    one article (prompts of about 300 to 600 tokens), each with a question about one of them."""
    passages, questions = load(squad_dir)
    by_title = {}
    for p in passages:
        by_title.setdefault(p["title"], []).append(p)
    by_gold = {}
    for q in questions:
        by_gold.setdefault(q["gold_passage_id"], []).append(q)
    out = []
    for ps in by_title.values():
        for a, b in zip(ps[0::2], ps[1::2]):
            if not min_chars <= len(a["text"]) + len(b["text"]) <= max_chars:
                continue
            qs = by_gold.get(a["id"], []) + by_gold.get(b["id"], [])
            qs.sort(key=lambda q: q["is_impossible"])
            if qs:
                out.append((qs[0]["question"], [doc(a), doc(b)]))
            if len(out) == n:
                return out
    pytest.fail("only %d pairs of SQuAD paragraphs of %d..%d characters"
                % (len(out), min_chars, max_chars))


def ask(qid, question, docs, **kw):
    kw.setdefault("max_tokens", 24)
    # relevance_floor 0: every matching chunk is placed, so the prompts are as long as chosen
    return query(question, docs, id=qid, temperature=0, top_k=8, include=["token_signals"],
                 relevance_floor=0, **kw)


def one_at_a_time(d, msgs, timeout=300):
    """The final replies of msgs, asked of d one after another on one connection."""
    c = d.client()
    out = []
    for m in msgs:
        _, r = c.call(m, timeout=timeout)
        assert r["ok"], (m["id"], r)
        out.append(r)
    return out


def gather(pending, timeout):
    """Read every client of `pending` ({client: ids awaited}) until each awaited id has its
    final reply: ({id: [delta texts]}, {id: final reply}). Fails on a second final reply for one
    id, on a delta after its final reply, and when `timeout` seconds pass first."""
    poller = zmq.Poller()
    by_sock = {}
    for c in pending:
        poller.register(c.sock, zmq.POLLIN)
        by_sock[c.sock] = c
    deltas, finals = {}, {}
    end = time.time() + timeout

    def missing():
        return sorted(str(i) for ids in pending.values() for i in ids if i not in finals)

    while missing():
        left = end - time.time()
        if left <= 0:
            raise AssertionError("no final reply within %.0f s for %s" % (timeout, missing()))
        for sock, _ in poller.poll(int(left * 1000) + 1):
            c = by_sock[sock]
            while c.poll(0):
                m = c.recv(1)
                assert m["id"] not in finals, ("a message after the final reply", m)
                if "delta" in m and "ok" not in m:
                    deltas.setdefault(m["id"], []).append(m["delta"])
                else:
                    finals[m["id"]] = m
    return deltas, finals


def send_then_cancel(pairs, cs, target="stop", timeout=600):
    """Sends every (client, message) of `pairs` in order, then cancels `target` (sent by client
    cs) once its first message has come (a delta, unless it is already done): ({id: [delta
    texts]}, {id: final reply}) with the cancel's reply under "cancel-" + target."""
    for c, m in pairs:
        c.send(m)
    first = cs.recv(300)
    streaming = "delta" in first and "ok" not in first
    pending = {}
    for c, m in pairs:
        pending.setdefault(c, []).append(m["id"])
    pending[cs] = [i for i in pending[cs] if i != target or streaming] + ["cancel-" + target]
    cs.send({"v": 1, "op": "cancel", "id": "cancel-" + target, "target": target})
    deltas, finals = gather(pending, timeout=timeout)
    if streaming:
        deltas[target] = [first["delta"]] + deltas.get(target, [])
    else:
        finals[target] = first
    return deltas, finals


def assert_same(got, ref, what):
    """A batched reply equals the one-at-a-time reply of the same query."""
    assert got["ok"] is True, (what, got)
    for k in SAME:
        if k == "token_signals" and got.get(k) != ref.get(k):
            g, r = got.get(k) or {}, ref.get(k) or {}
            # per-token figures first: a window's score spreads to the tokens before it
            diff = sorted((f == "score", i, f, a, b) for f in set(g) | set(r)
                          for i, (a, b) in enumerate(zip(g.get(f, []), r.get(f, []))) if a != b)
            diff = [d[1:] for d in diff]
            raise AssertionError("%s: token_signals differ from token %s on (token, field, "
                                 "batched, alone): %s" % (what, diff[0][0] if diff else "?",
                                                          diff[:4] or "lengths or fields"))
        assert got.get(k) == ref.get(k), (what, k, got.get(k), ref.get(k))
    for k in SAME_USAGE:
        assert got["usage"][k] == ref["usage"][k], (what, k, got["usage"], ref["usage"])


def metric_sum(d, name, text=None):
    """Sum of the samples of one metric (every label set); None when /metrics has none."""
    total = None
    for line in (text or d.metrics()).splitlines():
        if line.startswith("#"):
            continue
        k, _, v = line.rpartition(" ")
        if k == name or k.startswith(name + "{"):
            total = (total or 0.0) + float(v)
    return total


def settle(d, name, want, timeout=30.0, **labels):
    """Wait for a gauge to read `want` (the worker may give pages back just after its reply);
    the last value read."""
    end = time.time() + timeout
    while True:
        v = d.metric(name, **labels) if labels else metric_sum(d, name)
        if v is None or v == want or time.time() > end:
            return v
        time.sleep(0.05)


def assert_idle(d):
    """After every reply: no query with a worker, no KV page in use."""
    running = settle(d, "diffrag_requests_running", 0.0)
    assert running == 0.0, "diffrag_requests_running %s after every reply" % running
    used = settle(d, "diffrag_kv_pool_pages", 0.0, state="used")
    assert used == 0.0, used


def page_bytes(model):
    """Bytes of one KV pool page of the model (64 positions, keys and values of every layer and
    KV head, f16)."""
    f = gguf.GGUFReader(str(model)).fields

    def get(key):
        return int(f["llama." + key].contents())
    head_dim = get("embedding_length") // get("attention.head_count")
    return 2 * get("block_count") * get("attention.head_count_kv") * 64 * head_dim * 2


@pytest.fixture(scope="module")
def serial(tmp_path_factory, default_model):
    """The reference: one query at a time (max_running = 1), the automatic KV pool."""
    d = Daemon(tmp_path_factory.mktemp("serial"), default_model, max_running=1, **COMMON)
    with d:
        yield d
        assert d.stop() == 0, d.log_text()[-2000:]


def test_batched_answers_equal_one_at_a_time(tmp_path, default_model, squad_dir, serial):
    msgs = [ask("b%d" % i, q, docs)
            for i, (q, docs) in enumerate(one_paragraph_queries(squad_dir, N_BATCH))]
    if SMALL:
        print("DIFFRAG_TEST_SCALE=small: %d queries at once instead of 16" % N_BATCH)
    with Daemon(tmp_path, default_model, max_running=16, **COMMON) as d:
        clients = [d.client() for _ in msgs]
        # every query is sent before any reply is read
        for c, m in zip(clients, msgs):
            c.send(m)
        running_seen = metric_sum(d, "diffrag_requests_running")
        _, finals = gather({c: [m["id"]] for c, m in zip(clients, msgs)}, timeout=600)
        text = d.metrics()
        steps = metric_sum(d, "diffrag_step_tokens_count", text)
        step_tokens = metric_sum(d, "diffrag_step_tokens_sum", text)
        assert_idle(d)
        assert d.stop() == 0, d.log_text()[-2000:]
    refs = one_at_a_time(serial, msgs)
    for m, ref in zip(msgs, refs):
        got = finals[m["id"]]
        print(m["id"], got.get("usage"), repr(got.get("answer", got.get("error"))))
        assert_same(got, ref, m["id"])
    generated = sum(r["usage"]["completion_tokens"] for r in refs)
    print("batched: %s engine steps of %s tokens (%.1f a step) for %d generated tokens; "
          "requests running just after sending: %s"
          % (steps, step_tokens, (step_tokens or 0) / max(1, steps or 0), generated, running_seen))
    assert steps is not None and steps > 0, "no diffrag_step_tokens_count on /metrics"
    assert step_tokens / steps > 1.0, (step_tokens, steps)
    # One at a time, each generated token (but a query's first) takes a step of its own: in a
    # batch the queries decode together, in far fewer steps than that.
    assert steps < (generated - len(msgs)) / 2, (steps, generated)


def test_cancel_and_deadline_leave_the_others_unchanged(tmp_path, default_model, squad_dir,
                                                        serial):
    qs = one_paragraph_queries(squad_dir, 6, skip=16)
    # the deadline's query first, then the one to cancel: both long, the others short
    late = ask("late", qs[0][0] + " Explain in detail.", qs[0][1], max_tokens=200, stream=True,
               deadline_ms=300)
    stop = ask("stop", qs[1][0] + " Explain in detail.", qs[1][1], max_tokens=200, stream=True)
    others = [ask("o%d" % i, q, docs, stream=True) for i, (q, docs) in enumerate(qs[2:])]
    msgs = [late, stop] + others
    with Daemon(tmp_path, default_model, max_running=8, **COMMON) as d:
        clients = [d.client() for _ in msgs]
        deltas, finals = send_then_cancel(list(zip(clients, msgs)), clients[1])
        assert_idle(d)
        assert d.stop() == 0, d.log_text()[-2000:]
    plain = [dict(m, stream=False) for m in msgs]
    for m in plain:
        m.pop("deadline_ms", None)
    refs = dict(zip([m["id"] for m in msgs], one_at_a_time(serial, plain)))
    for m in msgs:
        r = finals[m["id"]]
        print(m["id"], r.get("finish_reason"), r.get("usage"), repr(r.get("answer", r)))
    # the four others: as if alone
    for m in others:
        got = finals[m["id"]]
        assert_same(got, refs[m["id"]], m["id"])
        assert "".join(deltas.get(m["id"], [])) == got["answer"], m["id"]
    # the cancelled one: cancelled while running, with the answer so far (a prefix of its whole
    # answer); or done before the cancel came, and then the same as alone
    ack, got, ref = finals["cancel-stop"], finals["stop"], refs["stop"]
    print("cancel:", ack)
    assert got["ok"] is True, got
    assert "".join(deltas.get("stop", [])) == got["answer"]
    if ack["ok"]:
        assert ack == {"id": "cancel-stop", "ok": True, "found": True, "state": "running"}, ack
        assert got["finish_reason"] == "cancelled", got
        assert ref["answer"].startswith(got["answer"]), (got["answer"], ref["answer"])
        assert got["usage"]["completion_tokens"] <= ref["usage"]["completion_tokens"]
    else:
        assert ack["error"]["code"] == "not_found", ack
        assert_same(got, ref, "stop")
    # the deadline's: ended by it (so far) or done before it; or, on a machine slow enough that
    # the deadline passed before a worker took the query, deadline_exceeded
    got, ref = finals["late"], refs["late"]
    if not got["ok"]:
        assert got["error"]["code"] == "deadline_exceeded", got
    else:
        assert got["finish_reason"] in ("stop", "length", "deadline"), got
        assert "".join(deltas.get("late", [])) == got["answer"]
        if got["finish_reason"] == "deadline":
            assert ref["answer"].startswith(got["answer"]), (got["answer"], ref["answer"])
            assert got["usage"]["completion_tokens"] <= ref["usage"]["completion_tokens"]
        else:
            assert_same(got, ref, "late")


def test_small_pool_preempts_and_recovers(tmp_path, default_model, squad_dir, serial):
    pages = 40
    pool_positions = pages * 64
    msgs = [ask("p%d" % i, q, docs, max_tokens=32)
            for i, (q, docs) in enumerate(two_paragraph_queries(squad_dir, N_PREEMPT))]
    if SMALL:
        print("DIFFRAG_TEST_SCALE=small: %d queries instead of 32" % N_PREEMPT)
    # every query joins on its first chunk's pages (DIFFRAGD_FAULTS=sched_overcommit), so the
    # pool runs out and preempts
    with Daemon(tmp_path, default_model, max_running=16,
                kv_pool_bytes=pages * page_bytes(default_model), max_queue=64,
                env={"DIFFRAGD_FAULTS": "sched_overcommit=1"}, **COMMON) as d:
        clients = [d.client() for _ in msgs]
        for c, m in zip(clients, msgs):
            c.send(m)
        # none hangs: every query is answered
        _, finals = gather({c: [m["id"]] for c, m in zip(clients, msgs)}, timeout=600)
        assert_idle(d)
        preempted = metric_sum(d, "diffrag_preemptions_total")
        pool = d.metric("diffrag_kv_pool_pages", state="used") + \
            d.metric("diffrag_kv_pool_pages", state="cached") + \
            d.metric("diffrag_kv_pool_pages", state="free")
        assert d.stop() == 0, d.log_text()[-2000:]
    refs = one_at_a_time(serial, msgs)
    ok, differ, no_room = 0, [], 0
    for m, ref in zip(msgs, refs):
        got = finals[m["id"]]
        print(m["id"], ref["usage"]["prompt_tokens"], got.get("usage"),
              repr(got.get("answer", got.get("error"))))
        if got["ok"]:
            ok += 1
            # the self-check and the reliance after an answer take only pages that are free;
            # in a full pool they do not run (nil), and everything else is as one at a time
            for k in ("self_check", "context_reliance"):
                if got["grounding"][k] is None and ref["grounding"][k] is not None:
                    no_room += 1
                    got = dict(got, grounding=dict(got["grounding"], **{k: ref["grounding"][k]}))
            try:
                assert_same(got, ref, m["id"])
            except AssertionError as e:
                differ.append(str(e)[:400])
        else:
            # `overloaded` only for a prompt that could never fit the pool
            assert got["error"]["code"] == "overloaded", got
            assert ref["usage"]["prompt_tokens"] + m["max_tokens"] > pool_positions, (got, ref)
    print("pool of %d pages (%s on /metrics): %d of %d answered, preemptions: %s, self-checks "
          "or reliances without room: %d" % (pages, pool, ok, len(msgs), preempted, no_room))
    assert preempted is not None, "no diffrag_preemptions_total on /metrics"
    assert preempted > 0, "an overcommitted pool of %d pages preempted nothing" % pages
    assert pool == pages, pool
    assert not differ, "%d of %d answers differ from one at a time (preemptions: %s):\n%s" % (
        len(differ), ok, preempted, "\n".join(differ))


def test_prompt_larger_than_the_pool_is_overloaded(tmp_path, default_model, squad_dir, serial):
    """A pool of 4 pages (256 positions): a prompt of several hundred tokens can never fit and
    is answered `overloaded` at once; a short one is answered as alone."""
    (q_long, docs_long), = two_paragraph_queries(squad_dir, 1)
    short = ask("short", "How long is the Rhine?",
                [{"id": "rhine", "title": "Rhine", "text": "The Rhine is about 1,230 km long."}],
                max_tokens=16)
    long = ask("long", q_long, docs_long, max_tokens=16)
    with Daemon(tmp_path, default_model, max_running=4,
                kv_pool_bytes=4 * page_bytes(default_model), **COMMON) as d:
        c = d.client()
        _, r_long = c.call(long, timeout=120)
        _, r_short = c.call(short, timeout=120)
        assert_idle(d)
        assert d.stop() == 0, d.log_text()[-2000:]
    ref_long, ref_short = one_at_a_time(serial, [long, short])
    print("long prompt of %d tokens: %s" % (ref_long["usage"]["prompt_tokens"], r_long))
    assert ref_long["usage"]["prompt_tokens"] > 4 * 64, ref_long["usage"]
    assert r_long["ok"] is False and r_long["error"]["code"] == "overloaded", r_long
    assert ref_short["usage"]["prompt_tokens"] + 16 <= 4 * 64, ref_short["usage"]
    assert_same(r_short, ref_short, "short")


def test_step_ms_keeps_the_steps_beside_a_stream_short(tmp_path, default_model, squad_dir,
                                                       serial):
    """step_ms 1, far below any step's time: once the worker has measured a step, a step beside
    a decoding request takes at most 8 prefill tokens (step_tokens alone would take 64), and
    the answers stay those of one at a time."""
    (q_long, docs_long), = two_paragraph_queries(squad_dir, 1)
    (q_s, docs_s), = one_paragraph_queries(squad_dir, 1, skip=30)
    stream = ask("s", q_s + " Explain in detail, with every name and year.", docs_s,
                 max_tokens=200, stream=True)
    long = ask("l", q_long, docs_long, max_tokens=4)

    def buckets(d):
        out = {}
        for line in d.metrics().splitlines():
            if line.startswith("diffrag_step_tokens_bucket{"):
                le = line.split('le="')[1].split('"')[0]
                out[le] = float(line.rsplit(" ", 1)[1])
        return out

    with Daemon(tmp_path, default_model, max_running=8, **dict(COMMON, step_ms=1)) as d:
        cs, cl = d.client(), d.client()
        cs.send(stream)
        first = cs.recv(300)
        assert "delta" in first and "ok" not in first, first
        before = buckets(d)
        cl.send(long)
        deltas, finals = gather({cs: ["s"], cl: ["l"]}, timeout=600)
        after = buckets(d)
        assert d.stop() == 0, d.log_text()[-2000:]
    ref_s, ref_l = one_at_a_time(serial, [dict(stream, stream=False), long])
    assert_same(finals["l"], ref_l, "long")
    assert_same(finals["s"], ref_s, "stream")
    prompt = ref_l["usage"]["prompt_tokens"]
    steps = after["+Inf"] - before["+Inf"]
    over16 = steps - (after["16"] - before["16"])
    print("long prompt of %d tokens beside the stream: %d steps, %d of them over 16 tokens"
          % (prompt, steps, over16))
    assert finals["s"]["usage"]["completion_tokens"] > prompt / 9 + 5, finals["s"]["usage"]
    # the long prompt went in pieces of at most 8 tokens (beside the stream's one), nothing
    # larger than 16 tokens while the stream ran
    assert steps >= prompt / 9, (steps, prompt)
    assert over16 == 0, (over16, before, after)
