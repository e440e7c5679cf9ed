#!/usr/bin/env python3
"""The house rules a tree keeps, besides the layers (tools/check-layers.py):
- no C or CUDA file outside tests/ is over 900 lines (a file past that holds two concerns);
- nothing in the repository reads outside it: no path into a `shared` folder beside the
  checkout (a dot-dot path to it, or the checkout's parent joined with it in Python); the data
  the tests, tools and benchmarks use ships in the repository (tests/data/);
- one context planner (retriever/planner.c) owns what goes into a prompt: outside retriever/,
  only tests and benchmarks call the layout (ctx_assemble) directly; the daemon asks the planner.

Usage: check-house.py [ROOT]. Prints one line a breach, `FILE: what`, and exits 1 on any
breach, 0 on none (printing nothing)."""
import os
import re
import sys

MAX_LINES = 900
SKIP_DIRS = {".git", "build", ".venv", "models", "var", "__pycache__", ".pytest_cache"}
TEXT_SUFFIXES = {".c", ".h", ".cu", ".cuh", ".py", ".sh", ".mk", ".md", ".txt", ".json", ".toml",
                 ".cfg", ".conf", ".service", ".yml", ".yaml", ".in", ".pc"}
TEXT_NAMES = {"Makefile", "run"}
# a path one level above the checkout into its `shared` neighbour, as code or a shell would write it
OUTSIDE = re.compile(r"\.\./shared\b|parent\s*/\s*[\"']shared[\"']")
LAYOUT_CALL = re.compile(r"\bctx_assemble\s*\(")
LAYOUT_CALLERS = ("retriever", "tests", "bench")


def files(root):
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        for n in sorted(names):
            yield os.path.join(d, n)


def check(root):
    breaches = []
    for path in files(root):
        rel = os.path.relpath(path, root)
        name = os.path.basename(path)
        suffix = os.path.splitext(name)[1]
        if not (suffix in TEXT_SUFFIXES or name in TEXT_NAMES) or os.path.islink(path):
            continue
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as e:
            breaches.append("%s: unreadable (%s)" % (rel, e.strerror))
            continue
        if suffix in (".c", ".cu") and not rel.startswith("tests" + os.sep):
            n = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
            if n > MAX_LINES:
                breaches.append("%s: %d lines, over %d: split it by concern" % (rel, n, MAX_LINES))
        if suffix == ".c" and rel.split(os.sep)[0] not in LAYOUT_CALLERS and LAYOUT_CALL.search(text):
            breaches.append("%s: calls ctx_assemble: ask the context planner (retriever/planner.h)"
                            % rel)
        if rel == os.path.join("tools", "check-house.py"):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                breaches.append("%s:%d: reads outside the repository (%s)" % (rel, i, line.strip()[:80]))
    return breaches


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    breaches = check(os.path.abspath(root))
    for b in breaches:
        print(b)
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main())
