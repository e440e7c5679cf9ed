"""The diffrag command line (build/diffrag) against a live diffragd with a tiny model and
against fake servers: documented exit codes, the --json shapes, the question from stdin, a
folder ingest (.txt, .md, .jsonl with meta, skipped files), the progress line of a long
ingest, --help of every command, Ctrl-C cancelling a streamed answer and a query still in
prefill, drop (asked on a terminal, refused without one unless --yes), endpoint and host
messages, keygen and CurveZMQ."""
import json
import os
import pty
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
COMMANDS = ["ask", "ingest", "delete", "drop", "get", "ls", "stats", "ping", "keygen"]


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
                 ["ingest", "--progress", "--quiet", "x"], ["ask", "--doc-id", "a", "-d", "f", "q"],
                 ["drop"], ["drop", "a", "b"], ["drop", "-c", "a", "a", "--yes"]):
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


def test_endpoint_without_scheme_and_unresolvable_host():
    r = cli("ping", endpoint="127.0.0.1:7400")
    assert r.returncode == 2
    assert ("endpoint '127.0.0.1:7400': expected tcp://HOST:PORT, ipc://PATH or inproc://NAME"
            in r.stderr) and "Invalid argument" not in r.stderr
    t0 = time.time()
    r = cli("ping", endpoint="tcp://nosuchhost.invalid:7400")
    assert r.returncode == 3 and '"nosuchhost.invalid" does not resolve' in r.stderr, r.stderr
    assert "connection refused" not in r.stderr and "is diffragd running" not in r.stderr
    assert time.time() - t0 < 4  # at once, not after the 5 s connect timeout


def test_drop(daemon, folder):
    """drop needs --yes without a terminal; it says how many documents went; then the
    collection is gone (not_found, exit 1)."""
    ep = daemon.endpoint
    assert cli("ingest", "-c", "dropme", "-q", folder, endpoint=ep).returncode == 0
    r = cli("drop", "dropme", stdin="", endpoint=ep)
    assert r.returncode == 2 and "--yes" in r.stderr
    assert "dropme" in cli("ls", endpoint=ep).stdout.split()
    r = cli("drop", "dropme", "--yes", "--json", endpoint=ep)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["ok"] is True and j["collection"] == "dropme" and j["dropped"] == 5, j
    assert "dropme" not in cli("ls", endpoint=ep).stdout.split()
    r = cli("drop", "dropme", "-y", endpoint=ep)
    assert r.returncode == 1 and "not_found" in r.stderr
    assert cli("ingest", "-c", "dropme", "-q", folder / "sub", endpoint=ep).returncode == 0
    r = cli("drop", "dropme", "--yes", endpoint=ep)
    assert r.returncode == 0 and r.stdout == 'dropped "dropme": 1 document\n'


