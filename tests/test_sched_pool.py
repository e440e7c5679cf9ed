"""The batch scheduler on a KV pool that holds only a few requests at once, through diffragd
with a tiny random model (thousands of tokens a second; its greedy answers never end before
max_tokens, so every request grows to its full size):

- a cancel storm: many streamed queries, each over a document of its own that an earlier
  query left in the prefix cache, every other one cancelled while it streams. No request that
  fits the pool alone is refused: every kept stream ends with its whole answer, none
  `overloaded`. Once with the scheduler's admission (a request joins when its projected need
  fits), once with it overcommitting on purpose (DIFFRAGD_FAULTS=sched_overcommit: a request
  joins on its first chunk's pages, so the pool runs out and requests are preempted and
  resumed, thousands of times);
- a tight pool does not thrash: 24 queries of 300 answer tokens at max_running 8 on a pool
  that holds three of them are admitted by their projected need (prompt plus max_tokens, less
  the cached prefix), so no request is preempted, and each answer equals the one-at-a-time
  answer."""
import time

import pytest
import zmq

from daemon_util import Daemon, fast_model, query
from test_batching import assert_idle, gather, metric_sum, page_bytes

OVERCOMMIT = {"DIFFRAGD_FAULTS": "sched_overcommit=1"}


def river_doc(k, rep):
    """A document of its own for query k (its first words differ from every other's, so its
    pages are its own after the prompt's first page), about 24 tokens a repetition."""
    return [{"id": "d%d" % k, "title": "River %d" % k,
             "text": ("The river %d is a European river that begins in the Swiss canton of "
                      "Graubunden and flows into the North Sea. " % k) * rep}]


def ask(k, rep, max_tokens, **kw):
    return query("Question number %d about the river?" % k, river_doc(k, rep), id=k,
                 max_tokens=max_tokens, temperature=0, **kw)


def cancel_storm(d, n, rep, max_tokens):
    """n streamed queries sent at once; odd k is cancelled after 1 + 7k mod 40 deltas. The
    prefix cache is warmed first: each query's prompt asked once (one answer token).
    Returns ({k: deltas seen}, {k: final reply})."""
    c = d.client()
    for k in range(n):
        _, r = c.call(ask(k, rep, 1), timeout=60)
        assert r["ok"], r
    clients = [d.client() for _ in range(n)]
    for k, cl in enumerate(clients):
        cl.send(ask(k, rep, max_tokens, stream=True))
    seen, finals, cancelled = {}, {}, set()
    pending = {cl: [k] for k, cl in enumerate(clients)}

    def on_delta(k, cl):
        seen[k] = seen.get(k, 0) + 1
        if k % 2 and k not in cancelled and seen[k] >= 1 + (7 * k) % 40:
            cancelled.add(k)
            cl.send({"v": 1, "op": "cancel", "id": "cancel-%d" % k, "target": k})
            pending[cl].append("cancel-%d" % k)

    # gather() with a hook: read every reply, cancelling as the deltas come
    poller = zmq.Poller()
    for cl in clients:
        poller.register(cl.sock, zmq.POLLIN)
    by_sock = {cl.sock: (k, cl) for k, cl in enumerate(clients)}
    end = time.time() + 300
    while any(i not in finals for ids in pending.values() for i in ids):
        assert time.time() < end, "no final reply within 300 s"
        for sock, _ in poller.poll(1000):
            k, cl = by_sock[sock]
            while cl.poll(0):
                m = cl.recv(1)
                if "delta" in m and "ok" not in m:
                    assert m["id"] == k and k not in finals, m
                    on_delta(k, cl)
                else:
                    assert m["id"] not in finals, ("a second final reply", m)
                    finals[m["id"]] = m
    return seen, finals


# (pool pages, document repetitions, max_tokens): each request needs 12 of 16 pages, or 20 of
# 28, once its answer is whole
STORMS = [(16, 3, 400), (28, 12, 300)]


