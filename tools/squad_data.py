"""SQuAD 2.0 (dev, CC BY-SA 4.0) as the repository keeps it: gzip-compressed in tests/data/squad2/
(its README says what it is and its licences), unpacked on first use into build/data/squad2/ for
the readers that want plain files: the C unit tests and benchmarks, and every Python reader.

`python3 tools/squad_data.py` unpacks and prints the folder (the Makefile's bench targets use it);
importers call squad_dir()."""
import gzip
import os
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKED = ROOT / "tests" / "data" / "squad2"
UNPACKED = ROOT / "build" / "data" / "squad2"
FILES = ("passages.jsonl", "questions.jsonl")


def squad_dir():
    """The folder that holds passages.jsonl and questions.jsonl, unpacked from the repository's
    copies when missing or older than them. Raises FileNotFoundError, naming the file, when the
    repository's copy is missing."""
    for name in FILES:
        src = PACKED / (name + ".gz")
        dst = UNPACKED / name
        if not src.exists():
            raise FileNotFoundError("%s missing: the SQuAD 2.0 data ships with the repository "
                                    "(git checkout -- tests/data/squad2)" % src)
        if dst.exists() and dst.stat().st_mtime >= src.stat().st_mtime:
            continue
        UNPACKED.mkdir(parents=True, exist_ok=True)
        # unpacked beside its name and renamed, so a concurrent reader never sees half a file
        tmp = dst.with_name("%s.%d.tmp" % (name, os.getpid()))
        with gzip.open(src, "rb") as i, open(tmp, "wb") as o:
            shutil.copyfileobj(i, o)
        os.replace(tmp, dst)
    return UNPACKED


if __name__ == "__main__":
    try:
        print(squad_dir())
    except (OSError, EOFError) as e:
        sys.exit("squad_data: %s" % e)