def test_drop_asks_on_a_terminal():
    """On a terminal drop shows the collection's size and asks; only y/yes drops."""
    seen = []

    def handler(req):
        seen.append(req["op"])
        if req["op"] == "stats":
            return [{"ok": True, "collection": req["collection"], "docs": 3, "chunks": 4}]
        if req["op"] == "drop":
            return [{"ok": True, "collection": req["collection"], "dropped": 3}]
        return pong(req)

    with FakeServer(handler) as srv:
        for answer, dropped in (("n\n", False), ("\n", False), ("YES\n", True)):
            seen.clear()
            master, slave = pty.openpty()
            p = subprocess.Popen([str(DIFFRAG), "-e", srv.endpoint, "drop", "notes"], stdin=slave,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            os.close(slave)
            os.write(master, answer.encode())
            out, err = p.communicate(timeout=10)
            os.close(master)
            print(repr(answer), p.returncode, out, err)
            assert p.returncode == 0
            assert 'Drop the collection "notes" and its 3 documents? This cannot be undone.' in err
            assert seen == (["stats", "drop"] if dropped else ["stats"]), seen
            if dropped:
                assert out == 'dropped "notes": 3 documents\n'
            else:
                assert out == "" and 'diffrag drop: "notes" kept' in err



def test_ingest_names_every_skipped_file(daemon, folder):
    r = cli("ingest", "-c", "named", folder, endpoint=daemon.endpoint)
    assert r.returncode == 0
    # a file of another kind is named like any other skipped file, with the reason
    assert "diffrag ingest: %s: not .txt, .md, .jsonl, .pdf, .docx or .html; skipped" % (folder / "image.png") in r.stderr
    assert any("empty.txt" in ln for ln in r.stderr.splitlines())
    assert ".hidden.txt" not in r.stderr
    assert "skipped 2 files (1 not .txt, .md, .jsonl, .pdf, .docx or .html; 1 for other reasons; each named above)" in r.stdout


def test_ingest_names_only_the_first_files_of_other_kinds(daemon, tmp_path):
    for i in range(25):
        (tmp_path / ("f%02d.bin" % i)).write_bytes(b"x")
    (tmp_path / "a.txt").write_text("The Loire is the longest river in France.\n")
    r = cli("ingest", "-c", "many", tmp_path, endpoint=daemon.endpoint)
    assert r.returncode == 0
    named = [ln for ln in r.stderr.splitlines() if ".bin: not .txt, .md, .jsonl, .pdf, .docx or .html; skipped" in ln]
    assert len(named) == 20 and "f00.bin" in named[0] and "f19.bin" in named[-1], r.stderr
    assert "more files that are not .txt, .md, .jsonl, .pdf, .docx or .html; skipped without a note each" in r.stderr
    assert "skipped 25 files (not .txt, .md, .jsonl, .pdf, .docx or .html; named above)" in r.stdout

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
    # a text file's id: its folder's name, then its path inside the folder
    assert sorted(ids) == sorted(["danube", "nile", folder.name + "/rhine.txt",
                                  folder.name + "/paris.md", folder.name + "/sub/oxygen.txt"])
    r = cli("ls", "-c", "notes", "--limit", "2", endpoint=ep)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2
    r = cli("ls", endpoint=ep)
    assert "notes" in r.stdout.split()
    r = cli("get", "-c", "notes", folder.name + "/paris.md", "--json", endpoint=ep)
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
    # the collection's documents the search found fit the budget: each whole, best first
    assert lines[0].startswith("  [1] " + folder.name + "/rhine.txt  whole document, score ")
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


def ask_fake(reply, *args):
    with FakeServer(lambda req: [reply] if req["op"] == "query" else pong(req)) as srv:
        r = cli("ask", "-c", "x", *args, "How long is the Rhine?", endpoint=srv.endpoint)
    assert r.returncode == 0, r.stderr
    return r.stdout


def grounding_lines(out):
    """The grounding verdict and its details line (when there is one)."""
    lines = out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("grounding: "))
    return lines[i:i + 2] if lines[i + 1].startswith("  details: ") else lines[i:i + 1]


def with_grounding(reply=GROUNDED, **figures):
    return dict(reply, grounding=dict(reply["grounding"], **figures))


def read_line(context, *args):
    """The `read:` line `ask` prints for a reply with this context map (None: no such line)."""
    out = ask_fake(dict(GROUNDED, context=context), *args)
    lines = [ln for ln in out.splitlines() if ln.startswith("read: ")]
    assert len(lines) <= 1, out
    return lines[0] if lines else None


def test_read_line_names_what_left_chunks_out():
    """The hint names the budget only when the budget left matching chunks out, and the
    relevance floor (--relevance-floor) when that dropped chunks the search found."""
    base = {"documents": 1, "doc_tokens": 17686, "placed_tokens": 709, "chunks_matched": 3,
            "chunks_placed": 3, "chunks_left_out": 0, "chunks_below_floor": 23, "whole": False}
    line = read_line(base)
    assert line == ("read: 709 of 17686 document tokens: 3 of 3 matching chunks placed, 0 left "
                    "out, 23 under the relevance floor; a lower --relevance-floor reads more"), line
    line = read_line(dict(base, chunks_matched=9, chunks_left_out=6, chunks_below_floor=0))
    assert line.endswith("6 left out; a larger --max-context-tokens reads more"), line
    assert "relevance" not in line
    line = read_line(dict(base, chunks_matched=9, chunks_left_out=6))
    assert line.endswith("6 left out, 23 under the relevance floor; a larger "
                         "--max-context-tokens and a lower --relevance-floor read more"), line
    # neither: the rest shares no word with the question (or lay past --top-k)
    line = read_line(dict(base, chunks_below_floor=0))
    assert "--max-context-tokens" not in line and "--relevance-floor" not in line, line
    # a daemon that does not count the floor's chunks: as before
    old = {k: v for k, v in base.items() if k != "chunks_below_floor"}
    assert "--max-context-tokens" in read_line(dict(old, chunks_left_out=2, chunks_matched=5))
    assert read_line(dict(base, whole=True)) is None


