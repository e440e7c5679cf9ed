"""End-to-end checks of the admin tool `diffrag-store`: ingest of a folder of .txt, .md and .jsonl
files, list/get/export/stats, search (text and --json), search-batch, document filters, delete,
verify, backup, and clear errors that leave the store unchanged (bad JSON lines, invalid UTF-8,
unknown collections, an unreadable path); ids relative to the folder given; files that are not
text (devices, FIFOs, bad names, binary, oversize); drop; the options (getopt_long)."""
import json
import os
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
        "long_id.jsonl": (json.dumps({"id": "x" * 300, "text": "t"}).encode() + b"\n",
                          "long_id.jsonl:1: the id is 300 bytes, over the 256"),
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


def test_ids_relative_to_the_folder(build_dir, root, tmp_path):
    """A text file's id is its folder's name and its path inside it: the folder ingested as "."
    and then by its absolute path (and one file given directly) stores each document once."""
    data = tmp_path / "store"
    notes = tmp_path / "notes"
    for i in range(50):
        d = notes / ("part%d" % (i % 3)) if i % 2 else notes
        d.mkdir(parents=True, exist_ok=True)
        (d / ("f%02d.txt" % i)).write_text("Document number %d is about topic %d.\n" % (i, i % 7))

    def ingest(cwd, *paths):
        r = subprocess.run([str(build_dir / "diffrag-store"), "--data-dir", str(data), "-c", "rel",
                            "ingest", "--approx-tokens", *map(str, paths)], cwd=cwd,
                           capture_output=True, timeout=120)
        assert r.returncode == 0, r.stderr.decode()
        return r.stderr.decode()

    assert "ingested 50 documents" in ingest(notes, ".")
    assert "ingested 50 documents" in ingest(root, notes.resolve())
    assert "ingested 50 documents" in ingest(tmp_path, "notes/")
    assert "ingested 1 document " in ingest(notes / "part1", "../f00.txt")
    _, out, _ = run(build_dir, root, data, "-c", "rel", "stats", "--json")
    assert json.loads(out)["docs"] == 50
    ids = run(build_dir, root, data, "-c", "rel", "list", "--limit", "100")[1].split()
    assert len(ids) == 50 and "notes/f00.txt" in ids and "notes/part1/f01.txt" in ids, ids[:5]


