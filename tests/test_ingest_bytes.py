"""The `ingest` op with a file's bytes (docs/protocol.md#ingest): diffragd finds the format by
content, runs diffrag-extract for a PDF, DOCX or HTML file and stores the title and Markdown it
writes; text files are stored as text. Against a real daemon on loopback (a tiny model): an
HTML page, a hand-written two-page PDF and a DOCX stored with their titles, found by a query,
the PDF's chunks cited with pages; the Python client's ingest_files; a truncated PDF, a DOCX zip
bomb and bytes that are neither a document nor UTF-8 refused with an error naming the
document, the batch left unstored; the request's limits; a helper that hangs (stopped at
extract_timeout_ms while the daemon answers others) and one that is missing."""
import os
import shutil
import time
import zipfile

import pytest

from daemon_util import Daemon, fast_model, query
from test_extract import EXTRACT, HTML, make_docx, make_pdf
from test_clients_python import diffrag

needs_helper = pytest.mark.skipif(
    not EXTRACT.exists() or not shutil.which("pdftotext"),
    reason="diffrag-extract or pdftotext missing (tools/install-deps.sh installs them)")

FILLER = "\n".join("On day %d the keeper wrote down the wind, the tide and the ships." % i
                   for i in range(40))
PDF = make_pdf(["Lighthouse log\nThe lamp was lit at dusk every day of the year.\n" + FILLER,
                FILLER + "\nIn March a storm broke the lantern glass of the lighthouse."],
               title="Lighthouse log")


def docx_bytes(tmp_path):
    make_docx(tmp_path / "rep.docx")
    return (tmp_path / "rep.docx").read_bytes()


