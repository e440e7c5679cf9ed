#!/usr/bin/env python3
"""Questions over this project's own docs/ (the collection `make run` stores), retrieval and
answers, through a build's diffrag-store and diffragd.

The questions (tests/data/docs-questions.jsonl) were written by hand from reading docs/: each
has one or more acceptable short answers and the sections that answer it (a file and the
heading path the store reports, ` › ` between titles, the document's own title left out: the
`cancel` section of docs/protocol.md is `` `cancel` ``; "" is the text under the title before
the first subheading).

Retrieval: docs/ is ingested into a temporary store with the build's `diffrag-store`, its
chunks counted in the default model's tokens (as `make run` does), and each question searched
(`diffrag-store search --json -k 5`). A hit is the right section when it is in the section's
document and its byte range overlaps the section's (the heading line up to the next heading of
the same or a higher level, so subsections count with their parent) by at least half of the hit
or at least half of the section: a chunk that mostly lies in the section, or that holds most of
a section too short to fill a chunk. The rule reads only byte ranges, so it judges builds whose
chunks carry no heading path (before the heading-aware chunker) the same way as the others.
recall@1 and recall@5: the share of questions with a right hit first, or among the first 5.

Answers: the build's diffragd on loopback serves the default model over that store, and each
question is asked of the collection at the daemon's defaults (prompt budget, max_tokens,
greedy). An answer is right when, normalised like SQuAD's (lower case, no punctuation, no
articles), it holds a normalised expected answer as whole words. The grounding flag rate is
reported among right and among wrong answers.

  tools/eval-docs.py                       this build (build/), retrieval and answers
  tools/eval-docs.py --no-answers          retrieval only (seconds)
  tools/eval-docs.py --build /tmp/old/build --label before --json before.jsonl
"""
import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import eval_common as ec  # noqa: E402

ROOT = ec.ROOT
QUESTIONS = ROOT / "tests" / "data" / "docs-questions.jsonl"
COLLECTION = "docs"
K = 5
SEP = " \u203a "  # " › " between the titles of a heading path

_HEADING = re.compile(rb"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*$")
_FENCE = re.compile(rb"^ {0,3}(`{3,}|~{3,})")


def _title(raw):
    """A heading's title: without a closing run of #s and the spaces around it."""
    t = re.sub(rb"[ \t]+#+$", b"", raw)
    if re.fullmatch(rb"#+", t):
        t = b""
    return t.strip().decode("utf-8")


def sections(data):
    """{heading path: (byte start, byte end)} of a Markdown text (bytes), by the chunker's rules
    (docs/retriever.md, "Markdown structure" and "Heading paths"): ATX headings outside fenced
    code; a section runs from its heading line to the next heading of the same or a higher
    level; the path leaves out the outermost title when it is the document's (its first `#`
    heading), and "" is the text under that title before the next heading."""
    heads = []  # (level, title, line start)
    fence = None
    pos = 0
    for line in data.split(b"\n"):
        start, pos = pos, pos + len(line) + 1
        line = line.rstrip(b"\r")
        m = _FENCE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                    and not line[m.end():].strip():
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        m = _HEADING.match(line)
        if m:
            heads.append((len(m.group(1)), _title(m.group(2)), start))
    doc_title = next((t for lvl, t, _ in heads if lvl == 1), None)
    out = {}
    stack = []
    for i, (lvl, title, start) in enumerate(heads):
        while stack and stack[-1][0] >= lvl:
            stack.pop()
        stack.append((lvl, title))
        titles = [t for _, t in stack]
        if stack[0][0] == 1 and stack[0][1] == doc_title:
            titles = titles[1:]
        end = next((s for lv, _, s in heads[i + 1:] if lv <= lvl), len(data))
        if not titles:  # the document's title: its own text, up to the next heading
            end = heads[i + 1][2] if i + 1 < len(heads) else len(data)
        out.setdefault(SEP.join(titles), (start, end))
    if "" not in out:
        out[""] = (0, heads[0][2] if heads else len(data))
    return out


