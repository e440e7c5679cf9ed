"""Answer quality of Qwen2.5-Coder-0.5B-Instruct through diffragd (tools/eval-answers.py): the
first 50 answerable SQuAD 2.0 questions (dev, CC BY-SA 4.0; file order), each with its gold
paragraph as the one inline document, greedy, the daemon's own prompt: the share of answers that
contain a gold answer (SQuAD's normalisation); and the first 50 unanswerable ones: the share the
model declines with the refusal the prompt prescribes. The answer bar is the measured share
(docs/evaluation.md) less 0.10. The measured decline share (0.06) less 0.10 would be no bar at
all: the test asks instead that the model still declines some unanswerable question (at least
one of 50) and declines almost no answerable one (at most 0.10)."""

import pytest

from conftest import ROOT, SMALL, load_tool
from daemon_util import Daemon

QWEN = ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
MEASURED_ANSWERED = 0.56   # docs/evaluation.md: 28 of the first 50 answerable questions
MEASURED_DECLINED = 0.06   # 3 of the first 50 unanswerable ones
# DIFFRAG_TEST_SCALE=small (conftest.py): the first 8 questions of each kind instead of 50, each
# checked for a sane reply (its paragraph placed, a non-empty answer that ends its turn); too
# few for the measured shares, which the full run checks.
N = 8 if SMALL else 50


@pytest.fixture(scope="module")
def results(tmp_path_factory, squad_dir):
    if not QWEN.exists():
        pytest.fail(f"Qwen model missing: run `make model` ({QWEN})")
    tool = load_tool("eval-answers.py")
    passages, questions = tool.ec.load_squad(squad_dir)
    answerable, unanswerable = tool.pick(questions, N)
    d = Daemon(tmp_path_factory.mktemp("answers"), QWEN, workers=1, threads=2,
               heartbeat_liveness=10)
    with d:
        with tool.ec.Asker(d.endpoint, d.proc) as asker:
            out = tool.ask_all(asker, answerable + unanswerable, passages, timeout=600)
        assert d.stop() == 0
    for r in out:
        print("%-12s %-8s %r (gold %s)" % (
            "unanswerable" if r["is_impossible"] else "answerable",
            "declined" if r["declined"] else "answered" if r["answered"] else "-",
            r["answer"][:120], r["gold"][:2]))
    s = tool.summary(out)
    print("answerable: %d, contain a gold answer %.2f, declined %.2f; unanswerable: %d, declined "
          "%.2f (abstained %.2f, gave the plausible wrong span %.2f)" % (
              s["answerable_n"], s["answered"], s["answerable_declined"], s["unanswerable_n"],
              s["declined"], s["abstained"], s["gave_plausible"]))
    return out, s


def test_replies_are_sane(results):
    out, _ = results
    assert len(out) == 2 * N
    for r in out:
        assert r["placed"] >= 1, r          # the gold paragraph was in the prompt
        assert r["answer"].strip(), r
        assert r["completion_tokens"] >= 1, r
    # the model ends its turn on its own for most questions (a runaway answer hits max_tokens)
    assert sum(r["finish"] == "stop" for r in out) >= 0.8 * len(out), \
        [(r["finish"], r["answer"][-60:]) for r in out]


@pytest.mark.skipif(SMALL, reason="the measured shares need all 50 questions of each kind "
                                  "(DIFFRAG_TEST_SCALE=small asks 8)")
def test_answer_shares_hold(results):
    _, s = results
    assert s["answered"] >= MEASURED_ANSWERED - 0.10, s
    assert s["declined"] >= max(MEASURED_DECLINED - 0.10, 1 / N), s
    assert s["answerable_declined"] <= 0.10, s
