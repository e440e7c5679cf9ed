"""diffrag-extract and the ingest of PDF, DOCX and HTML files: every fixture is made here (HTML
written out, DOCX zipped by zipfile, PDFs written object by object, an encrypted one by qpdf):
the Markdown, headings, tables and titles of each format; a PDF's page markers; the errors of a
scanned, truncated, damaged and encrypted PDF, of zip bombs and of files that are not what their
names say; the processor-time limit and the sandbox a child runs in; and `diffrag-store ingest`
and `diffrag ingest` of a folder that mixes good and bad documents (the daemon replaced by a fake
server)."""
import io
import json
import os
import shutil
import signal
import subprocess
import zipfile

import pytest

from conftest import BUILD
from test_clients_python import GROUNDED, FakeServer, pong

EXTRACT = BUILD / "diffrag-extract"
STORE = BUILD / "diffrag-store"
DIFFRAG = BUILD / "diffrag"
W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'


def pdf_string(text):
    """A PDF text string: latin-1 as a literal, anything else as UTF-16BE in hex."""
    try:
        esc = text.encode("latin-1").replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)")
        return b"(" + esc + b")"
    except UnicodeEncodeError:
        return b"<FEFF" + text.encode("utf-16-be").hex().upper().encode() + b">"


def make_pdf(pages, title=None, outline=()):
    """A PDF with one page per string of `pages` (lines split on newlines; None: a page with a
    filled square and no text), in Helvetica, with an Info Title when given, and an outline
    (bookmarks) of (title, page index, [children]) entries."""
    objs = []

    def add(body):
        objs.append(body)
        return len(objs)
    cat, pages_id = add(None), add(None)
    font = add(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>")
    kids = []
    for text in pages:
        if text is None:
            stream = b"0 0 1 rg 10 10 100 100 re f"
        else:
            parts = [b"BT /F1 12 Tf 72 720 Td 14 TL"]
            for line in text.split("\n"):
                esc = line.encode("cp1252").replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)")
                parts.append(b"(" + esc + b") Tj T*")
            stream = b"\n".join(parts + [b"ET"])
        content = add(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
        kids.append(add(b"<< /Type /Page /Parent %d 0 R /MediaBox [0 0 612 792] /Resources << /Font "
                        b"<< /F1 %d 0 R >> >> /Contents %d 0 R >>" % (pages_id, font, content)))
    def entries(items, parent):
        """The outline entries of items under parent: (first id, last id, count)."""
        ids = [add(None) for _ in items]
        for i, (text, page, children) in enumerate(items):
            first, last, count = entries(children, ids[i])
            d = [b"/Title " + pdf_string(text), b"/Parent %d 0 R" % parent,
                 b"/Dest [%d 0 R /XYZ 0 792 0]" % kids[page]]
            if i:
                d.append(b"/Prev %d 0 R" % ids[i - 1])
            if i + 1 < len(ids):
                d.append(b"/Next %d 0 R" % ids[i + 1])
            if children:
                d.append(b"/First %d 0 R /Last %d 0 R /Count %d" % (first, last, count))
            objs[ids[i] - 1] = b"<< " + b" ".join(d) + b" >>"
        n = len(items) + sum(entries_count(c) for _, _, c in items)
        return (ids[0], ids[-1], n) if ids else (0, 0, 0)

    def entries_count(items):
        return len(items) + sum(entries_count(c) for _, _, c in items)
    outlines = b""
    if outline:
        root = add(None)
        first, last, count = entries(list(outline), root)
        objs[root - 1] = b"<< /Type /Outlines /First %d 0 R /Last %d 0 R /Count %d >>" % (
            first, last, count)
        outlines = b" /Outlines %d 0 R /PageMode /UseOutlines" % root
    objs[cat - 1] = b"<< /Type /Catalog /Pages %d 0 R%s >>" % (pages_id, outlines)
    objs[pages_id - 1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (
        b" ".join(b"%d 0 R" % k for k in kids), len(kids))
    info = add(b"<< /Title (" + title.encode("latin-1") + b") >>") if title else None
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for i, body in enumerate(objs, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % i + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1))
    for o in offsets:
        out.write(b"%010d 00000 n \n" % o)
    out.write(b"trailer\n<< /Size %d /Root %d 0 R%s >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objs) + 1, cat, (b" /Info %d 0 R" % info) if info else b"", xref))
    return out.getvalue()


def para(text, style=None, numbered=False):
    ppr = ""
    if style or numbered:
        ppr = ("<w:pPr>" + (f'<w:pStyle w:val="{style}"/>' if style else "") +
               ('<w:numPr><w:ilvl w:val="0"/><w:numId w:val="1"/></w:numPr>' if numbered else "") +
               "</w:pPr>")
    return f'<w:p>{ppr}<w:r><w:t xml:space="preserve">{text}</w:t></w:r></w:p>'


def make_docx(path, core_title="Report 2024"):
    """A DOCX: a Title paragraph, Heading1, a paragraph of runs with a tab, a break, an entity and
    deleted text, a heading by a localised style id that styles.xml names "heading 2", list
    items, a table; docProps/core.xml with dc:title when core_title is given."""
    cell = lambda t: f"<w:tc>{para(t)}</w:tc>"
    body = (para("Annual Report", "Title") + para("Overview", "Heading1") +
            "<w:p><w:r><w:t>Sales grew</w:t></w:r><w:r><w:tab/><w:t>by 5%</w:t><w:br/>"
            "<w:t>in Norway &amp; Sweden.</w:t></w:r><w:del><w:r><w:delText>WITHDRAWN"
            "</w:delText></w:r></w:del></w:p>" +
            para("Details", "berschrift2") + para("item one", numbered=True) +
            para("item two", numbered=True) +
            "<w:tbl><w:tr>" + cell("Country") + cell("Growth") + "</w:tr><w:tr>" + cell("Norway") +
            cell("5|6") + "</w:tr></w:tbl>")
    doc = (f'<?xml version="1.0" encoding="UTF-8" standalone="yes"?><w:document {W}><w:body>'
           f'{body}<w:sectPr/></w:body></w:document>')
    styles = (f'<?xml version="1.0"?><w:styles {W}><w:style w:type="paragraph" '
              'w:styleId="berschrift2"><w:name w:val="heading 2"/></w:style></w:styles>')
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml", "<Types/>")
        z.writestr("word/document.xml", doc)
        z.writestr("word/styles.xml", styles)
        if core_title:
            z.writestr("docProps/core.xml",
                       '<?xml version="1.0"?><cp:coreProperties xmlns:cp="http://schemas.openxml'
                       'formats.org/package/2006/metadata/core-properties" xmlns:dc="http://purl.org'
                       f'/dc/elements/1.1/"><dc:title>{core_title}</dc:title></cp:coreProperties>')


HTML = """<!DOCTYPE html>
<html><head><title>The  Rhine &amp; its Valley</title><style>body{color:red}</style>
<script>var x = "SCRIPTTEXT";</script></head>
<body><nav><a href="/">NAVTEXT Home</a></nav>
<header><h1>Rhine river</h1></header>
<p>The Rhine is a  river in <b>Europe</b>.<br>It flows north &mdash; to the sea.</p>
<h2>Cities</h2>
<ul><li>Basel</li><li>Cologne<ul><li>Old town</li></ul></li></ul>
<ol><li>first</li><li>second</li></ol>
<table><caption>Lengths</caption><thead><tr><th>River</th><th>km</th></tr></thead>
<tbody><tr><td>Rhine</td><td>1,233</td></tr><tr><td>A|B</td><td>2</td></tr></tbody></table>
<p># not a heading</p>
<aside>ASIDETEXT</aside><footer>FOOTERTEXT</footer><noscript>NOSCRIPTTEXT</noscript>
</body></html>
"""


def extract(path, *args, env=None):
    r = subprocess.run([str(EXTRACT), *args, str(path)], capture_output=True, timeout=60,
                       env=env)
    return r.returncode, r.stdout.decode("utf-8"), r.stderr.decode("utf-8")


def test_html(tmp_path):
    (tmp_path / "page.html").write_text(HTML, encoding="utf-8")
    rc, out, err = extract(tmp_path / "page.html")
    assert rc == 0, err
    assert out.splitlines()[0] == "title: The Rhine & its Valley"
    body = out.split("\n", 1)[1]
    for want in ("# Rhine river\n", "The Rhine is a river in Europe.\nIt flows north \u2014 to the sea.",
                 "\n## Cities\n", "- Basel\n- Cologne\n   - Old town\n", "1. first\n2. second\n",
                 "Lengths\n\n| River | km |\n|---|---|\n| Rhine | 1,233 |\n| A\\|B | 2 |\n",
                 "\\# not a heading"):
        assert want in body, (want, body)
    for gone in ("SCRIPTTEXT", "NAVTEXT", "ASIDETEXT", "FOOTERTEXT", "NOSCRIPTTEXT", "color:red"):
        assert gone not in body
    # found by content, whatever the name; a page without <title> takes its first h1, a
    # fragment named .htm its file name
    (tmp_path / "noext").write_bytes(b"\xef\xbb\xbf  <!-- saved -->\n<!doctype HTML><body><h1>Only heading</h1>x")
    rc, out, _ = extract(tmp_path / "noext")
    assert rc == 0 and out.startswith("title: Only heading\n# Only heading\n")
    (tmp_path / "frag.htm").write_text("<p>a fragment</p>")
    rc, out, _ = extract(tmp_path / "frag.htm")
    assert rc == 0 and out == "title: frag\na fragment\n"
    (tmp_path / "plain.txt").write_text("just text")
    rc, out, err = extract(tmp_path / "plain.txt")
    assert rc == 1 and out == "" and "not a PDF, DOCX or HTML document" in err and "unsupported format" in err


def test_html_definition_lists(tmp_path):
    """A term and its definition make one paragraph, so no chunk ends between them (an option
    list of a manual page): terms joined by commas, the definition after a colon, a second
    definition on a line of its own, items grouped in a <div>, blocks and lists inside a
    definition, a definition list inside a list item."""
    (tmp_path / "opts.html").write_text(
        "<title>bzip2</title><p>Options:</p><dl>\n"
        "<dt>-c</dt><dt>--stdout</dt><dd><p>Compress or decompress to standard output.</p></dd>\n"
        "<dt>-k --keep</dt>\n<dd>Keep (don't delete) input files during compression\n"
        "or decompression.</dd><dd>A second definition.</dd>\n"
        "<div><dt>-s</dt><dd>Reduce memory usage, <b>for</b> compression.<ul><li>one</li>"
        "<li>two</li></ul></dd></div></dl><p>After the list.</p>"
        "<ul><li>item <dl><dt>a</dt><dd>b</dd></dl></li></ul>", encoding="utf-8")
    rc, out, err = extract(tmp_path / "opts.html")
    assert rc == 0, err
    assert out == ("title: bzip2\nOptions:\n\n"
                   "-c, --stdout: Compress or decompress to standard output.\n\n"
                   "-k --keep: Keep (don't delete) input files during compression or "
                   "decompression.\nA second definition.\n\n"
                   "-s: Reduce memory usage, for compression.\n- one\n- two\n\n"
                   "After the list.\n\n- item a: b\n"), out


def test_html_charsets(tmp_path):
    """Pages in other encodings come out as UTF-8: by their <meta> (Latin-1 read as
    windows-1252, as browsers do, and windows-1251), without one when the bytes are not UTF-8
    (windows-1252), and a label iconv does not know or UTF-16 is no label."""
    cases = [
        (b'<html><head><meta http-equiv="Content-Type" content="text/html; charset=ISO-8859-1">'
         b'<title>Caf\xe9</title></head><body><h1>Na\xefve \x96 test</h1><p>\x93quoted\x94 '
         b'r\xe9sum\xe9</p></body></html>',
         "title: Caf\u00e9\n# Na\u00efve \u2013 test\n\n\u201cquoted\u201d r\u00e9sum\u00e9\n"),
        (b"<html><head><meta charset='windows-1251'><title>\xcf\xf0\xe8\xe2\xe5\xf2</title>"
         b"</head><body><p>\xec\xe8\xf0</p></body></html>",
         "title: \u041f\u0440\u0438\u0432\u0435\u0442\n\u043c\u0438\u0440\n"),
        (b"<html><body><h1>Stra\xdfe</h1><p>no declaration, caf\xe9</p></body></html>",
         "title: Stra\u00dfe\n# Stra\u00dfe\n\nno declaration, caf\u00e9\n"),
        (b'<html><head><meta charset="x-no-such"><title>caf\xc3\xa9</title></head><p>na\xc3\xafve</p></html>',
         "title: caf\u00e9\nna\u00efve\n"),
        (b'<html><head><meta charset="utf-16"><title>caf\xc3\xa9</title></head><p>na\xc3\xafve</p></html>',
         "title: caf\u00e9\nna\u00efve\n"),
        (b'<html><head><meta charset="utf-8"><title>caf\xc3\xa9</title></head><p>na\xc3\xafve</p></html>',
         "title: caf\u00e9\nna\u00efve\n"),
    ]
    for i, (raw, want) in enumerate(cases):
        f = tmp_path / ("page%d.html" % i)
        f.write_bytes(raw)
        rc, out, err = extract(f)
        assert rc == 0, (i, err)
        assert out == want, (i, out, want)


def test_docx(tmp_path):
    make_docx(tmp_path / "rep.docx")
    rc, out, err = extract(tmp_path / "rep.docx")
    assert rc == 0, err
    assert out == ("title: Report 2024\n# Annual Report\n\n# Overview\n\nSales grew by 5%\n"
                   "in Norway & Sweden.\n\n## Details\n\n- item one\n- item two\n\n"
                   "| Country | Growth |\n|---|---|\n| Norway | 5\\|6 |\n"), out
    make_docx(tmp_path / "untitled.docx", core_title=None)
    rc, out, _ = extract(tmp_path / "untitled.docx")
    assert rc == 0 and out.startswith("title: Annual Report\n")


def item(text, num, lvl=0):
    """A list paragraph of list `num` at level `lvl`."""
    return (f'<w:p><w:pPr><w:numPr><w:ilvl w:val="{lvl}"/><w:numId w:val="{num}"/></w:numPr>'
            f'</w:pPr><w:r><w:t>{text}</w:t></w:r></w:p>')


def write_list_docx(path, body, numbering):
    """A DOCX of paragraphs `body` and the w:numbering element's contents `numbering`."""
    doc = f'<?xml version="1.0"?><w:document {W}><w:body>{body}<w:sectPr/></w:body></w:document>'
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml", "<Types/>")
        z.writestr("word/document.xml", doc)
        z.writestr("word/numbering.xml",
                   f'<?xml version="1.0"?><w:numbering {W}>{numbering}</w:numbering>')


def test_docx_lists(tmp_path):
    """List paragraphs take their markers from word/numbering.xml: "1. " where their level is
    numbered (counted per list from its start, a deeper level restarting under each item),
    "- " where it is a bullet or the list is not defined, indented by level; numId 0 is no
    list."""
    body = (item("first", 1) + item("second", 1) + item("sub a", 1, 1) + item("sub b", 1, 1) +
            item("third", 1) + item("sub again", 1, 1) + item("dot", 2) + item("undefined", 9) +
            item("not a list", 0) + item("fifth", 3))
    numbering = ('<w:abstractNum w:abstractNumId="0">'
                 '<w:lvl w:ilvl="0"><w:start w:val="1"/><w:numFmt w:val="decimal"/></w:lvl>'
                 '<w:lvl w:ilvl="1"><w:start w:val="1"/><w:numFmt w:val="lowerLetter"/></w:lvl>'
                 '</w:abstractNum>'
                 '<w:abstractNum w:abstractNumId="1"><w:lvl w:ilvl="0"><w:numFmt w:val="bullet"/>'
                 '</w:lvl></w:abstractNum>'
                 '<w:abstractNum w:abstractNumId="2"><w:lvl w:ilvl="0"><w:start w:val="5"/>'
                 '<w:numFmt w:val="decimal"/></w:lvl></w:abstractNum>'
                 '<w:num w:numId="1"><w:abstractNumId w:val="0"/></w:num>'
                 '<w:num w:numId="2"><w:abstractNumId w:val="1"/></w:num>'
                 '<w:num w:numId="3"><w:abstractNumId w:val="2"/></w:num>')
    write_list_docx(tmp_path / "lists.docx", body, numbering)
    rc, out, err = extract(tmp_path / "lists.docx")
    assert rc == 0, err
    assert out == ("title: lists\n1. first\n2. second\n   1. sub a\n   2. sub b\n3. third\n"
                   "   1. sub again\n- dot\n- undefined\n\nnot a list\n\n5. fifth\n"), out


def test_docx_list_continuation(tmp_path):
    """Lists made from one abstract list share its count, as Word numbers them: a second list
    goes on where the first stopped; a w:lvlOverride's startOverride (or the w:start of its
    w:lvl) restarts the level at that list's first item there, and later items of either list
    go on from it; a w:lvl in the override may make the level a bullet."""
    plain = '<w:p><w:r><w:t>between</w:t></w:r></w:p>'
    body = (item("one", 1) + item("two", 1) + plain + item("three", 4) +
            item("restart", 5) + item("sub", 5, 1) + item("next", 5) + item("back in 1", 1) +
            item("ten", 6) + item("eleven", 6) + item("bulleted", 7) + item("sub 2", 1, 1))
    numbering = ('<w:abstractNum w:abstractNumId="0">'
                 '<w:lvl w:ilvl="0"><w:start w:val="1"/><w:numFmt w:val="decimal"/></w:lvl>'
                 '<w:lvl w:ilvl="1"><w:start w:val="1"/><w:numFmt w:val="decimal"/></w:lvl>'
                 '</w:abstractNum>'
                 '<w:num w:numId="1"><w:abstractNumId w:val="0"/></w:num>'
                 '<w:num w:numId="4"><w:abstractNumId w:val="0"/></w:num>'
                 '<w:num w:numId="5"><w:abstractNumId w:val="0"/>'
                 '<w:lvlOverride w:ilvl="0"><w:startOverride w:val="1"/></w:lvlOverride></w:num>'
                 '<w:num w:numId="6"><w:abstractNumId w:val="0"/><w:lvlOverride w:ilvl="0">'
                 '<w:lvl w:ilvl="0"><w:start w:val="10"/><w:numFmt w:val="decimal"/></w:lvl>'
                 '</w:lvlOverride></w:num>'
                 '<w:num w:numId="7"><w:abstractNumId w:val="0"/><w:lvlOverride w:ilvl="0">'
                 '<w:lvl w:ilvl="0"><w:numFmt w:val="bullet"/></w:lvl></w:lvlOverride></w:num>')
    write_list_docx(tmp_path / "cont.docx", body, numbering)
    rc, out, err = extract(tmp_path / "cont.docx")
    assert rc == 0, err
    assert out == ("title: cont\n1. one\n2. two\n\nbetween\n\n3. three\n1. restart\n   1. sub\n"
                   "2. next\n3. back in 1\n10. ten\n11. eleven\n- bulleted\n   1. sub 2\n"), out


def test_docx_bombs_and_damage(tmp_path):
    # 100 MiB of zeros in a ~100 kB archive: refused by its recorded size, never inflated
    with zipfile.ZipFile(tmp_path / "bomb.docx", "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("word/document.xml", "w", force_zip64=True) as f:
            for _ in range(100):
                f.write(b"\0" * (1 << 20))
    assert (tmp_path / "bomb.docx").stat().st_size < 1 << 20
    rc, out, err = extract(tmp_path / "bomb.docx")
    assert rc == 4 and out == "" and "unpacks to 100.0 MiB, over the 64 MiB" in err and "zip bomb" in err
    with zipfile.ZipFile(tmp_path / "ratio.docx", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("word/document.xml", "<w:document %s><w:body>%s</w:body></w:document>"
                   % (W, para("a" * (8 << 20))))
    rc, _, err = extract(tmp_path / "ratio.docx")
    assert rc == 4 and "over the 200 to 1 allowed" in err
    with zipfile.ZipFile(tmp_path / "other.docx", "w") as z:
        z.writestr("hello.txt", "hi")
    rc, _, err = extract(tmp_path / "other.docx")
    assert rc == 1 and "without word/document.xml: not a DOCX document" in err
    make_docx(tmp_path / "whole.docx")
    (tmp_path / "cut.docx").write_bytes((tmp_path / "whole.docx").read_bytes()[:500])
    rc, _, err = extract(tmp_path / "cut.docx")
    assert rc == 1 and "a damaged zip archive" in err
    (tmp_path / "text.docx").write_text("not a zip")
    rc, _, err = extract(tmp_path / "text.docx")
    assert rc == 1 and "named .docx, but it is not a zip archive" in err


def test_pdf(tmp_path):
    (tmp_path / "two.pdf").write_bytes(make_pdf(["Rivers of Europe\nThe Danube flows east.",
                                                 None, "# Third page about the Rhine."],
                                                title="Rivers Report"))
    rc, out, err = extract(tmp_path / "two.pdf")
    assert rc == 0, err
    assert out == ("title: Rivers Report\n<!-- page 1 -->\n\nRivers of Europe\nThe Danube flows "
                   "east.\n\n<!-- page 3 -->\n\n\\# Third page about the Rhine.\n"), out
    (tmp_path / "untitled.pdf").write_bytes(make_pdf(["Some text"]))
    rc, out, _ = extract(tmp_path / "untitled.pdf")
    assert rc == 0 and out.startswith("title: untitled\n<!-- page 1 -->")
    # content decides: a PDF named .txt, and a text file named .pdf
    (tmp_path / "report.txt").write_bytes(make_pdf(["Hidden PDF"]))
    rc, out, _ = extract(tmp_path / "report.txt")
    assert rc == 0 and "Hidden PDF" in out
    (tmp_path / "fake.pdf").write_text("plain words")
    rc, _, err = extract(tmp_path / "fake.pdf")
    assert rc == 1 and "does not start with %PDF-: not a PDF" in err


def test_pdf_outline_headings(tmp_path):
    """A PDF's outline gives its headings: an entry's line on its page (or the next) becomes a
    heading of the entry's depth, with or without the section number the entry leaves out; a
    contents line, a running head and an entry whose line is not there stay text."""
    pages = ["Contents\n1 Rivers . . . 1\n1 Rivers\nRivers flow to the sea.\n"
             "1.1 Danube & <Inn>\nThe Danube flows east.",
             "Chapter 1: Rivers\nStill the Danube.\n\u00dcber Fl\u00fcsse \u2014 Str\u00f6me\n"
             "Umlauts here.",
             "Appendix A Sources\nAtlases.\n2 Lakes\nNo lakes."]
    # the dash makes that entry's title UTF-16 in the file
    outline = [("Rivers", 0, [("Danube & <Inn>", 0, []), ("\u00dcber Fl\u00fcsse \u2014 Str\u00f6me", 1, []),
                              ("Not on its page", 1, [])]),
               ("A Sources", 1, []), ("2 Lakes", 2, [("Missing", 2, [])])]
    (tmp_path / "atlas.pdf").write_bytes(make_pdf(pages, title="Atlas", outline=outline))
    rc, out, err = extract(tmp_path / "atlas.pdf")
    assert rc == 0, err
    assert out == ("title: Atlas\n<!-- page 1 -->\n\nContents\n1 Rivers . . . 1\n\n# 1 Rivers\n\n"
                   "Rivers flow to the sea.\n\n## 1.1 Danube & <Inn>\n\nThe Danube flows east.\n\n"
                   "<!-- page 2 -->\n\nChapter 1: Rivers\nStill the Danube.\n\n## \u00dcber "
                   "Fl\u00fcsse \u2014 Str\u00f6me\n\nUmlauts here.\n\n<!-- page 3 -->\n\n# Appendix A Sources\n\n"
                   "Atlases.\n\n# 2 Lakes\n\nNo lakes.\n"), out
    # without an outline the same pages have no headings
    (tmp_path / "plain.pdf").write_bytes(make_pdf(pages))
    rc, out, _ = extract(tmp_path / "plain.pdf")
    assert rc == 0 and "\n#" not in out, out


def test_pdf_errors(tmp_path):
    good = make_pdf(["Secret text"])
    cases = {"scan.pdf": (make_pdf([None]), "no text layer: a scanned PDF? OCR it first"),
             "cut.pdf": (good[:len(good) // 2], "truncated: no %%EOF at its end"),
             "broken.pdf": (good[:120] + b"\n%%EOF\n", "damaged (pdftotext exit status 1")}
    for name, (data, why) in cases.items():
        (tmp_path / name).write_bytes(data)
        rc, out, err = extract(tmp_path / name)
        assert rc == 1 and out == "" and why in err, (name, err)
        assert "iconv" not in err
    (tmp_path / "plain.pdf").write_bytes(good)
    subprocess.run(["qpdf", "--encrypt", "user-pw", "owner-pw", "256", "--",
                    str(tmp_path / "plain.pdf"), str(tmp_path / "locked.pdf")], check=True)
    rc, out, err = extract(tmp_path / "locked.pdf")
    assert rc == 1 and out == "" and "encrypted: it needs a password" in err, err


def test_cpu_limit(tmp_path):
    """A page whose parse takes quadratic time is stopped by the processor-time limit."""
    (tmp_path / "deep.html").write_text("<div>" * 100000 + "deep")
    r = subprocess.run([str(EXTRACT), "--cpu", "1", str(tmp_path / "deep.html")],
                       capture_output=True, timeout=60)
    assert r.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and r.stdout == b"", r.returncode


def test_sandbox_of_a_pdf_child(tmp_path):
    """pdftotext runs under the helper's limits and seccomp filter: a stand-in found first on
    PATH reports what it may do, as its text: no file opened for writing, no socket, no core
    dumps, the filter installed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    probe = bin_dir / "pdftotext"
    probe.write_text(f"""#!{shutil.which('python3')}
import os, resource, socket, sys
def tried(f):
    try:
        f()
        return "allowed"
    except OSError as e:
        return "denied"
print("write", tried(lambda: open({str(tmp_path / 'written')!r}, "w")))
print("append", tried(lambda: open({str(tmp_path / 'ro')!r}, "a")))
print("socket", tried(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)))
print("unix", tried(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)))
print("read", tried(lambda: open({str(tmp_path / 'ro')!r}).read()))
print("core", resource.getrlimit(resource.RLIMIT_CORE)[1])
print("cpu", resource.getrlimit(resource.RLIMIT_CPU)[0])
status = open("/proc/self/status").read()
print("seccomp", [l.split()[1] for l in status.splitlines() if l.startswith("Seccomp:")][0])
print("\\f", end="")
""")
    probe.chmod(0o755)
    (tmp_path / "ro").write_text("x")
    (tmp_path / "doc.pdf").write_bytes(make_pdf(["x"]))
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    rc, out, err = extract(tmp_path / "doc.pdf", "--cpu", "7", env=env)
    assert rc == 0, err
    for want in ("write denied", "append denied", "socket denied", "unix denied", "read allowed",
                 "core 0", "cpu 7", "seccomp 2"):
        assert want in out, (want, out)
    assert not (tmp_path / "written").exists() and (tmp_path / "ro").read_text() == "x"


def docs_folder(d):
    d.mkdir()
    (d / "rivers.pdf").write_bytes(make_pdf(["Rivers of Europe\nThe Danube flows east.",
                                             "The Elbe reaches Hamburg."], title="Rivers Report"))
    (d / "page.html").write_text(HTML, encoding="utf-8")
    make_docx(d / "report.docx")
    good = make_pdf(["Lost words"])
    (d / "bad.pdf").write_bytes(good[:len(good) // 2])
    (d / "notes.txt").write_text("The Oder is a border river.\n")
    (d / "renamed.txt").write_bytes(make_pdf(["Fjords of Norway"], title="Fjords"))
    (d / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return d


def test_store_ingest_of_a_mixed_folder(tmp_path):
    d = docs_folder(tmp_path / "docs")
    data = tmp_path / "store"

    def store(*args):
        r = subprocess.run([str(STORE), "--data-dir", str(data), "-c", "mix", *args],
                           capture_output=True, text=True, timeout=120)
        return r.returncode, r.stdout, r.stderr
    rc, _, err = store("ingest", "--approx-tokens", str(d))
    assert rc == 0, err
    assert f"{d}/bad.pdf: a PDF: truncated: no %%EOF at its end" in err and "; skipped" in err
    assert "ingested 5 documents" in err and "skipped 2 files" in err and "iconv" not in err
    titles = {"docs/rivers.pdf": "Rivers Report", "docs/page.html": "The Rhine & its Valley",
              "docs/report.docx": "Report 2024", "docs/notes.txt": "notes",
              "docs/renamed.txt": "Fjords"}
    for doc_id, title in titles.items():
        rc, out, err = store("get", doc_id)
        assert rc == 0 and json.loads(out)["title"] == title, (doc_id, out, err)
    text = json.loads(store("get", "docs/rivers.pdf")[1])["text"]
    assert "<!-- page 2 -->\n\nThe Elbe reaches Hamburg." in text
    for word, doc_id in (("Danube", "docs/rivers.pdf"), ("Hamburg", "docs/rivers.pdf"),
                         ("Cologne", "docs/page.html"), ("Sweden", "docs/report.docx"),
                         ("Fjords", "docs/renamed.txt"), ("Oder", "docs/notes.txt")):
        rc, out, _ = store("search", "--json", word)
        hits = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert rc == 0 and doc_id in out, (word, out)
        assert hits or doc_id in out
    rc, out, _ = store("search", "SCRIPTTEXT")
    assert "docs/page.html" not in out
    rc, out, _ = store("get", "docs/bad.pdf")
    assert rc != 0
    # the bad file named: an error, nothing of it stored
    rc, _, err = store("ingest", "--approx-tokens", str(d / "bad.pdf"))
    assert rc == 1 and "bad.pdf: a PDF: truncated" in err


def test_helper_missing_or_crashing(tmp_path):
    """diffrag-store copied where no helper is beside it, with PATH without one: the file is
    named with what to install; a helper that crashes: the crash, named; the rest goes in."""
    d = docs_folder(tmp_path / "docs")
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(STORE, lone / "diffrag-store")
    env = dict(os.environ, PATH="/usr/bin:/bin")
    r = subprocess.run([str(lone / "diffrag-store"), "--data-dir", str(tmp_path / "s1"), "ingest",
                        "--approx-tokens", str(d)], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0 and "ingested 1 document " in r.stderr, r.stderr
    assert "rivers.pdf: a PDF: reading it needs diffrag-extract, which cannot be run" in r.stderr
    crash = lone / "diffrag-extract"
    crash.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crash.chmod(0o755)
    r = subprocess.run([str(lone / "diffrag-store"), "--data-dir", str(tmp_path / "s2"), "ingest",
                        "--approx-tokens", str(d)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ingested 1 document " in r.stderr, r.stderr
    assert "page.html: an HTML: diffrag-extract crashed on it (Segmentation fault)" in r.stderr


def test_cli_ask_d_extracts(tmp_path):
    """`diffrag ask -d` reads a file as the ingest does: a PDF, DOCX or HTML file (by its
    content, whatever its name) goes as its Markdown with its title, a text file as it is with
    none; a file that cannot be read is named with its reason (exit 6, a local error) and
    nothing is sent."""
    d = docs_folder(tmp_path / "docs")
    (d / "latin1.txt").write_bytes("Stra\xdfe".encode("latin-1"))
    (d / "empty.txt").write_bytes(b"")
    sent = []

    def handler(req):
        if req["op"] == "query":
            sent.append(req)
            return [GROUNDED]
        return pong(req)

    def ask(*files):
        args = [str(DIFFRAG), "-e", srv.endpoint, "ask"]
        for f in files:
            args += ["-d", str(d / f)]
        return subprocess.run(args + ["Where does the Elbe go?"], capture_output=True, text=True,
                              timeout=60)
    with FakeServer(handler) as srv:
        r = ask("rivers.pdf", "report.docx", "page.html", "notes.txt", "renamed.txt")
        assert r.returncode == 0, r.stderr
        docs = sent[-1]["docs"]
        assert [x["id"] for x in docs] == [str(d / f) for f in ("rivers.pdf", "report.docx",
                                           "page.html", "notes.txt", "renamed.txt")]
        assert [x.get("title") for x in docs] == ["Rivers Report", "Report 2024", "The Rhine & its Valley",
                                                  None, "Fjords"]
        assert docs[0]["text"].startswith("<!-- page 1 -->\n") and "The Elbe reaches Hamburg." in docs[0]["text"]
        assert docs[2]["text"].startswith("# Rhine river\n")
        assert docs[3]["text"] == "The Oder is a border river.\n"
        n = len(sent)
        for f, why in [("bad.pdf", "bad.pdf: a PDF: truncated"),
                       ("latin1.txt", "latin1.txt: not UTF-8 text (nor a PDF, DOCX or HTML file)"),
                       ("empty.txt", "empty.txt: empty")]:
            r = ask("notes.txt", f)
            assert r.returncode == 6 and why in r.stderr and r.stdout == "", (f, r.stderr)
        assert len(sent) == n


def test_cli_ingest_extracts(tmp_path):
    """`diffrag ingest` shares the reader: the documents it sends carry the Markdown and titles;
    the bad file is named with its reason and counted in the summary."""
    d = docs_folder(tmp_path / "docs")
    sent = []

    def handler(req):
        if req["op"] == "ingest":
            sent.extend(req["docs"])
            return [{"ok": True, "collection": req["collection"], "ingested": len(req["docs"]),
                     "bytes": 1, "docs": len(sent), "chunks": len(sent)}]
        return pong(req)
    with FakeServer(handler) as srv:
        r = subprocess.run([str(DIFFRAG), "-e", srv.endpoint, "ingest", "-c", "mix", str(d)],
                           capture_output=True, text=True, timeout=60)
        empty = tmp_path / "empty"
        empty.mkdir()
        r2 = subprocess.run([str(DIFFRAG), "-e", srv.endpoint, "ingest", str(empty)],
                            capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    by_id = {doc["id"]: doc for doc in sent}
    assert sorted(by_id) == ["docs/notes.txt", "docs/page.html", "docs/renamed.txt",
                             "docs/report.docx", "docs/rivers.pdf"]
    assert by_id["docs/report.docx"]["title"] == "Report 2024"
    assert by_id["docs/page.html"]["text"].startswith("# Rhine river\n")
    assert "bad.pdf: a PDF: truncated" in r.stderr and "iconv" not in r.stderr
    assert "skipped 2 files (1 not .txt, .md, .jsonl, .pdf, .docx or .html; 1 for other reasons" in r.stdout
    assert r2.returncode == 2 and "no .txt, .md, .jsonl, .pdf, .docx or .html files found" in r2.stderr
