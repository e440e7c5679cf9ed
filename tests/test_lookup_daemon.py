"""Prompt-lookup decoding through diffragd's batch scheduler (lookup_tokens): queries over SQuAD
2.0 paragraphs (dev, CC BY-SA 4.0) asked at once of a daemon that drafts get the same greedy
answers, citations, quotes, groundedness figures and token signals as the same queries asked
one at a time of a daemon with lookup_tokens = 0, in free and in quote decoding; /metrics
counts the drafted tokens and the accepted ones (some are accepted: the answers copy from the
paragraphs), and none without lookup."""
import pytest
from conftest import SMALL
from daemon_util import Daemon
from test_batching import (COMMON, assert_idle, assert_same, ask, gather, metric_sum,
                           one_at_a_time, one_paragraph_queries)

N = 4 if SMALL else 8


def lookup_counts(d):
    text = d.metrics()
    return (d.metric("diffrag_lookup_tokens_total", kind="drafted"),
            d.metric("diffrag_lookup_tokens_total", kind="accepted"), text)


@pytest.mark.parametrize("mode", ["free", "quote"])
def test_lookup_answers_equal_plain_decoding(tmp_path, default_model, squad_dir, mode):
    """In quote decoding the drafts continue the span being quoted (quote_draft)."""
    (tmp_path / "lookup").mkdir()
    (tmp_path / "plain").mkdir()
    msgs = [ask("l%d" % i, q, docs, max_tokens=64, answer_mode=mode)
            for i, (q, docs) in enumerate(one_paragraph_queries(squad_dir, N, skip=40))]
    with Daemon(tmp_path / "lookup", default_model, max_running=8, **COMMON) as d:
        clients = [d.client() for _ in msgs]
        for c, m in zip(clients, msgs):
            c.send(m)
        _, finals = gather({c: [m["id"]] for c, m in zip(clients, msgs)}, timeout=600)
        drafted, accepted, _ = lookup_counts(d)
        assert_idle(d)
        assert d.stop() == 0, d.log_text()[-2000:]
    with Daemon(tmp_path / "plain", default_model, max_running=1, lookup_tokens=0,
                **COMMON) as p:
        refs = one_at_a_time(p, msgs)
        plain_drafted, _, text = lookup_counts(p)
        steps = metric_sum(p, "diffrag_step_tokens_count", text)
        assert p.stop() == 0, p.log_text()[-2000:]
    for m, ref in zip(msgs, refs):
        got = finals[m["id"]]
        print(m["id"], got.get("usage"), repr(got.get("answer", got.get("error"))))
        assert_same(got, ref, m["id"])
        assert got.get("quotes") == ref.get("quotes"), m["id"]
        assert (mode == "quote") == bool(ref.get("quotes")), (mode, ref.get("quotes"))
    generated = sum(r["usage"]["completion_tokens"] for r in refs)
    print(mode, "lookup: %s drafted, %s accepted over %d generated tokens; plain: %s steps"
          % (drafted, accepted, generated, steps))
    assert plain_drafted == 0
    assert drafted is not None and accepted is not None and 0 < accepted <= drafted