def test_relevance_floor_option_is_sent():
    """--relevance-floor X sends relevance_floor (0 included); without it none is sent; out of
    0..1 it is a usage error."""
    seen = []

    def handle(req):
        if req["op"] == "query":
            seen.append(req)
            return [GROUNDED]
        return pong(req)
    with FakeServer(handle) as srv:
        for extra in (["--relevance-floor", "0"], ["--relevance-floor", "0.25"], []):
            r = cli("ask", "-c", "x", *extra, "How long?", endpoint=srv.endpoint)
            assert r.returncode == 0, r.stderr
        bad = cli("ask", "-c", "x", "--relevance-floor", "1.5", "How long?",
                  endpoint=srv.endpoint)
    assert [q.get("relevance_floor") for q in seen] == [0.0, 0.25, None], seen
    assert "relevance_floor" in seen[0] and "relevance_floor" not in seen[2]
    assert bad.returncode == 2 and "--relevance-floor" in bad.stderr, bad.stderr


def test_grounding_figures_shown():
    """The grounding verdict in words, the score and detector behind it, then every figure
    named: each case the daemon can report."""
    out = ask_fake(GROUNDED)
    assert out.startswith("It is 1,230 km long [1].\n\nsources:\n")
    assert "  [1] rhine  chunk 0, score 2.50, bytes 0-40, cited\n" in out
    # flagged: how many answer tokens lie in windows scored at or above the threshold, apart
    # from the share of answer tokens on words the documents lack
    assert grounding_lines(out) == [
        "grounding: FLAGGED: the answer may not rest on the documents (score 0.820, 2 of 8 "
        "answer tokens in flagged windows, detector smollm2-v1)",
        "  details: answer tokens on words absent from the documents 25.0% (2 of 8), lookback "
        "ratio 0.410, mean logprob -1.50"], out
    assert "finish: stop; tokens: 120 prompt (80 from documents), 9 generated; first token " \
           "12 ms, total 30 ms" in out
    # not flagged; the self-check, context reliance and probe when the daemon measured them
    quiet = with_grounding(score=0.331, flagged=False, flagged_tokens=0,
                           unsupported_token_ratio=0.125, self_check=0.4567,
                           context_reliance=1.234, hidden_probe=0.3125)
    assert grounding_lines(ask_fake(quiet)) == [
        "grounding: not flagged: likely supported by the documents (score 0.331, detector "
        "smollm2-v1)",
        "  details: answer tokens on words absent from the documents 12.5% (1 of 8), lookback "
        "ratio 0.410, mean logprob -1.50, self-check 0.46, context reliance 1.23, hidden-state "
        "probe 0.31"]
    # --unsupported answer: nothing is flagged, so "not flagged" says nothing of the score
    assert grounding_lines(ask_fake(quiet, "--unsupported", "answer"))[0] == \
        "grounding: not flagged: --unsupported answer flags nothing (score 0.331, detector " \
        "smollm2-v1)"
    # the model gave the refusal phrase: never flagged
    refused = dict(with_grounding(score=0.12, flagged=False, abstained=True, flagged_tokens=0,
                                  unsupported_token_ratio=0.0),
                   answer="I cannot find the answer in the provided documents.")
    assert grounding_lines(ask_fake(refused))[0] == \
        "grounding: the model said the documents do not answer (abstained; score 0.120, " \
        "detector smollm2-v1)"
    # no calibrated detector for the daemon's model: figures without a verdict
    unscored = with_grounding(score=None, flagged=None, flagged_tokens=0, detector="none")
    assert grounding_lines(ask_fake(unscored)) == [
        "grounding: not scored: no calibrated detector for this model",
        "  details: answer tokens on words absent from the documents 25.0% (2 of 8), lookback "
        "ratio 0.410, mean logprob -1.50"]
    assert grounding_lines(ask_fake(with_grounding(unscored, abstained=True)))[0] == \
        "grounding: the model said the documents do not answer (abstained; not scored: no " \
        "calibrated detector for this model)"
    # a calibration with a probe, and an answer without the probe's rows
    assert grounding_lines(ask_fake(with_grounding(unscored, detector="probe-v2")))[0] == \
        "grounding: not scored: detector probe-v2 needs hidden-state figures the worker did " \
        "not send"
    # only the token that ended the turn: no figure (they are all nil)
    empty = dict(with_grounding(score=None, flagged=None, lookback_ratio=None,
                                unsupported_token_ratio=None, mean_logprob=None,
                                min_logprob=None, answer_tokens=0, flagged_tokens=0),
                 answer="", usage={"prompt_tokens": 120, "context_tokens": 80,
                                   "completion_tokens": 1})
    assert grounding_lines(ask_fake(empty)) == ["grounding: none: the answer has no token"]
    # a daemon that reports no grounding
    bare = {k: v for k, v in GROUNDED.items() if k != "grounding"}
    assert grounding_lines(ask_fake(bare)) == ["grounding: not reported by this daemon"]