def load_questions(path=QUESTIONS):
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def check_questions(questions, root=ROOT):
    """The problems of a question file against the docs it is about: missing fields, duplicate
    ids, expected sections that the docs no longer have, and questions none of whose expected
    answers appears in one of their sections' text (normalised, as a substring). [] when
    sound."""
    problems, ids, cache = [], set(), {}
    for q in questions:
        qid = q.get("id")
        if not qid or qid in ids:
            problems.append("missing or duplicate id %r" % qid)
        ids.add(qid)
        if not q.get("question") or not q.get("answers") or not q.get("sections"):
            problems.append("%s: question, answers and sections are required" % qid)
            continue
        texts = []
        for s in q["sections"]:
            doc = s["doc"]
            if doc not in cache:
                p = root / doc
                cache[doc] = (p.read_bytes(), sections(p.read_bytes())) if p.exists() else None
            if cache[doc] is None:
                problems.append("%s: no file %s" % (qid, doc))
                continue
            data, secs = cache[doc]
            if s["heading"] not in secs:
                problems.append("%s: %s has no section %r" % (qid, doc, s["heading"]))
                continue
            a, b = secs[s["heading"]]
            texts.append(data[a:b].decode("utf-8"))
        if texts and not any(ec.normalise(c) and ec.normalise(c) in ec.normalise(t)
                             for t in texts for c in q["answers"]):
            problems.append("%s: no expected answer in its sections' text" % qid)
    return problems


def section_ranges(questions, root=ROOT):
    """{question id: [(doc, start, end)]}; the questions must have passed check_questions."""
    cache, out = {}, {}
    for q in questions:
        rs = []
        for s in q["sections"]:
            if s["doc"] not in cache:
                cache[s["doc"]] = sections((root / s["doc"]).read_bytes())
            rs.append((s["doc"],) + cache[s["doc"]][s["heading"]])
        out[q["id"]] = rs
    return out


def right_hit(hit, ranges):
    """Whether a search hit is one of the expected sections (the module's rule)."""
    for doc, start, end in ranges:
        if hit["doc_id"] != doc:
            continue
        hs, he = hit["byte_start"], hit["byte_end"]
        overlap = min(he, end) - max(hs, start)
        if overlap > 0 and (2 * overlap >= he - hs or 2 * overlap >= end - start):
            return True
    return False


