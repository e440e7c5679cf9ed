"""`make eval-rag` at a small scale with the tests' model: one SQuAD article's collection of
about 2,500 tokens, two questions, a budget under the collection's size and one over it. Under
it the best chunks fill the budget; over it every document the search found goes in whole, and
in document order the second question takes the first's prompt from the prefix cache."""
import json
import subprocess
import sys

from conftest import ROOT


def eval_rag(tmp_path, model, *args):
    """tools/eval-rag.py over one article's two questions: (its stdout, its result rows)."""
    out = tmp_path / "rag.jsonl"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "eval-rag.py"), "--model",
                        str(model), "--articles", "1", "--per-article", "2",
                        "--corpus-tokens", "2500", "--json", str(out)] + list(args),
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(r.stdout, r.stderr[-3000:])
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, [json.loads(line) for line in out.read_text().splitlines()]


def test_eval_rag_small(tmp_path, default_model):
    stdout, rows = eval_rag(tmp_path, default_model, "--budgets", "1024,4096")
    by = {}
    for x in rows:
        by.setdefault((x["budget"], x["order"]), []).append(x)
    assert sorted(by) == [(0, "oracle"), (1024, "document"), (1024, "rank"), (4096, "document"),
                          (4096, "rank")], sorted(by)
    assert all(len(v) == 2 for v in by.values())
    assert all(x["whole"] and x["gold_placed"] for x in by[(0, "oracle")])
    # the answer's chunk: the oracle's one paragraph holds it; a chunk of it holds it only
    # where the gold paragraph was placed, at a rank among the placed chunks
    assert all(x["answer_rank"] == 1 for x in by[(0, "oracle")])
    assert all(x["gold_placed"] and 1 <= x["answer_rank"] for x in rows
               if x["answer_rank"] is not None)
    assert not any(x["whole"] for x in by[(1024, "rank")] + by[(1024, "document")])
    assert all(x["prompt_tokens"] <= 1024 for x in by[(1024, "rank")])
    big = by[(4096, "rank")] + by[(4096, "document")]
    assert all(x["whole"] and x["gold_placed"] for x in big), big
    second = by[(4096, "document")][1]
    assert second["cached_tokens"] >= second["prompt_tokens"] - 128, second
    # the table: one row per budget and order, and the oracle's
    table = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 1 + 4 and table[1].startswith("| gold paragraph | oracle |"), table
    assert " | 2 / 2 / 2 | " in table[1], table[1]


def test_eval_rag_each_chunk(tmp_path, default_model):
    """--each-chunk: each placed chunk asked alone; every choice is one of those answers, so the
    joined answers contain a gold answer whenever a choice does."""
    stdout, rows = eval_rag(tmp_path, default_model, "--budgets", "1024", "--orders", "rank",
                            "--each-chunk")
    by = {}
    for x in rows:
        by.setdefault(x["order"], []).append(x)
    signals = ["rank, each chunk by %s" % s for s in
               ("hidden_probe", "score", "self_check", "mean_logprob")]
    assert sorted(by) == sorted(["oracle", "rank", "rank, any chunk's answer"] + signals), by
    assert all(len(v) == 2 for v in by.values())
    for i, joined in enumerate(by["rank, any chunk's answer"]):
        assert joined["f1"] is None
        for s in signals:
            chosen = by[s][i]["answer"]
            assert chosen and chosen in joined["answer"], (chosen, joined["answer"])
            assert joined["contains"] >= by[s][i]["contains"]
    table = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert any(line.startswith("| 1024 | rank, any chunk's answer | ") and " | - | " in line
               for line in table), table


def test_eval_rag_another_sample_and_kv_type(tmp_path, default_model):
    """--skip-articles K asks the questions of the articles after the first K; --kv-type runs
    the daemon with that KV cache, and the summary line says which."""
    first = {x["id"] for x in eval_rag(tmp_path, default_model, "--budgets", "1024", "--orders",
                                       "rank")[1]}
    (tmp_path / "next").mkdir()
    stdout, rows = eval_rag(tmp_path / "next", default_model, "--budgets", "1024", "--orders",
                            "rank", "--skip-articles", "1", "--kv-type", "q8")
    ids = {x["id"] for x in rows}
    assert len(ids) == len(first) == 2 and not ids & first, (ids, first)
    summary = stdout.splitlines()[0]
    assert "1 articles after the first 1, 2 questions" in summary and "; q8 KV;" in summary, \
        summary