def test_grounding_of_a_declined_answer():
    """A declined answer's figures are its attempt's: the verdict says it was declined, why,
    and that they describe the attempt shown above."""
    declined = dict(GROUNDED, answer="The documents do not say.", declined=True,
                    decline_reason="flagged", attempt="It is 1,230 km long [1].")
    out = ask_fake(declined)
    assert "\nattempt: It is 1,230 km long [1].\n" in out, out
    assert grounding_lines(out) == [
        "grounding: declined (reason: flagged): the attempt above is FLAGGED (score 0.820, 2 of 8 "
        "tokens in flagged windows, detector smollm2-v1)",
        "  details: attempt tokens on words absent from the documents 25.0% (2 of 8), lookback "
        "ratio 0.410, mean logprob -1.50"]
    refused = with_grounding(dict(declined, decline_reason="model_refused",
                                  attempt="I cannot find the answer in the provided documents."),
                             score=0.12, flagged=False, abstained=True, flagged_tokens=0)
    assert grounding_lines(ask_fake(refused))[0] == \
        "grounding: declined (reason: model_refused): the attempt above says the documents do " \
        "not answer (score 0.120, detector smollm2-v1)"
    # retrieval found nothing: nothing was generated, so there is nothing to score
    nothing = dict(declined, decline_reason="no_match", attempt=None, citations=[],
                   usage={"prompt_tokens": 0, "context_tokens": 0, "completion_tokens": 0},
                   grounding=dict(GROUNDED["grounding"], score=None, flagged=None,
                                  lookback_ratio=None, unsupported_token_ratio=None,
                                  mean_logprob=None, min_logprob=None, answer_tokens=0,
                                  flagged_tokens=0))
    out = ask_fake(nothing)
    assert "attempt:" not in out, out
    assert grounding_lines(out) == [
        "grounding: none: declined before generating (reason: no_match), nothing to score"]


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


