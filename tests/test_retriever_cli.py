"""End-to-end checks of the admin tool `diffrag-store`: ingest of a folder of .txt, .md and .jsonl
files, list/get/export/stats, search (text and --json), search-batch, document filters, delete,
verify, backup, and clear errors that leave the store unchanged (bad JSON lines, invalid UTF-8,
unknown collections, an unreadable path)."""
import json
import subprocess


def run(build_dir, root, data, *args, input=None, check=True):
    r = subprocess.run([str(build_dir / "diffrag-store"), "--data-dir", str(data), *args], cwd=root,
                       input=input, capture_output=True, timeout=120)
    out, err = r.stdout.decode("utf-8"), r.stderr.decode("utf-8")
    if check:
        assert r.returncode == 0, f"{args}: exit {r.returncode}\n{out}\n{err}"
    return r.returncode, out, err


def make_docs(d):
    (d / "notes").mkdir(parents=True)
    (d / "notes" / "rivers.txt").write_text(
        "The Danube flows through ten countries. It reaches the Black Sea in Romania.\n\n"
        "The Rhine starts in the Swiss Alps.\n", encoding="utf-8")
    (d / "notes" / "mountains.md").write_text(
        "# Mountains of Europe\n\nMont Blanc is the highest peak of the Alps. "
        "The Matterhorn is famous for its shape.\n", encoding="utf-8")
    (d / "notes" / "ignored.bin").write_bytes(b"\x00\x01")
    with open(d / "notes" / "cities.jsonl", "w", encoding="utf-8") as f:
        f.write(json.dumps({"id": "paris", "title": "Paris", "text": "Paris is the capital of France. "
                            "The Seine crosses it.", "extra": [1, {"x": None}]}) + "\n")
        f.write("\n")
        f.write(json.dumps({"id": "wien", "title": "Wien", "text": "Vienna lies on the Danube. Café culture "
                            "is a tradition there."}, ensure_ascii=False) + "\n")


def test_cli_roundtrip(build_dir, root, tmp_path):
    data = tmp_path / "store"
    make_docs(tmp_path)
    _, _, err = run(build_dir, root, data, "-c", "geo", "ingest", "--approx-tokens", str(tmp_path / "notes"))
    assert "ingested 4 documents" in err and "skipped" in err

    _, out, _ = run(build_dir, root, data, "-c", "geo", "list")
    ids = out.split()
    assert len(ids) == 4 and "paris" in ids and "wien" in ids
    md_id = next(i for i in ids if i.endswith("mountains.md"))
    _, out, _ = run(build_dir, root, data, "-c", "geo", "list", "--limit", "2")
    assert out.split() == sorted(ids)[:2]
    _, out, _ = run(build_dir, root, data, "-c", "geo", "list", "--after", sorted(ids)[1])
    assert out.split() == sorted(ids)[2:]

    _, out, _ = run(build_dir, root, data, "-c", "geo", "get", md_id)
    doc = json.loads(out)
    assert doc["title"] == "Mountains of Europe" and "Matterhorn" in doc["text"]
    _, out, _ = run(build_dir, root, data, "-c", "geo", "get", "wien")
    assert "Café" in json.loads(out)["text"]

    _, out, _ = run(build_dir, root, data, "-c", "geo", "stats", "--json")
    st = json.loads(out)
    assert st["docs"] == 4 and st["chunks"] >= 4 and st["stem"] is True and st["chunk_tokens"] == 256

    _, out, _ = run(build_dir, root, data, "-c", "geo", "search", "--json", "-k", "3", "Which river reaches the Black Sea?")
    hits = [json.loads(l) for l in out.splitlines()]
    assert hits and hits[0]["doc_id"].endswith("rivers.txt")
    assert {"doc_id", "chunk", "score"} <= set(hits[0]) and hits[0]["score"] > 0
    assert all(hits[i]["score"] >= hits[i + 1]["score"] for i in range(len(hits) - 1))
    text = hits[0]["text"]
    src = json.loads(run(build_dir, root, data, "-c", "geo", "get", hits[0]["doc_id"])[1])["text"]
    assert src.encode()[hits[0]["byte_start"]:hits[0]["byte_end"]].decode() == text

    _, out, err = run(build_dir, root, data, "-c", "geo", "search", "danube")
    assert "wien" in out and "hits in" in err
    _, out, _ = run(build_dir, root, data, "-c", "geo", "search", "--json", "--doc", "wien", "danube")
    assert [json.loads(l)["doc_id"] for l in out.splitlines()] == ["wien"]

    _, out, _ = run(build_dir, root, data, "-c", "geo", "search-batch", "-k", "2",
                    input="capital of France\nhighest peak of the Alps\nzzzz\n".encode())
    res = [json.loads(l) for l in out.splitlines()]
    assert [r["query"] for r in res] == [0, 1, 2]
    assert res[0]["hits"][0]["doc_id"] == "paris" and res[1]["hits"][0]["doc_id"] == md_id and res[2]["hits"] == []

    _, out, _ = run(build_dir, root, data, "-c", "geo", "export")
    exported = {d["id"]: d for d in map(json.loads, out.splitlines())}
    assert set(exported) == set(ids)

    # Stemming: "flowing" finds "flows".
    _, out, _ = run(build_dir, root, data, "-c", "geo", "search", "--json", "flowing")
    assert json.loads(out.splitlines()[0])["doc_id"].endswith("rivers.txt")

    # A second collection with other options; the first keeps its own.
    run(build_dir, root, data, "-c", "raw", "ingest", "--approx-tokens", "--no-stem", "--chunk-tokens", "64",
        str(tmp_path / "notes" / "cities.jsonl"))
    _, out, _ = run(build_dir, root, data, "collections")
    assert out.split() == ["geo", "raw"]
    assert json.loads(run(build_dir, root, data, "-c", "raw", "stats", "--json")[1])["stem"] is False
    rc, out, _ = run(build_dir, root, data, "-c", "raw", "search", "--json", "flowing", check=False)
    assert rc == 0 and out == ""

    _, out, _ = run(build_dir, root, data, "-c", "geo", "delete", "paris", "nothere")
    assert "deleted 1 of 2" in out
    _, out, _ = run(build_dir, root, data, "-c", "geo", "search", "--json", "Seine")
    assert out == ""

    _, out, _ = run(build_dir, root, data, "verify")
    assert "0 problems" in out and out.strip().endswith("ok")

    backup = tmp_path / "backup"
    run(build_dir, root, data, "backup", str(backup))
    _, out, _ = run(build_dir, root, backup, "-c", "geo", "export")
    assert len(out.splitlines()) == 3
    _, out, _ = run(build_dir, root, backup, "verify")
    assert "ok" in out


