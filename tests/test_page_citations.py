"""Citations say where: a chunk of a text with page markers (`<!-- page N -->`, as
diffrag-extract writes a PDF) carries the pages it starts and ends on, beside its heading path.
Through diffragd: the msgpack reply's citations (`page`: [first, last] or nil) for a stored and
an inline document and a whole one, the OpenAI API's `diffrag.citations`, the Python client's
Citation.page, the CLI's sources lines, and, where diffrag-extract and pdftotext are built, a
real two-page PDF ingested with `diffrag ingest`."""
import json
import re
import shutil
import subprocess

import openai
import pytest

from conftest import BUILD
from daemon_util import Daemon, query
from test_extract import EXTRACT, make_pdf
from test_clients_python import diffrag

DIFFRAG = BUILD / "diffrag"
SEP = " \u203a "

# a report as diffrag-extract writes a PDF: each page's marker, then its text
REPORT = ("# Harbour report\n\n<!-- page 1 -->\n\nThe harbour handled more grain than in any "
          "year before. Ships waited at anchor for a week.\n\n<!-- page 2 -->\n\n## Results\n\n"
          "Profits rose by a tenth. The old quay of timber was rebuilt in stone\n\n"
          "<!-- page 3 -->\n\nduring the spring, before the floods came.\n\n"
          "<!-- page 4 -->\n\n## Appendix\n\nSailors sang songs of home on every evening.\n")
DOCS = [{"id": "report.pdf", "title": "Harbour report", "text": REPORT},
        {"id": "notes", "title": "Notes", "text": "The quay keeper keeps a log of every ship."}]
QUESTION = "When was the quay of timber rebuilt in stone?"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, default_model):
    d = Daemon(tmp_path_factory.mktemp("pages"), default_model, workers=1, threads=2,
               max_tokens=4, relevance_floor=0)
    with d:
        _, r = d.client().call({"v": 1, "op": "ingest", "collection": "p", "docs": DOCS},
                               timeout=120)
        assert r["ok"], r
        yield d
        assert d.stop() == 0, d.log_text()[-2000:]


def by_doc(cites):
    """Each document's citation of the highest chunk index."""
    return {c["doc_id"]: c for c in sorted(cites, key=lambda c: c["chunk"])}


def test_msgpack_citations_carry_heading_and_page(daemon):
    c = daemon.client()
    # chunks, not whole documents: the appendix (page 4) matches no word of the question, so
    # the report is never covered by its placed chunks
    for where in ({"collection": "p"}, {"docs": DOCS}):
        _, r = c.call(query(QUESTION, top_k=3, temperature=0, max_context_tokens=200, **where),
                      timeout=300)
        assert r["ok"], r
        print(where.keys(), [(x["doc_id"], x["chunk"], x["heading"], x["page"])
                             for x in r["citations"]])
        cites = by_doc(r["citations"])
        rep = cites["report.pdf"]
        first = [x for x in r["citations"] if x["doc_id"] == "report.pdf" and x["chunk"] == 0]
        assert all(x["page"] == [1, 1] and x["heading"] == "" for x in first), first
        assert not rep["whole"] and rep["heading"] == "Results" and rep["page"] == [2, 3], rep
        assert cites["notes"]["page"] is None and cites["notes"]["heading"] == "", cites["notes"]
        for x in r["citations"]:   # the pages are those of the cited bytes
            if x["page"]:
                # a marker the chunk ends with has none of its page's text
                text = re.sub(r"(\s*<!-- page \d+ -->\s*)+$", "",
                              REPORT.encode()[:x["offsets"][1]].decode())
                marks = [int(m) for m in re.findall(r"^<!-- page (\d+) -->$", text, re.M)]
                assert x["page"][1] == marks[-1], (x, marks)
    # the whole document: its first and last pages
    _, r = c.call(query(QUESTION, docs=DOCS[:1], temperature=0), timeout=300)
    assert r["ok"] and r["citations"][0]["whole"] and r["citations"][0]["page"] == [1, 4], r


def test_openai_citations_pass_them(daemon):
    api = openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="none", max_retries=0,
                        timeout=120)
    r = api.chat.completions.create(
        model="any", messages=[{"role": "user", "content": QUESTION}], max_tokens=4,
        temperature=0, extra_body={"diffrag": {"collection": "p", "top_k": 3,
                                               "max_context_tokens": 200}})
    cites = by_doc(r.model_extra["diffrag"]["citations"])
    assert cites["report.pdf"]["page"] == [2, 3] and cites["report.pdf"]["heading"] == "Results"
    assert cites["notes"]["page"] is None, cites