def test_ctrl_c_during_prefill():
    """SIGINT before the first token: the daemon's reply has no token and nil grounding
    figures; the CLI says the request was cancelled before its first token (no "nan")."""
    srv = None

    def handler(req):
        if req["op"] == "query":
            srv.qid = req["id"]
            return []
        if req["op"] == "cancel":
            srv.send(req["id"], {"ok": True, "found": True, "state": "running"})
            srv.send(srv.qid, {"ok": True, "answer": "", "finish_reason": "cancelled",
                               "citations": [{"doc_id": "rhine", "chunk": 0, "score": 2.5,
                                              "offsets": [0, 40], "marker": 1}],
                               "usage": {"prompt_tokens": 900, "context_tokens": 800,
                                         "completion_tokens": 0},
                               "grounding": {"score": None, "flagged": False, "abstained": False,
                                             "lookback_ratio": None,
                                             "unsupported_token_ratio": None,
                                             "mean_logprob": None, "min_logprob": None,
                                             "answer_tokens": 0, "flagged_tokens": 0,
                                             "detector": "none"}})
            return []
        return pong(req)

    srv = FakeServer(handler)
    try:
        p = subprocess.Popen([str(DIFFRAG), "-e", srv.endpoint, "ask", "-c", "x", "q"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 10
        while not any(r["op"] == "query" for r in srv.requests):
            assert time.time() < deadline and p.poll() is None
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=10)
        print(out, err)
        assert p.returncode == 130
        assert "grounding: none: the request was cancelled before its first token\n" in out
        assert "nan" not in out and "no calibrated detector" not in out
        assert "finish: cancelled" in out
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


def test_ingest_ids_relative_to_the_folder(daemon, tmp_path):
    """50 files ingested as "." and then by the folder's absolute path: 50 documents, not 100."""
    notes = tmp_path / "notes50"
    for i in range(50):
        d = notes / ("sub%d" % (i % 4)) if i % 3 else notes
        d.mkdir(parents=True, exist_ok=True)
        (d / ("n%02d.md" % i)).write_text("# Note %d\n\nNote %d is about the number %d.\n" % (i, i, i))
    r = cli("ingest", "-c", "rel50", "--json", ".", endpoint=daemon.endpoint, cwd=notes)
    assert r.returncode == 0 and json.loads(r.stdout)["ingested"] == 50
    r = cli("ingest", "-c", "rel50", "--json", notes.resolve(), endpoint=daemon.endpoint)
    assert r.returncode == 0 and json.loads(r.stdout)["docs"] == 50, r.stdout
    r = cli("ingest", "-c", "rel50", "--json", "../n00.md", endpoint=daemon.endpoint,
            cwd=notes / "sub1")
    assert r.returncode == 0 and json.loads(r.stdout)["docs"] == 50, r.stdout
    ids = [d["id"] for d in json.loads(cli("ls", "-c", "rel50", "--json",
                                           endpoint=daemon.endpoint).stdout)["docs"]]
    assert len(ids) == 50 and "notes50/n00.md" in ids and "notes50/sub1/n01.md" in ids


def test_ingest_hostile_local_files(tmp_path):
    """Only regular UTF-8 text files are sent: a link to /dev/zero, a FIFO, a name that is not
    UTF-8, Latin-1 text, a NUL byte and a file over the request limit (refused unread) are
    skipped with a note in a folder, and are errors (exit 6) when named."""
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "good.txt").write_text("The Rhine flows through Basel.\n")
    (d / "zero.txt").symlink_to("/dev/zero")
    os.mkfifo(d / "pipe.txt")
    (d / os.fsdecode(b"caf\xe9.txt")).write_text("A name in Latin-1.\n")
    (d / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
    (d / "binary.txt").write_bytes(b"ab\x00cd\n")
    with open(d / "huge.txt", "wb") as f:           # sparse: refused by its size, never read
        f.truncate(16 << 20)
    sent = []

    def handler(req):
        if req["op"] != "ingest":
            return pong(req)
        sent.extend(doc["id"] for doc in req["docs"])
        return [{"ok": True, "collection": req["collection"], "ingested": len(req["docs"]),
                 "bytes": 10, "docs": len(sent), "chunks": len(sent)}]

    with FakeServer(handler) as srv:
        r = cli("ingest", "--json", d, endpoint=srv.endpoint, timeout=30)
        assert r.returncode == 0, r.stderr
        assert sent == ["mixed/good.txt"]
        assert json.loads(r.stdout)["skipped"] == 6
        for name, why in [("zero.txt", "not a regular file (a character device); skipped"),
                          ("pipe.txt", "not a regular file (a FIFO); skipped"),
                          ("caf\\xE9.txt", "the name is not valid UTF-8; skipped"),
                          ("latin1.txt", "not valid UTF-8 at byte 3: convert it"),
                          ("binary.txt", "a NUL byte at byte 2: not a text file; skipped"),
                          ("huge.txt", "16.0 MiB, over the 15.0 MiB a document may have")]:
            assert any(name in ln and why in ln for ln in r.stderr.splitlines()), (name, r.stderr)
        for name, why in [("zero.txt", "not a regular file (a character device)"),
                          ("pipe.txt", "not a regular file (a FIFO)"),
                          ("latin1.txt", "iconv -f LATIN1 -t UTF-8"),
                          ("binary.txt", "a NUL byte at byte 2"),
                          ("huge.txt", "16 MiB a request (max_message_bytes); split it")]:
            r = cli("ingest", d / name, endpoint=srv.endpoint, timeout=30)
            assert r.returncode == 6 and why in r.stderr, (name, r.stderr)
        assert "ingest it on the daemon's host with diffrag-store" in r.stderr   # huge.txt's way out
        assert sent == ["mixed/good.txt"]


# An id, a title and a text that would recolour the terminal, set its title or move its cursor
# if printed raw: ESC (C0), BEL, DEL and CSI (C1, U+009B).
HOSTILE_ID = "evil\x1b[31mred\u009b2J"
HOSTILE_TITLE = "T\x1b]0;pwned\x07\x7f"
HOSTILE_TEXT = "line one\tcolumn\nline \x1b[2J two\r\nend\u009b\n"
SHOWN_ID = "evil\\x1b[31mred\\u009b2J"
SHOWN_TITLE = "T\\x1b]0;pwned\\x07\\x7f"
SHOWN_TEXT = "line one\tcolumn\nline \\x1b[2J two\r\nend\\u009b\n"


def on_terminal(argv, cwd=ROOT):
    """Runs argv with stdout on a pseudo-terminal: (exit code, the bytes it printed with the
    terminal's \\r\\n turned back into \\n, stderr)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=slave,
                         stderr=subprocess.PIPE, cwd=cwd)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:   # EIO: the program closed its end and everything was read
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    err = p.communicate(timeout=30)[1].decode()
    print(argv[1:], p.returncode, repr(out), err)
    return p.returncode, out.replace(b"\r\n", b"\n"), err


def assert_no_control(out):
    """Nothing a terminal acts on: no C0 but tab, newline and carriage return, no DEL, no C1."""
    text = out.decode("utf-8")
    bad = [c for c in text if (ord(c) < 0x20 and c not in "\t\n\r") or 0x7f <= ord(c) <= 0x9f]
    assert not bad, bad


def test_listings_escape_control_characters_on_a_terminal(daemon, tmp_path):
    """An id, title and text with ESC, BEL, DEL and CSI are shown escaped (\\x1b, \\u009b) by
    ls -c, get (tabs and newlines kept) on a terminal, and reach a pipe or --json unchanged."""
    ep = daemon.endpoint
    src = tmp_path / "hostile.jsonl"
    src.write_text(json.dumps({"id": HOSTILE_ID, "title": HOSTILE_TITLE,
                               "text": HOSTILE_TEXT}) + "\n")
    assert cli("ingest", "-c", "hostile", "-q", src, endpoint=ep).returncode == 0
    rc, out, _ = on_terminal([DIFFRAG, "-e", ep, "ls", "-c", "hostile"])
    assert rc == 0
    assert_no_control(out)
    line = out.decode()
    assert line.startswith(SHOWN_ID + " " * (40 - len(SHOWN_ID)) + " ")
    assert line.endswith(" chunks  " + SHOWN_TITLE + "\n"), line
    rc, out, _ = on_terminal([DIFFRAG, "-e", ep, "get", "-c", "hostile", HOSTILE_ID])
    assert rc == 0
    assert out.decode() == SHOWN_TEXT, out   # the text's own \r\n kept, as its tab
    rc, out, _ = on_terminal([DIFFRAG, "-e", ep, "ls"])
    assert rc == 0 and "hostile" in out.decode().split()
    # a pipe gets the bytes as they are; JSON escapes them itself
    r = cli("ls", "-c", "hostile", endpoint=ep)
    assert r.stdout.startswith(HOSTILE_ID) and r.stdout.rstrip("\n").endswith(HOSTILE_TITLE)
    r = subprocess.run([str(DIFFRAG), "-e", ep, "get", "-c", "hostile", HOSTILE_ID],
                       capture_output=True, timeout=30)
    assert r.returncode == 0 and r.stdout == HOSTILE_TEXT.encode()
    rc, out, _ = on_terminal([DIFFRAG, "-e", ep, "ls", "-c", "hostile", "--json"])
    assert rc == 0 and b"\\u001b[31m" in out and b"\x1b" not in out
    assert json.loads(out)["docs"][0]["id"] == HOSTILE_ID


def test_answer_sources_and_stats_escape_control_characters_on_a_terminal():
    """ask's answer (streamed or not) and sources lines, and stats' names, on a terminal."""
    answer = dict(GROUNDED, answer="It is \x1b[5mlong\x1b[0m [1].\n\tDone.",
                  citations=[dict(GROUNDED["citations"][0], doc_id=HOSTILE_ID)])

    def handler(req):
        if req["op"] == "query":
            deltas = [{"delta": "It is \x1b[5mlong"}, {"delta": "\x1b[0m [1].\n\tDone."}]
            return (deltas if req.get("stream") else []) + [answer]
        if req["op"] == "stats" and req.get("collection"):
            return [{"ok": True, "collection": req["collection"], "docs": 1, "chunks": 1}]
        if req["op"] == "stats":
            return [{"ok": True, "version": "0.1.0\u009b", "model": "m\x1b[8m", "uptime_s": 1.0,
                     "workers": {"idle": 1, "busy": 0}, "queue_depth": 0, "inflight": 0,
                     "kv_cache_bytes": 0, "draining": False}]
        return pong(req)

    with FakeServer(handler) as srv:
        for stream in ([], ["--stream"]):
            rc, out, err = on_terminal([DIFFRAG, "-e", srv.endpoint, "ask", "-c", "x", *stream,
                                        "How long?"])
            assert rc == 0, err
            assert_no_control(out)
            text = out.decode()
            assert text.startswith("It is \\x1b[5mlong\\x1b[0m [1].\n\tDone.\n\nsources:\n")
            assert "  [1] " + SHOWN_ID + "  chunk 0, score 2.50, bytes 0-40, cited\n" in text
        rc, out, _ = on_terminal([DIFFRAG, "-e", srv.endpoint, "stats"])
        assert rc == 0
        assert_no_control(out)
        assert "diffragd:        0.1.0\\u009b\nmodel:           m\\x1b[8m\n" in out.decode()
        r = cli("ask", "-c", "x", "How long?", endpoint=srv.endpoint)
        assert r.returncode == 0 and r.stdout.startswith(answer["answer"] + "\n\nsources:\n")
        assert "  [1] " + HOSTILE_ID + "  chunk 0" in r.stdout


def test_diffrag_store_escapes_control_characters_on_a_terminal(tmp_path):
    """diffrag-store list and search print stored ids, titles and texts escaped on a terminal,
    unchanged into a pipe."""
    store = BUILD / "diffrag-store"
    src = tmp_path / "hostile.jsonl"
    src.write_text(json.dumps({"id": HOSTILE_ID, "title": HOSTILE_TITLE,
                               "text": "The river \x1b[31mRhine\x1b[0m is long."}) + "\n")
    base = [store, "--data-dir", tmp_path / "data", "-c", "hostile"]
    r = subprocess.run([str(a) for a in base + ["ingest", "--approx-tokens", src]],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rc, out, _ = on_terminal(base + ["list"])
    assert rc == 0 and out.decode() == SHOWN_ID + "\n"
    rc, out, _ = on_terminal(base + ["search", "river"])
    assert rc == 0
    assert_no_control(out)
    first, second = out.decode().splitlines()
    assert first.endswith("  " + SHOWN_ID + " #0  " + SHOWN_TITLE), first
    assert second == "    The river \\x1b[31mRhine\\x1b[0m is long.", second
    rc, out, _ = on_terminal([store, "--data-dir", tmp_path / "data", "collections"])
    assert rc == 0 and out.decode() == "hostile\n"
    r = subprocess.run([str(a) for a in base + ["list"]], capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stdout == HOSTILE_ID.encode() + b"\n"


def test_every_exit_code_is_documented():
    # the codes `diffrag --help` lists are the ones the README and docs/cli.md list
    r = cli("--help")
    helped = r.stdout.split("exit codes:", 1)[1]
    codes = [int(c) for c in re.findall(r"(?:^|,)\s*(\d+) ", helped.replace("\n", " "))]
    assert codes[:2] == [0, 1] and 6 in codes and 130 in codes, codes
    readme = (ROOT / "README.md").read_text()
    sentence = readme[readme.index("The exit status is"):].split(" ([docs/cli.md]", 1)[0]
    assert sorted(int(c) for c in re.findall(r"\b(\d+) (?:when|for)\b", sentence)) == sorted(codes), sentence
    table = (ROOT / "docs" / "cli.md").read_text().split("Exit status, for scripts:", 1)[1]
    assert sorted(int(c) for c in re.findall(r"^\| (\d+) \|", table, re.M)) == sorted(codes)


def test_ingest_skips_an_over_long_id(daemon, tmp_path):
    """A folder of 70 files and one whose id would be 261 bytes (the daemon takes 256): the
    one is skipped with a note naming it and the limit, the 70 others are stored; the file
    given directly is an error (exit 6), and nothing is sent."""
    d = tmp_path / "longnames"
    d.mkdir()
    for i in range(70):
        (d / ("f%02d.txt" % i)).write_text("File %d is about the river number %d.\n" % (i, i))
    long_name = "n" * 247 + ".txt"
    (d / long_name).write_text("A file with a very long name.\n")
    r = cli("ingest", "-c", "longids", "--json", d, endpoint=daemon.endpoint)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert (j["ingested"], j["docs"], j["skipped"]) == (70, 70, 1), j
    note = [ln for ln in r.stderr.splitlines() if long_name in ln]
    assert len(note) == 1 and "261 bytes, over the 256" in note[0] and "skipped" in note[0]
    r = cli("ingest", "-c", "longids", d / long_name, endpoint=daemon.endpoint)
    assert r.returncode == 6 and "261 bytes, over the 256" in r.stderr, r.stderr


def test_ingest_does_not_follow_links_out_of_the_folder(tmp_path):
    """A link inside the folder to a file inside it is sent under its own id; a link to a file
    outside the folder is skipped with a note naming its target; given directly, it is read."""
    secret = tmp_path / "private" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("The vault code is 4711.\n")
    d = tmp_path / "shared"
    d.mkdir()
    (d / "plain.txt").write_text("Plain text about the Rhine.\n")
    (d / "alias.txt").symlink_to("plain.txt")
    (d / "leak.txt").symlink_to(secret)
    sent = []

    def handler(req):
        if req["op"] != "ingest":
            return pong(req)
        sent.extend((doc["id"], doc["text"]) for doc in req["docs"])
        return [{"ok": True, "collection": req["collection"], "ingested": len(req["docs"]),
                 "bytes": 10, "docs": len(sent), "chunks": len(sent)}]

    with FakeServer(handler) as srv:
        r = cli("ingest", "--json", d, endpoint=srv.endpoint, timeout=30)
        assert r.returncode == 0, r.stderr
        assert [i for i, _ in sent] == ["shared/alias.txt", "shared/plain.txt"], sent
        assert not any("4711" in t for _, t in sent)
        assert json.loads(r.stdout)["skipped"] == 1
        assert any("leak.txt" in ln and "a symbolic link to a file outside the folder" in ln and
                   str(secret.resolve()) in ln for ln in r.stderr.splitlines()), r.stderr
        r = cli("ingest", d / "leak.txt", endpoint=srv.endpoint, timeout=30)
        assert r.returncode == 0 and sent[-1] == ("shared/leak.txt", "The vault code is 4711.\n")