@pytest.mark.parametrize("overcommit", [False, True], ids=["admission", "overcommit"])
def test_cancel_storm_refuses_no_request_that_fits(tmp_path, overcommit):
    model = fast_model(tmp_path)
    for pages, rep, max_tokens in STORMS:
        (tmp_path / str(pages)).mkdir()
        with Daemon(tmp_path / str(pages), model, workers=1, threads=1, max_running=8,
                    kv_pool_bytes=pages * page_bytes(model), max_queue=64,
                    env=OVERCOMMIT if overcommit else None) as d:
            seen, finals = cancel_storm(d, 32, rep, max_tokens)
            preempted = metric_sum(d, "diffrag_preemptions_total")
            assert_idle(d)
            assert d.stop() == 0, d.log_text()[-2000:]
        prompt = finals[0]["usage"]["prompt_tokens"]
        need = -(-(prompt + max_tokens) // 64)
        refused = sorted((k, seen.get(k, 0)) for k, r in finals.items()
                         if isinstance(k, int) and k % 2 == 0 and not r["ok"])
        print("pool of %d pages, requests of up to %d pages (prompt %d + %d): preemptions %s, "
              "kept streams refused (query, deltas before): %s"
              % (pages, need, prompt, max_tokens, preempted, refused))
        assert need <= pages
        assert not refused, "kept streams that fit the pool alone were refused: %s: %s" % (
            refused, [finals[k]["error"] for k, _ in refused][:3])
        for k in range(0, 32, 2):
            r = finals[k]
            assert r["finish_reason"] == "length", r
            assert r["usage"]["completion_tokens"] == max_tokens, r["usage"]
        for k in range(1, 32, 2):
            assert finals[k]["ok"], finals[k]
            assert finals[k]["finish_reason"] in ("cancelled", "length"), finals[k]
        if overcommit:
            # the scheduler was made to run out of pages: the preemption path did the work
            assert preempted and preempted > 100, preempted


def test_tight_pool_admits_by_projected_need(tmp_path):
    """24 queries of about 240 prompt tokens and 300 answer tokens (9 pages each) on a pool of
    28 pages at max_running 8: three run at once, none is preempted; a request joined on its
    first chunk's pages alone would run eight at once and preempt hundreds of times."""
    model = fast_model(tmp_path)
    msgs = [ask(k, 1, 300) for k in range(24)]
    (tmp_path / "serial").mkdir()
    with Daemon(tmp_path / "serial", model, workers=1, threads=1, max_running=1) as d:
        c = d.client()
        refs = [c.call(m, timeout=60)[1] for m in msgs]
        assert d.stop() == 0, d.log_text()[-2000:]
    need = -(-(refs[0]["usage"]["prompt_tokens"] + 300) // 64)
    (tmp_path / "tight").mkdir()
    with Daemon(tmp_path / "tight", model, workers=1, threads=1, max_running=8,
                kv_pool_bytes=28 * page_bytes(model), max_queue=64) as d:
        clients = [d.client() for _ in msgs]
        for cl, m in zip(clients, msgs):
            cl.send(m)
        _, finals = gather({cl: [m["id"]] for cl, m in zip(clients, msgs)}, timeout=300)
        text = d.metrics()
        preempted = metric_sum(d, "diffrag_preemptions_total", text)
        steps = metric_sum(d, "diffrag_step_tokens_count", text)
        assert_idle(d)
        assert d.stop() == 0, d.log_text()[-2000:]
    generated = sum(r["usage"]["completion_tokens"] for r in refs)
    print("24 requests of %d pages on 28: preemptions %s, %s steps for %d answer tokens"
          % (need, preempted, steps, generated))
    assert 3 * need <= 28 < 4 * need, need
    for m, ref in zip(msgs, refs):
        got = finals[m["id"]]
        assert got["ok"] and got["answer"] == ref["answer"], (m["id"], got, ref)
    assert preempted == 0, "a tight pool thrashed: %s preemptions" % preempted
    # and the requests still ran together: three decode tokens in most steps
    assert steps < generated / 2, (steps, generated)