def bomb_bytes(tmp_path):
    with zipfile.ZipFile(tmp_path / "bomb.docx", "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("word/document.xml", "w", force_zip64=True) as f:
            for _ in range(100):
                f.write(b"\0" * (1 << 20))
    return (tmp_path / "bomb.docx").read_bytes()


def ingest(d, docs, coll="files", timeout=120):
    _, r = d.client().call({"v": 1, "op": "ingest", "collection": coll, "docs": docs},
                           timeout=timeout)
    return r


def get(d, doc_id, coll="files"):
    _, r = d.client().call({"v": 1, "op": "get", "collection": coll, "doc_id": doc_id})
    return r


def ping(d, timeout=5.0):
    _, r = d.client().call({"v": 1, "op": "ping"}, timeout=timeout)
    return r


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ingest-bytes")
    d = Daemon(tmp, fast_model(tmp), workers=1, max_tokens=4, relevance_floor=0,
               max_file_bytes="1MiB", io_threads=2)
    with d:
        yield d
        assert d.stop() == 0, d.log_text()[-2000:]


@needs_helper
def test_html_pdf_docx_stored_found_and_cited(daemon, tmp_path):
    r = ingest(daemon, [{"name": "rhine.html", "bytes": HTML.encode()},
                        {"name": "light.pdf", "bytes": PDF, "meta": {"kind": "log"}},
                        {"id": "report", "name": "rep.docx", "bytes": docx_bytes(tmp_path)}])
    assert r["ok"], r
    assert r["ingested"] == 3 and r["added"] == 3, r
    html = get(daemon, "rhine.html")["doc"]
    assert html["title"] == "The Rhine & its Valley", html
    assert "# Rhine river\n" in html["text"] and "- Basel\n" in html["text"]
    assert "SCRIPTTEXT" not in html["text"] and "<p>" not in html["text"]
    pdf = get(daemon, "light.pdf")["doc"]
    assert pdf["title"] == "Lighthouse log" and pdf["meta"] == {"kind": "log"}, pdf
    assert pdf["text"].startswith("<!-- page 1 -->\n\nLighthouse log\n"), pdf["text"][:200]
    assert "<!-- page 2 -->" in pdf["text"] and "storm broke the lantern glass" in pdf["text"]
    docx = get(daemon, "report")["doc"]
    assert docx["title"] == "Report 2024", docx
    assert docx["text"].startswith("# Annual Report\n\n# Overview\n\nSales grew by 5%"), docx
    assert "| Norway | 5\\|6 |" in docx["text"]
    # found by a query; the PDF's chunk of page 2 is cited with its page
    _, m = daemon.client().call(query("What broke the lantern glass in March?", collection="files",
                                      max_context_tokens=400, top_k=1, temperature=0),
                                timeout=300)
    assert m["ok"], m
    cite = m["citations"][0]
    assert cite["doc_id"] == "light.pdf" and cite["page"] is not None, cite
    assert cite["page"][1] == 2, cite
    _, m = daemon.client().call(query("Which cities lie on the Rhine river?", collection="files",
                                      max_context_tokens=400, top_k=1, temperature=0),
                                timeout=300)
    assert m["ok"] and m["citations"][0]["doc_id"] == "rhine.html", m["citations"]
    # the same bytes again: unchanged, nothing written
    r = ingest(daemon, [{"name": "light.pdf", "bytes": PDF, "meta": {"kind": "log"}}])
    assert r["ok"] and r["unchanged"] == 1, r


def test_text_bytes_stored_as_text(daemon):
    r = ingest(daemon, [{"name": "notes/harbour.txt", "bytes": "Ships wait at anchor.\n".encode()},
                        {"name": "guide.md", "bytes": b"Intro\n# Quay guide\nThe quay is stone.\n"},
                        {"name": "n.txt", "title": "Given", "bytes": "Caf\u00e9 au lait".encode()}],
               coll="text")
    assert r["ok"] and r["ingested"] == 3, r
    d = get(daemon, "notes/harbour.txt", "text")["doc"]
    assert d["title"] == "harbour" and d["text"] == "Ships wait at anchor.\n", d
    d = get(daemon, "guide.md", "text")["doc"]
    assert d["title"] == "Quay guide" and d["text"] == "Intro\n# Quay guide\nThe quay is stone.\n", d
    d = get(daemon, "n.txt", "text")["doc"]
    assert d["title"] == "Given" and d["text"] == "Caf\u00e9 au lait", d


def test_invalid_utf8_is_the_text_error(daemon):
    """Bytes that are no document and not UTF-8 get the text path's error, not a PDF's; the
    good document of the batch is not stored either."""
    r = ingest(daemon, [{"name": "good.txt", "bytes": b"fine text"},
                        {"name": "latin.txt", "bytes": b"caf\xe9 au lait"}], coll="bad")
    assert not r["ok"] and r["error"]["code"] == "bad_request", r
    msg = r["error"]["message"]
    assert msg == 'document 1 ("latin.txt"): text is not valid UTF-8 (byte 3)', msg
    assert get(daemon, "good.txt", "bad")["error"]["code"] == "not_found"


@needs_helper
def test_damaged_documents_refuse_the_batch(daemon, tmp_path):
    cut = PDF[:len(PDF) // 2]
    r = ingest(daemon, [{"name": "ok.txt", "bytes": b"fine"}, {"name": "cut.pdf", "bytes": cut}],
               coll="bad")
    assert not r["ok"] and r["error"]["code"] == "bad_request", r
    msg = r["error"]["message"]
    assert msg.startswith('document 1 ("cut.pdf"): a PDF: ') and "truncated" in msg, msg
    assert "iconv" not in msg
    r = ingest(daemon, [{"name": "bomb.docx", "bytes": bomb_bytes(tmp_path)}], coll="bad")
    assert not r["ok"] and r["error"]["code"] == "bad_request", r
    msg = r["error"]["message"]
    assert msg.startswith('document 0 ("bomb.docx"): a DOCX: ') and "zip bomb" in msg, msg
    # a text file named .pdf: the helper says what it is not
    r = ingest(daemon, [{"name": "fake.pdf", "bytes": b"plain words"}], coll="bad")
    assert not r["ok"] and "does not start with %PDF-: not a PDF" in r["error"]["message"], r
    assert get(daemon, "ok.txt", "bad")["error"]["code"] == "not_found"
    assert ping(daemon)["ok"]


@needs_helper
def test_concurrent_file_ingests(daemon, tmp_path):
    """Six clients at once, three batches each into a collection of their own and one they
    share: every good batch is stored whole (each file with its title), every batch with a cut
    PDF is refused naming it and stores nothing, the daemon answers a ping throughout, and the
    collections hold exactly what was acknowledged."""
    import threading
    docx = docx_bytes(tmp_path)
    cut = PDF[:len(PDF) // 2]
    results, errors = {}, []

    def client(k):
        try:
            c = daemon.client()
            out = []
            for b in range(3):
                docs = [{"id": "c%d-b%d-html" % (k, b), "name": "page.html", "bytes": HTML.encode()},
                        {"id": "c%d-b%d-pdf" % (k, b), "name": "log.pdf", "bytes": PDF},
                        {"id": "c%d-b%d-docx" % (k, b), "name": "rep.docx", "bytes": docx}]
                if b == 1:
                    docs.append({"id": "c%d-b%d-cut" % (k, b), "name": "cut.pdf", "bytes": cut})
                coll = "own%d" % k if b != 2 else "shared"
                _, r = c.call({"v": 1, "op": "ingest", "collection": coll, "docs": docs},
                              timeout=300)
                out.append((coll, b, r))
            results[k] = out
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    pings = 0
    while any(t.is_alive() for t in threads):
        assert ping(daemon, timeout=30)["ok"]
        pings += 1
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert not errors, errors
    assert pings > 0
    for k, out in results.items():
        for coll, b, r in out:
            if b == 1:
                assert not r["ok"] and r["error"]["code"] == "bad_request", r
                assert '("cut.pdf")' in r["error"]["message"] and "truncated" in r["error"]["message"], r
            else:
                assert r["ok"] and r["ingested"] == 3, r
        for b, coll in ((0, "own%d" % k), (2, "shared")):
            assert get(daemon, "c%d-b%d-pdf" % (k, b), coll)["doc"]["title"] == "Lighthouse log"
            assert get(daemon, "c%d-b%d-docx" % (k, b), coll)["doc"]["title"] == "Report 2024"
            assert get(daemon, "c%d-b%d-html" % (k, b), coll)["doc"]["title"] == "The Rhine & its Valley"
        assert get(daemon, "c%d-b1-html" % k, "own%d" % k)["error"]["code"] == "not_found"
    _, st = daemon.client().call({"v": 1, "op": "stats", "collection": "shared"})
    assert st["ok"] and st["docs"] == 18, st
    for k in range(6):
        _, st = daemon.client().call({"v": 1, "op": "stats", "collection": "own%d" % k})
        assert st["ok"] and st["docs"] == 3, st


def test_request_limits_and_shape(daemon):
    def err(doc, op="ingest"):
        msg = {"v": 1, "op": op, "docs": [doc]}
        msg.update({"collection": "lim"} if op == "ingest" else {"question": "q"})
        _, r = daemon.client().call(msg)
        assert not r["ok"], r
        return r["error"]["code"], r["error"]["message"]
    code, msg = err({"name": "big.txt", "bytes": b"a" * ((1 << 20) + 1)})
    assert code == "too_large" and "max_file_bytes" in msg and "docs[0].bytes" in msg, msg
    assert err({"name": "x.txt", "bytes": "a str"})[1] == \
        "docs[0].bytes must be binary (msgpack bin), not string"
    assert "no name" in err({"bytes": b"text"})[1]
    assert "both text and bytes" in err({"name": "a", "bytes": b"x", "text": "x"})[1]
    assert "goes with bytes" in err({"id": "a", "name": "a", "text": "x"})[1]
    assert "NUL" in err({"name": "a\0b", "bytes": b"x"})[1]
    assert "a query's documents are text" in err({"name": "a", "bytes": b"x"}, op="query")[1]
    code, msg = err({"name": "empty.txt", "bytes": b""})
    assert code == "bad_request" and "empty text" in msg, msg
    assert ping(daemon)["ok"]


@needs_helper
def test_python_client_ingest_files(daemon, tmp_path):
    (tmp_path / "page.html").write_text(HTML, encoding="utf-8")
    (tmp_path / "light.pdf").write_bytes(PDF)
    (tmp_path / "plain.txt").write_text("The keeper's cat sleeps by the lamp.")
    with diffrag.Client(daemon.endpoint, timeout=120) as c:
        res = c.ingest_files("py", [tmp_path / "page.html", str(tmp_path / "light.pdf"),
                                    tmp_path / "plain.txt"])
        assert res.ingested == 3 and res.added == 3, res
        assert c.get("py", "page.html").title == "The Rhine & its Valley"
        assert c.get("py", "plain.txt").text == "The keeper's cat sleeps by the lamp."
        res = c.ingest("py", [{"id": "d", "name": "d.docx", "bytes": bytearray(docx_bytes(tmp_path))}])
        assert res.ingested == 1 and c.get("py", "d").title == "Report 2024"
        with pytest.raises(diffrag.errors.BadRequest, match=r'"cut\.pdf"\): a PDF: .*truncated'):
            c.ingest("py", [{"name": "cut.pdf", "bytes": PDF[:200]}])
        with pytest.raises(ValueError, match="no name"):
            c.ingest("py", [{"bytes": b"x"}])


def hanging_helper(tmp_path):
    """A stand-in for diffrag-extract (argv: --name NAME --max-output N -): for a file named
    hang*, it starts a child and never answers; for others it waits a second, then runs the
    real one."""
    script = tmp_path / "hang.sh"
    script.write_text('#!/bin/sh\ncase "$2" in\nhang*)\n  echo $$ > %s/helper.pid\n'
                      '  sleep 300 &\n  echo $! > %s/child.pid\n  wait;;\n'
                      '*) sleep 1; exec %s "$@";;\nesac\n' % (tmp_path, tmp_path, EXTRACT))
    script.chmod(0o755)
    return script


def gone(pid, within=5.0):
    end = time.time() + within
    while time.time() < end:
        try:
            with open("/proc/%d/stat" % pid) as f:
                if f.read().split(") ")[-1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_hanging_helper_is_stopped(tmp_path):
    d = Daemon(tmp_path, fast_model(tmp_path), workers=1, max_tokens=4, io_threads=2,
               extract_helper=hanging_helper(tmp_path), extract_timeout_ms=1500)
    with d:
        slow = d.client()
        t0 = time.time()
        slow.send({"v": 1, "op": "ingest", "collection": "h", "id": 1,
                   "docs": [{"name": "hang.html", "bytes": HTML.encode()}]})
        # the other I/O thread and the broker go on meanwhile
        time.sleep(0.3)
        t1 = time.time()
        assert ping(d)["ok"] and time.time() - t1 < 1.0
        r = ingest(d, [{"id": "t", "text": "The harbour handled grain."}], coll="t")
        assert r["ok"], r
        r = slow.recv(timeout=30)
        took = time.time() - t0
        assert not r["ok"] and r["error"]["code"] == "bad_request", r
        assert r["error"]["message"] == ('document 0 ("hang.html"): an HTML: extracting its text '
                                         'took over 1500 ms (extract_timeout_ms); stopped'), r
        assert 1.4 < took < 10, took
        # the helper and its child were killed with their process group
        for f in ("helper.pid", "child.pid"):
            assert gone(int((tmp_path / f).read_text())), f
        assert get(d, "hang.html", "h")["error"]["code"] == "not_found"
        # extract_timeout_ms holds for a request's files together: the first takes a second,
        # the second gets what is left
        if EXTRACT.exists():
            r = ingest(d, [{"name": "a.html", "bytes": HTML.encode()},
                           {"name": "b.html", "bytes": HTML.encode()}], coll="h")
            assert not r["ok"], r
            msg = r["error"]["message"]
            assert msg.startswith('document 1 ("b.html"): an HTML: extracting its text took over '
                                  'the ') and "left of the request's 1500 ms" in msg, msg
            r = ingest(d, [{"name": "a.html", "bytes": HTML.encode()}], coll="h")
            assert r["ok"], r
        _, m = d.client().call(query("What did the harbour handle?", collection="t",
                                     temperature=0), timeout=120)
        assert m["ok"], m
        assert d.proc.poll() is None
        assert d.stop() == 0, d.log_text()[-2000:]


def test_missing_helper(tmp_path):
    d = Daemon(tmp_path, fast_model(tmp_path), workers=1, max_tokens=4,
               extract_helper=tmp_path / "no-such-helper")
    with d:
        r = ingest(d, [{"name": "light.pdf", "bytes": PDF}])
        assert not r["ok"] and r["error"]["code"] == "internal", r
        msg = r["error"]["message"]
        assert msg.startswith('document 0 ("light.pdf"): a PDF: diffrag-extract (extract_helper = '), msg
        assert "cannot be run: No such file or directory" in msg, msg
        assert "cannot extract a document" in d.log_text()
        # text files need no helper
        r = ingest(d, [{"name": "a.txt", "bytes": b"plain"}])
        assert r["ok"], r
        assert ping(d)["ok"] and d.proc.poll() is None
        assert d.stop() == 0, d.log_text()[-2000:]