def ingest(build, store, model, docs):
    r = subprocess.run([str(build / "diffrag-store"), "--data-dir", str(store), "--model",
                        str(model), "-c", COLLECTION, "ingest", str(docs)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise ec.EvalError("ingest failed (%d): %s" % (r.returncode, r.stderr[-2000:]))
    return r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""


def search(build, store, question, k=K):
    r = subprocess.run([str(build / "diffrag-store"), "--data-dir", str(store), "-c",
                        COLLECTION, "search", "--json", "-k", str(k), question],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise ec.EvalError("search failed (%d): %s" % (r.returncode, r.stderr[-2000:]))
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def retrieval(build, store, questions, ranges):
    """Per question: the rank (1..K) of the first right hit or None, and the hits' labels."""
    rows = {}
    for q in questions:
        hits = search(build, store, q["question"])
        rank = next((i + 1 for i, h in enumerate(hits) if right_hit(h, ranges[q["id"]])), None)
        rows[q["id"]] = {"rank": rank, "hits": [
            {"doc_id": h["doc_id"], "heading": h.get("heading"), "chunk": h.get("chunk"),
             "bytes": [h["byte_start"], h["byte_end"]], "score": h.get("score")}
            for h in hits]}
    return rows


def answers(workdir, store, model, questions, timeout, log):
    """Per question: the answer, whether it is right, its grounding flag and finish reason."""
    out = {}
    with ec.LocalDaemon(workdir, model, data_dir=store) as d, \
            ec.Asker(d.endpoint, d.proc) as asker:
        for i, q in enumerate(questions):
            t0 = time.time()
            r = asker.ask({"v": 1, "op": "query", "id": q["id"], "collection": COLLECTION,
                           "question": q["question"]}, timeout)
            if not r.get("ok"):
                raise ec.EvalError("%s: %s" % (q["id"], r))
            g = r.get("grounding") or {}
            right = ec.contains(r["answer"], q["answers"])
            out[q["id"]] = {"answer": r["answer"], "right": right, "flagged": g.get("flagged"),
                            "finish_reason": r.get("finish_reason"),
                            "cited": [c.get("doc_id") for c in r.get("citations", [])],
                            "seconds": round(time.time() - t0, 2)}
            log("[%d/%d] %s %s (%.1f s): %s" % (i + 1, len(questions), q["id"],
                                                "right" if right else "wrong", time.time() - t0,
                                                r["answer"][:100].replace("\n", " ")))
    return out


def rate(n, d):
    return "%d / %d" % (n, d) if d else "–"


def summary(label, questions, ret, ans):
    n = len(questions)
    s = {"label": label, "questions": n,
         "recall_at_1": sum(1 for q in questions if ret[q["id"]]["rank"] == 1) / n,
         "recall_at_5": sum(1 for q in questions if ret[q["id"]]["rank"] is not None) / n}
    if ans is not None:
        right = [a for a in ans.values() if a["right"]]
        wrong = [a for a in ans.values() if not a["right"]]
        s.update({"right": len(right),
                  "flagged_right": sum(1 for a in right if a["flagged"]),
                  "flagged_wrong": sum(1 for a in wrong if a["flagged"]),
                  "wrong": len(wrong),
                  "cancel_right": ans.get("cancel", {}).get("right")})
    return s


def table(s):
    head = "| build | questions | recall@1 | recall@5 |"
    rule = "|---|---|---|---|"
    row = "| %s | %d | %.2f | %.2f |" % (s["label"], s["questions"], s["recall_at_1"],
                                         s["recall_at_5"])
    if "right" in s:
        head += " answers right | flagged among right | flagged among wrong | cancel right |"
        rule += "---|---|---|---|"
        row += " %s | %s | %s | %s |" % (
            rate(s["right"], s["questions"]), rate(s["flagged_right"], s["right"]),
            rate(s["flagged_wrong"], s["wrong"]),
            {True: "yes", False: "no", None: "–"}[s["cancel_right"]])
    return "\n".join([head, rule, row])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=str(ec.build_dir()),
                    help="the build directory whose diffrag-store and diffragd run (default: "
                    "$BUILD or build/)")
    ap.add_argument("--label", default="this build", help="the build's name in the table")
    ap.add_argument("--questions", default=str(QUESTIONS))
    ap.add_argument("--docs", default=str(ROOT / "docs"), help="the folder ingested")
    ap.add_argument("--model", default=str(ec.QWEN_MODEL),
                    help="counts the chunks' tokens and answers (default: the default model)")
    ap.add_argument("--no-answers", action="store_true", help="retrieval only")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per answer")
    ap.add_argument("--json", help="write one line per question here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    build = pathlib.Path(args.build).resolve()
    # LocalDaemon runs diffragd from $BUILD
    os.environ["BUILD"] = str(build)

    def log(msg):
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    questions = load_questions(args.questions)
    problems = check_questions(questions)
    if problems:
        raise SystemExit("eval-docs: the question file does not fit docs/:\n  " +
                         "\n  ".join(problems))
    ranges = section_ranges(questions)
    with tempfile.TemporaryDirectory(prefix="eval-docs-") as tmp:
        store = pathlib.Path(tmp) / "store"
        log(ingest(build, store, args.model, args.docs))
        ret = retrieval(build, store, questions, ranges)
        ans = None if args.no_answers else answers(pathlib.Path(tmp), store, args.model,
                                                   questions, args.timeout, log)
    s = summary(args.label, questions, ret, ans)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            for q in questions:
                row = {"id": q["id"], "question": q["question"], "label": args.label,
                       "rank": ret[q["id"]]["rank"], "hits": ret[q["id"]]["hits"]}
                if ans is not None:
                    row.update(ans[q["id"]])
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    for q in questions:
        if ret[q["id"]]["rank"] is None:
            log("not in the first %d: %s %r" % (K, q["id"], q["question"]))
    print(table(s))
    print()
    print("summary: " + json.dumps(s))


if __name__ == "__main__":
    # a SIGTERM stops the daemon and removes the temporary store on the way out
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    try:
        main()
    except ec.EvalError as e:
        raise SystemExit("eval-docs: %s" % e)
