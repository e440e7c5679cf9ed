#!/usr/bin/env python3
"""`make bench-extract`: diffrag-extract's throughput and peak memory per format and size.

For each format, files of a few sizes are generated here (the same writers as
tests/test_extract.py): HTML pages of many sections, each a heading, paragraphs with inline
markup, a list and a table; DOCX files of as many sections (headings by style, paragraphs of
several runs, numbered items, a table) zipped with deflate; PDFs of many pages of Helvetica text
lines, written by hand (pdftotext does the reading). Each file is extracted --reps times by
build/diffrag-extract (a fresh process each run, its output to a file), and the table gives the
median wall time, the input's MB/s (MB = 10^6 bytes of the file) and the output's size, and the
peak resident memory of the run (ru_maxrss of the process, which counts its waited-for
children: pdftotext for a PDF; through GNU time, /usr/bin/time), the largest over the runs.
A DOCX is sized by its unpacked XML (the file is deflated about 50:1): its MB/s are given of
the file and of the XML.

  bench/bench_extract.py                    sizes 0.1, 1 and 8 MB (a DOCX's XML), 5 runs each
  bench/bench_extract.py --sizes 0.1 --reps 3
"""
import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile

TIME = "/usr/bin/time"

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_extract import W, make_pdf, para  # noqa: E402

WORDS = ("the river flows north through the valley past old towns and vineyards while barges "
         "carry coal grain and containers between the ports of the delta and the cities "
         "upstream").split()


def sentence(i, n=14):
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(n)).capitalize() + "."


def html_file(target):
    """An HTML page of about target bytes: sections of a heading, paragraphs with inline
    markup, a list and a table."""
    parts = ["<!DOCTYPE html>\n<html><head><title>Benchmark page</title>"
             "<style>p{margin:0}</style></head><body><h1>Benchmark page</h1>\n"]
    size, s = len(parts[0]), 0
    while size < target:
        sec = ["<h2>Section %d</h2>\n" % s]
        for p in range(4):
            sec.append("<p>%s <b>%s</b> %s <a href=\"#s%d\">see %d</a>.</p>\n" % (
                sentence(s + p), sentence(s + p + 1, 4), sentence(s + p + 2), s, s))
        sec.append("<ul>" + "".join("<li>%s</li>" % sentence(s + k, 6) for k in range(3)) +
                   "</ul>\n<table><tr><th>Port</th><th>Tonnes</th></tr>" +
                   "".join("<tr><td>Port %d</td><td>%d</td></tr>" % (k, 1000 + s * k)
                           for k in range(4)) + "</table>\n")
        chunk = "".join(sec)
        parts.append(chunk)
        size += len(chunk)
        s += 1
    parts.append("</body></html>\n")
    return "".join(parts).encode()


def docx_file(path, target):
    """A DOCX whose word/document.xml is about target bytes: sections of a Heading1
    paragraph, paragraphs of three runs, numbered items and a table."""
    cell = lambda t: "<w:tc>%s</w:tc>" % para(t)  # noqa: E731
    body, size, s = [], 0, 0
    while size < target:
        sec = [para("Section %d" % s, "Heading1")]
        for p in range(4):
            sec.append('<w:p><w:r><w:t xml:space="preserve">%s </w:t></w:r><w:r><w:rPr><w:b/>'
                       '</w:rPr><w:t xml:space="preserve">%s </w:t></w:r><w:r><w:t>%s</w:t>'
                       '</w:r></w:p>' % (sentence(s + p), sentence(s + p + 1, 4),
                                         sentence(s + p + 2)))
        sec += [para(sentence(s + k, 6), numbered=True) for k in range(3)]
        sec.append("<w:tbl>" + "".join("<w:tr>%s%s</w:tr>" % (cell("Port %d" % k),
                                                              cell(str(1000 + s * k)))
                                       for k in range(4)) + "</w:tbl>")
        chunk = "".join(sec)
        body.append(chunk)
        size += len(chunk)
        s += 1
    doc = ('<?xml version="1.0" encoding="UTF-8" standalone="yes"?><w:document %s><w:body>%s'
           '<w:sectPr/></w:body></w:document>' % (W, "".join(body)))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml", "<Types/>")
        z.writestr("word/document.xml", doc)


def pdf_file(target):
    """A PDF of about target bytes: pages of 45 lines of Helvetica text each."""
    page = "\n".join(sentence(i, 12) for i in range(45))
    one = len(make_pdf([page, page])) - len(make_pdf([page]))
    return make_pdf([page] * max(1, round(target / one)), title="Benchmark")


def run_once(extract, path, out, rss_file):
    """(wall seconds, peak RSS in KiB, output bytes) of one extraction in a fresh process,
    started by /usr/bin/time: its -f %M is the process's ru_maxrss (with its waited-for
    children), and a process forked from this Python would report Python's own pages."""
    with open(out, "wb") as f:
        t0 = time.perf_counter()
        p = subprocess.run([TIME, "-f", "%M", "-o", str(rss_file), str(extract), str(path)],
                           stdout=f, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit("bench-extract: %s exited %d on %s" % (extract, p.returncode, path))
    return wall, int(rss_file.read_text().split()[-1]), os.path.getsize(out)


def unpacked(path):
    """The bytes the extraction parses: a DOCX's entries unpacked, another file's size."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            return sum(i.file_size for i in z.infolist())
    return path.stat().st_size


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=str(ROOT / os.environ.get("BUILD", "build")))
    ap.add_argument("--sizes", default="0.1,1,8", help="file sizes in MB, comma-separated")
    ap.add_argument("--formats", default="html,docx,pdf")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    extract = pathlib.Path(args.build) / "diffrag-extract"
    if not os.access(TIME, os.X_OK):
        raise SystemExit("bench-extract: %s missing (Debian's package time)" % TIME)
    if not extract.exists():
        raise SystemExit("bench-extract: %s missing: run `make all`" % extract)
    sizes = [float(x) for x in args.sizes.split(",")]
    print("diffrag-extract (%s), median of %d runs; peak RSS the largest of the runs"
          % (extract, args.reps))
    print()
    print("| format | file | input MB | unpacked MB | output MB | median s | MB/s | unpacked MB/s"
          " | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        tmp = pathlib.Path(tmp)
        for fmt in args.formats.split(","):
            for mb in sizes:
                target = int(mb * 1e6)
                path = tmp / ("in-%s.%s" % (mb, fmt))
                if fmt == "html":
                    path.write_bytes(html_file(target))
                    what = "sections of h2, 4 p, ul, table"
                elif fmt == "docx":
                    docx_file(path, target)
                    what = "sections of Heading1, 4 p, 3 items, table"
                elif fmt == "pdf":
                    path.write_bytes(pdf_file(target))
                    what = "pages of 45 text lines"
                else:
                    raise SystemExit("bench-extract: unknown format %r" % fmt)
                runs = [run_once(extract, path, tmp / "out.md", tmp / "rss")
                        for _ in range(args.reps)]
                size, big = path.stat().st_size, unpacked(path)
                wall = statistics.median(r[0] for r in runs)
                print("| %s | %s | %.3f | %.2f | %.2f | %.3f | %.1f | %.1f | %.1f |" % (
                    fmt, what, size / 1e6, big / 1e6, runs[0][2] / 1e6, wall, size / 1e6 / wall,
                    big / 1e6 / wall, max(r[1] for r in runs) / 1024), flush=True)


if __name__ == "__main__":
    main()
