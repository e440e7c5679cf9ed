"""Chunks follow the document's structure, end to end: over a copy of the project's docs/ stored
as a collection (as `make run` stores them), the README's question "How do I cancel a query?"
finds the chunk that holds the whole `cancel` section of docs/protocol.md, its request line
included, among the first three by BM25 alone, and that chunk's hit carries its heading path.
Chunk sizes are counted in the tokens of the model `make run` serves, and of the tests' default
model. Through diffragd, the citations of chunks of a Markdown document (inline or stored) say
their heading paths."""
import json
import shutil
import subprocess

import pytest

from conftest import ROOT
from daemon_util import Daemon, query


def store_tool(build_dir, store, *args):
    r = subprocess.run([str(build_dir / "diffrag-store"), "--data-dir", str(store), *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r.stdout


MODELS = {"qwen": ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
          "smollm": ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"}


@pytest.mark.parametrize("tokens", sorted(MODELS))
def test_cancel_section_found_whole(build_dir, tmp_path, tokens):
    model = MODELS[tokens]
    if not model.exists():
        pytest.fail(f"model missing: run `make model` ({model})")
    docs = tmp_path / "docs"
    docs.mkdir()
    for p in (ROOT / "docs").glob("*.md"):
        shutil.copy(p, docs / p.name)
    store = tmp_path / "store"
    store_tool(build_dir, store, "-c", "docs", "ingest", "--model", str(model), str(docs))
    assert " 0 problems" in store_tool(build_dir, store, "verify")
    out = store_tool(build_dir, store, "-c", "docs", "search", "--json", "-k", "10",
                     "How do I cancel a query?")
    hits = [json.loads(line) for line in out.splitlines() if line.strip()]
    section = (ROOT / "docs" / "protocol.md").read_text().split("\n## `cancel`\n", 1)[1]
    section = ("## `cancel`\n" + section.split("\n## ", 1)[0]).strip()
    rank = None
    for h in hits:
        if h["doc_id"] == "docs/protocol.md" and h["text"] == section:
            rank = h["rank"]
            assert h["heading"] == "`cancel`", h["heading"]
            assert '"op": "cancel"' in h["text"]
    print("%s tokens: the cancel section is hit %s of %s" % (tokens, rank,
          [(h["doc_id"], h["chunk"], h["heading"]) for h in hits[:5]]))
    assert rank is not None and rank <= 3, hits[:3]


GUIDE = ("# Brewing guide\n\nWhat this guide covers, in short.\n\n"
         "## Equipment\n\n### Kettles\n\nA kettle of steel holds the wort while it boils.\n\n"
         "### Fermenters\n\nA fermenter of glass keeps the yeast at work for two weeks.\n\n"
         "## Storage\n\nBottles are kept cool and dark.\n")


def test_daemon_citations_carry_heading_paths(tmp_path, default_model):
    doc = {"id": "guide", "title": "Brewing guide", "text": GUIDE}
    with Daemon(tmp_path, default_model, workers=1, threads=2, max_tokens=4,
                relevance_floor=0) as d:
        c = d.client()
        _, r = c.call({"v": 1, "op": "ingest", "collection": "b", "docs": [doc]}, timeout=120)
        assert r["ok"], r
        for where in ({"docs": [doc]}, {"collection": "b"}):
            _, r = c.call(query("What does a fermenter of glass keep at work?", top_k=2,
                                temperature=0, **where), timeout=300)
            assert r["ok"], r
            cites = {(x["chunk"], x["heading"]) for x in r["citations"]}
            print(where.keys(), sorted(cites))
            assert (2, "Equipment \u203a Fermenters") in cites, cites
            assert all(not x["whole"] for x in r["citations"])
        # a whole document has no heading path
        _, r = c.call(query("What does a fermenter keep at work?", docs=[doc], temperature=0),
                      timeout=300)
        assert r["ok"] and r["citations"][0]["whole"] and r["citations"][0]["heading"] == "", r
