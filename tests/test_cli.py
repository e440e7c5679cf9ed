"""The diffrag command line (build/diffrag) against a live diffragd with a tiny model and
against fake servers: documented exit codes, the --json shapes, the question from stdin, a
folder ingest (.txt, .md, .jsonl with meta, skipped files), the progress line of a long
ingest, --help of every command, Ctrl-C cancelling a streamed answer, keygen and CurveZMQ."""
import json
import os
import re
import signal
import stat
import subprocess
import time

import msgpack
import pytest
import zmq

from conftest import BUILD, ROOT
from daemon_util import Daemon, free_port
from test_clients_python import GROUNDED, FakeServer, pong, tiny_model

DIFFRAG = BUILD / "diffrag"
COMMANDS = ["ask", "ingest", "delete", "get", "ls", "stats", "ping", "keygen"]


def cli(*args, endpoint=None, stdin=None, timeout=60, cwd=ROOT, env=None):
    e = dict(os.environ, **(env or {}))
    if endpoint:
        e["DIFFRAG_ENDPOINT"] = endpoint
    r = subprocess.run([str(DIFFRAG), *map(str, args)], input=stdin, capture_output=True,
                       text=True, timeout=timeout, cwd=cwd, env=e)
    print("$ diffrag", " ".join(map(str, args)), "->", r.returncode)
    print(r.stdout[-3000:], r.stderr[-2000:])
    return r


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("cli"), tiny_model(tmp_path_factory), workers=2)
    with d:
        yield d
        assert d.stop() == 0, d.log_text()[-2000:]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder as a user has one: text, Markdown, .jsonl with meta, files to skip."""
    d = tmp_path_factory.mktemp("notes")
    (d / "rhine.txt").write_text("The Rhine is a European river. It is about 1,230 km long.\n")
    (d / "paris.md").write_text("# Paris, the capital\n\nParis has 2,102,650 residents.\n")
    (d / "sub").mkdir()
    (d / "sub" / "oxygen.txt").write_text("Oxygen has the atomic number 8.\n")
    (d / "more.jsonl").write_text(
        json.dumps({"id": "danube", "title": "Danube", "text": "The Danube is 2,850 km long.",
                    "meta": {"source": "jsonl", "n": [1, 2]}}) + "\n\n" +
        json.dumps({"id": "nile", "text": "The Nile flows north into the Mediterranean."}) + "\n")
    (d / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (d / ".hidden.txt").write_text("not ingested")
    (d / "empty.txt").write_text("")
    return d


def test_help_on_every_command():
    r = cli("--help")
    assert r.returncode == 0 and "exit codes: 0 ok, 1" in r.stdout
    for c in COMMANDS:
        r = cli(c, "--help")
        assert r.returncode == 0 and r.stdout.startswith("usage: diffrag " + c), c
        assert "--endpoint" in r.stdout


def test_usage_errors_exit_2():
    for args in ([], ["frobnicate"], ["ping", "--bogus"], ["ping", "extra"], ["ask"],
                 ["ask", "--max-tokens", "zero", "q"], ["ping", "--stream"], ["get"],
                 ["ingest", "--progress", "--quiet", "x"], ["ask", "--doc-id", "a", "-d", "f", "q"]):
        r = cli(*args, endpoint="tcp://127.0.0.1:1")
        assert r.returncode == 2, args
        assert r.stderr.strip(), args


def test_exit_codes_connection_timeout_protocol(tmp_path):
    port = free_port()
    t0 = time.time()
    r = cli("ping", "--connect-timeout", "0.3", endpoint="tcp://127.0.0.1:%d" % port)
    assert r.returncode == 3 and "connection refused" in r.stderr and time.time() - t0 < 3
    with FakeServer(lambda req: []) as silent:
        r = cli("--timeout", "0.3", "ping", endpoint=silent.endpoint)
        assert r.returncode == 4 and "no reply" in r.stderr
    with FakeServer(lambda req: [b"\xc1 not msgpack"]) as bad:
        r = cli("ping", "--json", endpoint=bad.endpoint)
        assert r.returncode == 5 and "malformed reply" in r.stderr
        assert json.loads(r.stdout)["error"]["code"] == "protocol"


def test_every_command_json_and_exit_codes(daemon, folder):
    ep = daemon.endpoint
    r = cli("ping", "--json", endpoint=ep)
    assert r.returncode == 0 and json.loads(r.stdout)["pong"] is True
    r = cli("ingest", "-c", "notes", "--json", folder, endpoint=ep)
    assert r.returncode == 0
    j = json.loads(r.stdout)
    # documents: rhine.txt, paris.md, sub/oxygen.txt and two .jsonl lines; files read: those
    # four and empty.txt; skipped: image.png (not text) and empty.txt; hidden files unseen
    assert (j["ingested"], j["docs"], j["files"], j["skipped"]) == (5, 5, 5, 2), j
    r = cli("ls", "-c", "notes", "--json", endpoint=ep)
    ids = [d["id"] for d in json.loads(r.stdout)["docs"]]
    assert sorted(ids) == sorted(["danube", "nile", str(folder / "rhine.txt"),
                                  str(folder / "paris.md"), str(folder / "sub" / "oxygen.txt")])
    r = cli("ls", "-c", "notes", "--limit", "2", endpoint=ep)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2
    r = cli("ls", endpoint=ep)
    assert "notes" in r.stdout.split()
    r = cli("get", "-c", "notes", str(folder / "paris.md"), "--json", endpoint=ep)
    doc = json.loads(r.stdout)["doc"]
    assert doc["title"] == "Paris, the capital" and "2,102,650" in doc["text"]
    r = cli("get", "-c", "notes", "danube", "--json", endpoint=ep)
    assert json.loads(r.stdout)["doc"]["meta"] == {"source": "jsonl", "n": [1, 2]}
    r = cli("get", "-c", "notes", "nile", endpoint=ep)
    assert r.stdout == "The Nile flows north into the Mediterranean.\n"

    r = cli("ask", "-c", "notes", "--json", "--max-tokens", "8", "How long is the Danube?",
            endpoint=ep)
    assert r.returncode == 0
    a = json.loads(r.stdout)
    assert {"id", "ok", "answer", "finish_reason", "citations", "usage", "timings"} <= set(a)
    assert a["ok"] is True and a["citations"][0]["doc_id"] == "danube"
    assert set(a["citations"][0]) >= {"doc_id", "chunk", "score", "offsets", "marker", "cited"}
    assert 1 <= a["usage"]["completion_tokens"] <= 8

    r = cli("stats", "--json", endpoint=ep)
    assert json.loads(r.stdout)["workers"]["idle"] >= 0
    r = cli("stats", "-c", "notes", "--json", endpoint=ep)
    assert json.loads(r.stdout)["docs"] == 5
    r = cli("stats", "-c", "notes", endpoint=ep)
    assert "documents:       5" in r.stdout

    r = cli("delete", "-c", "notes", "nile", "absent", "--json", endpoint=ep)
    assert r.returncode == 0 and json.loads(r.stdout)["deleted"] == 1
    r = cli("get", "-c", "notes", "nile", "--json", endpoint=ep)
    assert r.returncode == 1
    err = json.loads(r.stdout)
    assert err == {"ok": False, "error": {"code": "not_found", "message": err["error"]["message"]}}
    assert "nile" in err["error"]["message"] and "not_found" in r.stderr
    r = cli("ask", "-c", "no-such-collection", "q", endpoint=ep)
    assert r.returncode == 1
    r = cli("ask", "-c", "notes", "--top-k", "1000000", "q", endpoint=ep)
    assert r.returncode == 1 and "too_large" in r.stderr


def test_ask_human_output_stdin_and_stream(daemon, folder):
    ep = daemon.endpoint
    cli("ingest", "-c", "notes2", "-q", folder, endpoint=ep)
    q = "How long is the Rhine river?"
    plain = cli("ask", "-c", "notes2", "--max-tokens", "12", q, endpoint=ep)
    assert plain.returncode == 0
    body, _, details = plain.stdout.rpartition("\nsources:\n")
    lines = details.splitlines()
    assert lines[0].startswith("  [1] " + str(folder / "rhine.txt") + "  chunk 0, score ")
    assert any(ln.startswith("grounding: ") for ln in lines)
    assert any(ln.startswith("finish: ") and "generated" in ln for ln in lines)
    # the same question from stdin (greedy decoding: the same answer)
    piped = cli("ask", "-c", "notes2", "--max-tokens", "12", "-", stdin=q + "\n", endpoint=ep)
    assert piped.returncode == 0 and piped.stdout.split("\nsources:")[0] == body.split("\nsources:")[0]
    # streamed as NDJSON: deltas, then the reply; the deltas make the answer
    r = cli("ask", "-c", "notes2", "--max-tokens", "12", "--stream", "--json", q, endpoint=ep)
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert rows[-1]["ok"] is True and all(set(x) == {"id", "delta"} for x in rows[:-1])
    assert "".join(x["delta"] for x in rows[:-1]) == rows[-1]["answer"]
    # -d sends files inline, without a collection
    r = cli("ask", "-d", "examples/sample-paragraph.txt", "--json", "--max-tokens", "4",
            "How long is the Rhine?", endpoint=ep)
    assert json.loads(r.stdout)["citations"][0]["doc_id"] == "examples/sample-paragraph.txt"
    r = cli("ask", "-", stdin="   \n", endpoint=ep)
    assert r.returncode == 2
    print("stream rows:", len(rows))


def test_grounding_figures_shown():
    with FakeServer(lambda req: [GROUNDED] if req["op"] == "query" else pong(req)) as srv:
        r = cli("ask", "-c", "x", "How long is the Rhine?", endpoint=srv.endpoint)
    assert r.returncode == 0
    assert r.stdout.startswith("It is 1,230 km long [1].\n\nsources:\n")
    assert "  [1] rhine  chunk 0, score 2.50, bytes 0-40, cited\n" in r.stdout
    assert ("grounding: FLAGGED: the answer may not rest on the sources, score 0.820, lookback "
            "ratio 0.410, unsupported tokens 0.250 (2 of 8 flagged), mean logprob -1.50 "
            "(detector smollm2-v1)\n") in r.stdout
    assert "finish: stop; tokens: 120 prompt (80 from documents), 9 generated; first token " \
           "12 ms, total 30 ms" in r.stdout


def test_progress_line_while_a_long_ingest_runs(tmp_path):
    """A fake daemon that takes 0.35 s per ingest request: with 4 requests the ingest runs
    past a second and a progress line appears on stderr; --progress prints one per request;
    a quick ingest prints none."""
    for i in range(8):
        (tmp_path / ("doc%d.txt" % i)).write_text("document number %d\n" % i)
    state = {"docs": 0, "delay": 0.35}

    def handler(req):
        if req["op"] != "ingest":
            return pong(req)
        time.sleep(state["delay"])
        state["docs"] += len(req["docs"])
        return [{"ok": True, "collection": req["collection"], "ingested": len(req["docs"]),
                 "bytes": 10, "docs": state["docs"], "chunks": state["docs"]}]

    with FakeServer(handler) as srv:
        r = cli("ingest", "--batch", "2", tmp_path, endpoint=srv.endpoint)
        assert r.returncode == 0
        prog = [ln for ln in r.stderr.splitlines() if ln.startswith("ingest: ")]
        # the first after a second, then at most one a second (stderr is not a terminal)
        assert len(prog) == 1 and re.fullmatch(
            r"ingest: ([2468])/8 files, \1 documents, 0\.0 MB sent, 1\.\d s", prog[0]), r.stderr
        assert "ingested 8 documents" in r.stdout
        state["delay"] = 0
        r = cli("ingest", "--batch", "2", "--progress", tmp_path, endpoint=srv.endpoint)
        prog = [ln for ln in r.stderr.splitlines() if ln.startswith("ingest: ")]
        assert [p.split(",")[0] for p in prog] == ["ingest: 2/8 files", "ingest: 4/8 files",
                                                   "ingest: 6/8 files", "ingest: 8/8 files"]
        r = cli("ingest", "--batch", "2", tmp_path, endpoint=srv.endpoint)
        assert r.returncode == 0 and "ingest: " not in r.stderr
        print("progress lines of the slow ingest:", len(prog))


def test_ctrl_c_cancels_a_streamed_answer():
    """SIGINT while an answer streams: the CLI cancels the query on the daemon, prints what
    came and its sources, and exits 130."""
    class Streaming(FakeServer):
        qid = None
        last = 0.0

        def on_idle(self):
            if self.qid is not None and time.time() - self.last > 0.05:
                self.send(self.qid, {"delta": "word "})
                self.last = time.time()

    srv = None

    def handler(req):
        if req["op"] == "query":
            srv.qid = req["id"]
            return []
        if req["op"] == "cancel":
            qid, srv.qid = srv.qid, None
            srv.send(req["id"], {"ok": True, "found": True, "state": "running"})
            srv.send(qid, {"ok": True, "answer": "word word", "finish_reason": "cancelled",
                           "citations": [], "usage": {"prompt_tokens": 5, "context_tokens": 1,
                                                      "completion_tokens": 2}})
            return []
        return pong(req)

    srv = Streaming(handler)
    try:
        p = subprocess.Popen([str(DIFFRAG), "-e", srv.endpoint, "ask", "--stream", "-c", "x", "q"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout.read(5) == "word "
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=10)
        print(out, err)
        assert p.returncode == 130
        assert "finish: cancelled" in out
        assert any(r["op"] == "cancel" for r in srv.requests)
    finally:
        srv.close()


def test_keygen(tmp_path):
    prefix = tmp_path / "client"
    r = cli("keygen", "-o", prefix, "--json")
    assert r.returncode == 0
    j = json.loads(r.stdout)
    pub = (tmp_path / "client.pub").read_text().strip()
    sec = (tmp_path / "client.key").read_text().strip()
    assert j == {"public_key": pub, "public_file": str(prefix) + ".pub",
                 "secret_file": str(prefix) + ".key"}
    assert len(pub) == len(sec) == 40 and pub != sec
    assert zmq.curve_public(sec.encode()).decode() == pub
    assert stat.S_IMODE(os.stat(tmp_path / "client.key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "client.pub").st_mode) & 0o077 in (0o044, 0o004, 0o040, 0)
    r = cli("keygen", "-o", prefix)
    assert r.returncode == 6 and "--force" in r.stderr
    assert (tmp_path / "client.key").read_text().strip() == sec
    r = cli("keygen", "-o", prefix, "--force")
    assert r.returncode == 0 and (tmp_path / "client.key").read_text().strip() != sec
    assert r.stdout.startswith("public key: ")
    print("keys: public", pub)


def test_curve_with_keygen_keys(tmp_path):
    assert cli("keygen", "-o", tmp_path / "server").returncode == 0
    assert cli("keygen", "-o", tmp_path / "alice").returncode == 0
    assert cli("keygen", "-o", tmp_path / "mallory").returncode == 0
    server = ((tmp_path / "server.pub").read_text().strip().encode(),
              (tmp_path / "server.key").read_text().strip().encode())
    alice = (tmp_path / "alice.pub").read_text().strip()
    with FakeServer(pong, curve=server, allowed=[alice]) as srv:
        r = cli("--server-key", tmp_path / "server.pub", "--key", tmp_path / "alice.key", "ping",
                endpoint=srv.endpoint)
        assert r.returncode == 0 and "model fake" in r.stdout
        # the key as text, and the keys from the environment
        r = cli("ping", endpoint=srv.endpoint, env={"DIFFRAG_SERVER_KEY": server[0].decode(),
                                                    "DIFFRAG_KEY": str(tmp_path / "alice.key")})
        assert r.returncode == 0
        r = cli("--server-key", tmp_path / "server.pub", "--key", tmp_path / "mallory.key",
                "--connect-timeout", "1", "ping", endpoint=srv.endpoint)
        assert r.returncode == 3 and "refused this client's CurveZMQ key" in r.stderr
        r = cli("--connect-timeout", "1", "ping", endpoint=srv.endpoint)
        # ZeroMQ reports a plain client against a CURVE server either as a mechanism mismatch
        # or, when the server closes first (a loaded machine), as a broken handshake.
        assert r.returncode == 3 and ("mechanism mismatch" in r.stderr or
                                      "handshake failed" in r.stderr), r.stderr
    r = cli("--server-key", tmp_path / "nowhere.pub", "ping", endpoint="tcp://127.0.0.1:1")
    assert r.returncode == 2 and "nowhere.pub" in r.stderr
