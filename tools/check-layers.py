#!/usr/bin/env python3
"""Checks the layering rule of docs/architecture.md over every `#include "..."` of the sources:
a file may include its own layer and the layers below it, never one above.

    text (0) < kernels (1) < model (2) < retriever, daemon (3) < clients (4) < tools (5)

retriever and daemon share a level, but only daemon may include retriever; clients/ speaks only
the wire protocol and may include nothing but clients/ and text/. An include that names a file
that does not exist (relative to the including file's folder or to the root, as the compiler's
-I. finds it) is reported as well. Exit status 1 and one line per fault,
"FILE:LINE: ..." naming both layers; 0 and nothing on stdout when the tree is clean.

Usage: python3 tools/check-layers.py [ROOT]   (ROOT: the repository, by default this one)
"""
import pathlib
import re
import sys

LEVEL = {"text": 0, "kernels": 1, "model": 2, "retriever": 3, "daemon": 3, "clients": 4,
         "tools": 5}
# Beyond the levels: which layers a layer may include at all (None: any at or below its level).
ALLOWED = {"retriever": {"text", "kernels", "model", "retriever"},
           "clients": {"text", "clients"}}
SUFFIXES = {".c", ".h", ".cu", ".cuh"}
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def layer_of(rel):
    """The layer a repository-relative path belongs to, or None outside the layered folders."""
    top = rel.parts[0] if len(rel.parts) > 1 else None
    return top if top in LEVEL else None


def may_include(src, dst):
    if src in ALLOWED:
        return dst in ALLOWED[src]
    return LEVEL[dst] <= LEVEL[src]


def check(root):
    root = pathlib.Path(root).resolve()
    faults = []
    for folder in LEVEL:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file():
                continue
            rel = path.relative_to(root)
            src = layer_of(rel)
            try:
                lines = path.read_text(errors="replace").splitlines()
            except OSError as e:
                faults.append(f"{rel}: cannot read: {e}")
                continue
            for no, line in enumerate(lines, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                name = m.group(1)
                beside = path.parent / name
                if beside.is_file():
                    target = beside.resolve()
                elif (root / name).is_file():
                    target = (root / name).resolve()
                else:
                    faults.append(f'{rel}:{no}: includes "{name}", which does not exist')
                    continue
                try:
                    dst = layer_of(target.relative_to(root))
                except ValueError:
                    dst = None
                if dst is None:
                    faults.append(f'{rel}:{no}: {src} (layer {LEVEL[src]}) includes "{name}", '
                                  f"which is in no layer")
                elif not may_include(src, dst):
                    faults.append(f'{rel}:{no}: {src} (layer {LEVEL[src]}) includes "{name}" '
                                  f"of {dst} (layer {LEVEL[dst]})")
    return faults


def main():
    if len(sys.argv) > 2 or sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return 0 if len(sys.argv) == 2 else 2
    root = sys.argv[1] if len(sys.argv) == 2 else pathlib.Path(__file__).resolve().parent.parent
    faults = check(root)
    for f in faults:
        print(f)
    if faults:
        print(f"check-layers: {len(faults)} fault(s)", file=sys.stderr)
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
