#!/usr/bin/env python3
"""Exit 0 when every `name==version` line of a requirements file is installed at that version."""
import sys
from importlib import metadata

ok = True
for line in open(sys.argv[1], encoding="utf-8"):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, _, version = line.partition("==")
    try:
        have = metadata.version(name.strip())
    except metadata.PackageNotFoundError:
        have = None
    if have != version.strip():
        print(f"requirement {line}: installed {have}")
        ok = False
sys.exit(0 if ok else 1)