def test_cli_errors_leave_store_unchanged(build_dir, root, tmp_path):
    data = tmp_path / "store"
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"id": "a", "title": "A", "text": "Alpha text."}) + "\n", encoding="utf-8")
    run(build_dir, root, data, "ingest", "--approx-tokens", str(good))
    before = run(build_dir, root, data, "export")[1]

    cases = {
        "bad_json.jsonl": (b'{"id": "b", "text": "ok"}\n{"id": "c", "text": "unterminated}\n', "bad_json.jsonl:2"),
        "no_text.jsonl": (b'{"id": "d", "title": "x"}\n', "needs string fields"),
        "number_id.jsonl": (b'{"id": 5, "text": "x"}\n', "must be a string"),
        "empty.jsonl": (b'{"id": "e", "text": ""}\n', "empty text"),
        "long_id.jsonl": (json.dumps({"id": "x" * 300, "text": "t"}).encode() + b"\n", "limit 256"),
        "bad_utf8.txt": (b"caf\xe9 au lait\n", "not valid UTF-8"),
    }
    for name, (content, expect) in cases.items():
        p = tmp_path / name
        p.write_bytes(content)
        rc, out, err = run(build_dir, root, data, "ingest", "--approx-tokens", "--batch-docs", "100", str(p),
                           check=False)
        assert rc != 0 and expect in err, f"{name}: exit {rc}, stderr {err!r}"
        assert run(build_dir, root, data, "export")[1] == before, f"{name} changed the store"
    rc, _, err = run(build_dir, root, data, "-c", "nope", "search", "x", check=False)
    assert rc == 1 and 'unknown collection "nope"' in err
    rc, _, err = run(build_dir, root, data, "ingest", "--approx-tokens", str(tmp_path / "missing.txt"), check=False)
    assert rc == 1 and "No such file" in err
    rc, _, err = run(build_dir, root, data, "frobnicate", check=False)
    assert rc == 2 and "unknown subcommand" in err
    rc, _, err = run(build_dir, root, data, "ingest", "--model", str(tmp_path / "none.gguf"), str(good), check=False)
    assert rc == 1 and "--approx-tokens" in err
    assert run(build_dir, root, data, "verify")[0] == 0