def test_hostile_local_files(build_dir, root, tmp_path):
    """Only regular files are read: a link to /dev/zero, a FIFO and a device are skipped with a
    note naming them, as are a name that is not UTF-8, text that is not UTF-8 or holds a NUL
    byte, and a file over the limit (refused unread); the rest of the folder is stored. Each,
    given directly, is an error that says what is wrong."""
    data = tmp_path / "store"
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "good.txt").write_text("The Rhine flows through Basel.\n")
    (d / "zero.txt").symlink_to("/dev/zero")
    (d / "null.md").symlink_to("/dev/null")
    os.mkfifo(d / "pipe.txt")
    (d / "loop").symlink_to(d)
    (d / os.fsdecode(b"caf\xe9.txt")).write_text("A name in Latin-1.\n")
    (d / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
    (d / "binary.txt").write_bytes(b"ab\x00cd\n")
    with open(d / "huge.txt", "wb") as f:           # sparse: refused by its size, never read
        f.truncate(65 << 20)
    rc, out, err = run(build_dir, root, data, "-c", "h", "ingest", "--approx-tokens", str(d))
    assert rc == 0 and "ingested 1 document " in err
    for name, why in [("zero.txt", "not a regular file (a character device); skipped"),
                      ("null.md", "not a regular file (a character device); skipped"),
                      ("pipe.txt", "not a regular file (a FIFO); skipped"),
                      ("loop", "a symbolic link to a folder; not followed"),
                      ("caf\\xE9.txt", "the name is not valid UTF-8; skipped"),
                      ("latin1.txt", "not valid UTF-8 at byte 3: convert it"),
                      ("binary.txt", "a NUL byte at byte 2: not a text file; skipped"),
                      ("huge.txt", "65.0 MiB, over the 64.0 MiB a document may have")]:
        assert any(name in ln and why in ln for ln in err.splitlines()), (name, err)
    assert "skipped 8 files" in err
    assert run(build_dir, root, data, "-c", "h", "list")[1].split() == ["mixed/good.txt"]

    for name, why in [("zero.txt", "not a regular file (a character device)"),
                      ("pipe.txt", "not a regular file (a FIFO)"),
                      ("latin1.txt", "iconv -f LATIN1 -t UTF-8"),
                      ("binary.txt", "a NUL byte at byte 2"),
                      ("huge.txt", "split it into smaller documents")]:
        rc, _, err = run(build_dir, root, data, "-c", "h", "ingest", "--approx-tokens", str(d / name),
                         check=False)
        assert rc == 1 and why in err, (name, err)
    assert run(build_dir, root, data, "-c", "h", "list")[1].split() == ["mixed/good.txt"]
    # a .jsonl line over the limit is refused without reading it whole
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.write(b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "')
        f.truncate(f.tell() + (257 << 20))
    rc, _, err = run(build_dir, root, data, "-c", "h", "ingest", "--approx-tokens", str(big), check=False)
    assert rc == 1 and "big.jsonl:2: a line over 256.0 MiB" in err, err


def test_drop(build_dir, root, tmp_path):
    data = tmp_path / "store"
    make_docs(tmp_path)
    run(build_dir, root, data, "-c", "geo", "ingest", "--approx-tokens", str(tmp_path / "notes"))
    run(build_dir, root, data, "-c", "raw", "ingest", "--approx-tokens",
        str(tmp_path / "notes" / "cities.jsonl"))
    _, out, _ = run(build_dir, root, data, "-c", "geo", "drop")
    assert out == 'dropped collection "geo" (4 documents)\n'
    assert run(build_dir, root, data, "collections")[1].split() == ["raw"]
    rc, _, err = run(build_dir, root, data, "-c", "geo", "drop", check=False)
    assert rc == 1 and 'unknown collection "geo"' in err
    rc, _, err = run(build_dir, root, data, "drop", check=False)     # no -c: refused
    assert rc == 2 and "-c" in err
    assert run(build_dir, root, data, "collections")[1].split() == ["raw"]
    assert "0 problems" in run(build_dir, root, data, "verify")[1]
    run(build_dir, root, data, "-c", "geo", "ingest", "--approx-tokens", "--no-stem",
        str(tmp_path / "notes" / "cities.jsonl"))
    st = json.loads(run(build_dir, root, data, "-c", "geo", "stats", "--json")[1])
    assert st["docs"] == 2 and st["stem"] is False


def test_options(build_dir, root, tmp_path):
    data = tmp_path / "store"
    for args in (["--help"], ["-h"], ["ingest", "--help"], ["-c", "x", "search", "-h"]):
        rc, out, err = run(build_dir, root, data, *args)
        assert out.startswith("usage: diffrag-store") and "drop" in out and err == "", args
    for args, why in ((["--bogus", "list"], "unknown option --bogus"),
                      (["list", "--bogus"], "unknown option --bogus"),
                      (["list", "-x"], "unknown option -x"),
                      (["list", "--limit"], "--limit needs a value"),
                      (["list", "--limit", "many"], "--limit: not a count: many"),
                      (["ingest", "--k1", "2", "x"], "--k1 does not apply to ingest"),
                      (["--ack", "search", "q"], "--ack does not apply to search"),
                      ([], "usage: diffrag-store")):
        rc, out, err = run(build_dir, root, data, *args, check=False)
        assert rc == 2 and why in err and "usage: diffrag-store" in err and out == "", (args, err)
    # a subcommand's options before or after it, global ones after it, "--" ends options
    make_docs(tmp_path)
    run(build_dir, root, data, "--approx-tokens", "ingest", str(tmp_path / "notes"), "-c", "g")
    _, out, _ = run(build_dir, root, data, "search", "danube", "-c", "g", "--json", "-k", "1")
    assert json.loads(out)["doc_id"] == "wien"
    _, out, _ = run(build_dir, root, data, "-c", "g", "search", "--json", "--", "-danube")
    assert json.loads(out.splitlines()[0])["doc_id"] == "wien"


def long_name_folder(tmp_path, n=70):
    """A folder "longnames" of n short files and one whose 251-byte name makes its id
    ("longnames/" + name) 261 bytes, over the 256 an id may have; and one whose id is 256."""
    d = tmp_path / "longnames"
    d.mkdir()
    for i in range(n):
        (d / ("f%02d.txt" % i)).write_text("File %d is about the river number %d.\n" % (i, i))
    long_name = "n" * 247 + ".txt"
    (d / long_name).write_text("A file with a very long name.\n")
    fits = "m" * (256 - len("longnames/") - 4) + ".txt"
    (d / fits).write_text("A file whose id is exactly at the limit.\n")
    return d, long_name, fits


def test_an_over_long_id_is_skipped(build_dir, root, tmp_path):
    """One file whose id would be over the store's 256 bytes is skipped with a note naming it
    and the limit; the other 71 files are stored. Given directly, it is an error."""
    data = tmp_path / "store"
    d, long_name, fits = long_name_folder(tmp_path)
    rc, _, err = run(build_dir, root, data, "-c", "ln", "ingest", "--approx-tokens", str(d),
                     check=False)
    assert rc == 0 and "ingested 71 documents" in err, err
    note = [ln for ln in err.splitlines() if long_name in ln]
    assert len(note) == 1 and "261 bytes, over the 256" in note[0] and "skipped" in note[0], err
    assert "skipped 1 file " in err
    ids = run(build_dir, root, data, "-c", "ln", "list", "--limit", "1000")[1].split()
    assert len(ids) == 71 and "longnames/" + fits in ids
    rc, _, err = run(build_dir, root, data, "-c", "ln", "ingest", "--approx-tokens",
                     str(d / long_name), check=False)
    assert rc == 1 and "261 bytes, over the 256" in err, err
    # a .jsonl line with an over-long id is an error naming the line, before anything is written
    j = tmp_path / "ids.jsonl"
    j.write_text(json.dumps({"id": "ok", "text": "fine"}) + "\n" +
                 json.dumps({"id": "x" * 300, "text": "too long an id"}) + "\n")
    rc, _, err = run(build_dir, root, data, "-c", "ln2", "ingest", "--approx-tokens", str(j),
                     check=False)
    assert rc == 1 and "ids.jsonl:2: the id is 300 bytes, over the 256" in err, err


def test_symlinks_out_of_the_folder_are_not_followed(build_dir, root, tmp_path):
    """In a folder walk, a link to a file inside the same folder is read (under the link's
    own id); a link to a file outside it is skipped with a note naming its target, so that a
    folder cannot pull in files from elsewhere; the same file given directly is read."""
    data = tmp_path / "store"
    secret = tmp_path / "private" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("The vault code is 4711.\n")
    d = tmp_path / "shared"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "plain.txt").write_text("Plain text about the Rhine.\n")
    (d / "alias.txt").symlink_to(d / "sub" / "plain.txt")    # inside: followed
    (d / "rel.txt").symlink_to("sub/plain.txt")              # inside, relative
    (d / "leak.txt").symlink_to(secret)                      # outside: not followed
    (d / "up.txt").symlink_to("../private/secret.txt")       # outside, relative
    rc, _, err = run(build_dir, root, data, "-c", "sl", "ingest", "--approx-tokens", str(d),
                     check=False)
    assert rc == 0 and "ingested 3 documents" in err, err
    for name in ("leak.txt", "up.txt"):
        assert any(name in ln and "a symbolic link to a file outside the folder" in ln and
                   str(secret.resolve()) in ln and "not followed" in ln
                   for ln in err.splitlines()), (name, err)
    assert "skipped 2 files" in err
    ids = run(build_dir, root, data, "-c", "sl", "list")[1].split()
    assert ids == ["shared/alias.txt", "shared/rel.txt", "shared/sub/plain.txt"], ids
    rc, out, _ = run(build_dir, root, data, "-c", "sl", "search", "--json", "vault code")
    assert "secret" not in out and "4711" not in out
    # named on the command line, the link is the user's choice: it is read
    rc, _, err = run(build_dir, root, data, "-c", "sl", "ingest", "--approx-tokens",
                     str(d / "leak.txt"))
    assert "ingested 1 document " in err
    assert "shared/leak.txt" in run(build_dir, root, data, "-c", "sl", "list")[1].split()
