"""A long Markdown table, end to end through diffrag-store: ingested with the model's tokenizer,
it is cut between rows only, and a search for a value in one of its late rows finds a chunk of
whole rows whose heading path carries the table's caption (marked continued) and header row,
so the chunk's label says what its columns are. The first part holds the caption and header row
themselves; a small table in the same file is found whole with its caption."""
import json
import subprocess

import pytest

from conftest import ROOT

MODEL = ROOT / "models" / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"


def store_tool(build_dir, store, *args):
    r = subprocess.run([str(build_dir / "diffrag-store"), "--data-dir", str(store), *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r.stdout


def document():
    rows = "".join("| node-%03d | rack %d | %d W. Cooled by air |\n" % (i, i % 7, 100 + i)
                   for i in range(200))
    rows = rows.replace("| node-187 | rack 5 | 287 W.", "| node-187 | rack 5 | zanzibarite 287 W.")
    return ("# Cluster inventory\n\nThe cluster as it stood at the last audit.\n\n"
            "## Power\n\nEvery node and what it draws.\n\n"
            "Table 4: Power draw per node\n\n| Node | Rack | Draw |\n|---|---|---|\n" + rows +
            "\n## Spares\n\nTable 5: Spare parts\n\n| Part | Count |\n|---|---|\n"
            "| fan | 12 |\n| disk | quillwort 3 |\n\nThat is all.\n")


def hits_for(build_dir, store, query):
    out = store_tool(build_dir, store, "-c", "inv", "search", "--json", "-k", "5", query)
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_long_table_parts_carry_header(build_dir, tmp_path):
    if not MODEL.exists():
        pytest.fail(f"model missing: run `make model` ({MODEL})")
    doc = tmp_path / "notes" / "inventory.md"
    doc.parent.mkdir()
    text = document()
    doc.write_text(text)
    store = tmp_path / "store"
    store_tool(build_dir, store, "-c", "inv", "ingest", "--chunk-tokens", "128", "--model",
               str(MODEL), str(doc))
    assert " 0 problems" in store_tool(build_dir, store, "verify")

    hits = hits_for(build_dir, store, "zanzibarite")
    assert hits, "the late row's value is found"
    h = hits[0]
    assert "| node-187 | rack 5 | zanzibarite 287 W. Cooled by air |" in h["text"], h["text"]
    assert h["heading"] == "Power \u203a Table 4: Power draw per node (cont.) \u203a | Node | Rack | Draw |", \
        h["heading"]
    # whole rows: the chunk starts at a row and ends at one, and holds no caption or header
    assert h["text"].startswith("| node-") and h["text"].endswith("|"), h["text"]
    assert all(line.startswith("| node-") and line.endswith("Cooled by air |")
               for line in h["text"].split("\n")), h["text"]

    first = hits_for(build_dir, store, "node-000")[0]
    assert first["text"].startswith("Table 4: Power draw per node\n\n| Node | Rack | Draw |\n|---|---|---|\n"), \
        first["text"]
    assert first["heading"] == "Power", first["heading"]

    small = hits_for(build_dir, store, "quillwort")[0]
    assert "Table 5: Spare parts\n\n| Part | Count |\n|---|---|\n| fan | 12 |\n| disk | quillwort 3 |" \
        in small["text"], small["text"]
    assert small["heading"] == "Spares", small["heading"]