def test_python_client_reads_them(daemon):
    with diffrag.Client(daemon.endpoint) as c:
        a = c.query(QUESTION, collection="p", top_k=3, max_context_tokens=200, max_tokens=4)
    cites = {x.doc_id: x for x in sorted(a.citations, key=lambda x: x.chunk)}
    assert [x.page for x in a.citations if x.doc_id == "report.pdf" and x.chunk == 0] in ([], [(1, 1)])
    assert cites["report.pdf"].page == (2, 3) and cites["report.pdf"].heading == "Results"
    assert cites["notes"].page is None and cites["notes"].heading == ""


def ask(daemon, *args):
    r = subprocess.run([str(DIFFRAG), "-e", daemon.endpoint, "ask", QUESTION, "--max-tokens", "4",
                        *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\nsources:\n", 1)[1].splitlines()


def test_cli_sources_say_where(daemon, tmp_path):
    lines = ask(daemon, "-c", "p", "--top-k", "3", "--max-context-tokens", "200")
    print("\n".join(lines))
    assert any(re.fullmatch(r"  \[\d\] report\.pdf" + SEP + r"Results, pp\. 2\u20133  chunk 1, "
                            r"score \d+\.\d\d, bytes \d+-\d+(, cited)?", ln) for ln in lines), lines
    # notes is one chunk, placed: the whole document (docs/retriever.md)
    assert any(re.fullmatch(r"  \[\d\] notes  whole document, score \d+\.\d\d, bytes 0-42(, cited)?",
                            ln) for ln in lines), lines
    (tmp_path / "report.md").write_text(REPORT)   # sent inline: placed whole
    whole = ask(daemon, "-d", str(tmp_path / "report.md"))
    assert re.fullmatch(r"  \[1\] \S+report\.md, pp\. 1\u20134  whole document, score \d+\.\d\d, "
                        r"bytes 0-%d(, cited)?" % len(REPORT.encode()), whole[0]), whole


def test_real_pdf(daemon, tmp_path):
    """A hand-written two-page PDF through `diffrag ingest` (diffrag-extract), each page longer
    than a chunk: the chunk that holds a sentence of the second page ends on page 2, and the
    CLI's sources say so."""
    if not EXTRACT.exists() or not shutil.which("pdftotext"):
        pytest.skip("diffrag-extract or pdftotext missing (tools/install-deps.sh installs them)")
    d = tmp_path / "pdfs"
    d.mkdir()
    filler = "\n".join("On day %d the keeper wrote down the wind, the tide and the ships." % i
                       for i in range(40))
    pages = ["Lighthouse log\nThe lamp was lit at dusk every day of the year.\n" + filler,
             filler + "\nIn March a storm broke the lantern glass of the lighthouse."]
    (d / "light.pdf").write_bytes(make_pdf(pages, title="Lighthouse log"))
    r = subprocess.run([str(DIFFRAG), "-e", daemon.endpoint, "ingest", "-c", "pdf", str(d)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    q = "What broke the lantern glass in March?"
    _, m = daemon.client().call(query(q, collection="pdf", max_context_tokens=400, top_k=1,
                                      temperature=0), timeout=300)
    assert m["ok"], m
    print(json.dumps(m["citations"]))
    cite = m["citations"][0]
    assert cite["doc_id"].endswith("light.pdf") and not cite["whole"], cite
    _, g = daemon.client().call({"v": 1, "op": "get", "collection": "pdf", "doc_id": cite["doc_id"]},
                                timeout=60)
    text = g["doc"]["text"].encode()
    assert b"lantern" in text[cite["offsets"][0]:cite["offsets"][1]], cite
    assert cite["page"] and cite["page"][1] == 2, cite
    r = subprocess.run([str(DIFFRAG), "-e", daemon.endpoint, "ask", q, "-c", "pdf",
                        "--max-tokens", "4", "--max-context-tokens", "400", "--top-k", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    src = r.stdout.split("\nsources:\n", 1)[1].splitlines()
    assert re.match(r"  \[1\] pdfs/light\.pdf, p\. 2  chunk %d, " % cite["chunk"], src[0]), src
