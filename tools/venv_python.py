"""The tools that import the project's pinned Python packages (numpy, gguf) run under the
project's virtual environment whichever python3 starts them: one started by a python3 that
lacks a package re-runs itself under .venv/bin/python3 (made by `make venv`, or by `make test`),
or says in one line what to run first."""
import importlib.util
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv" / "bin" / "python3"


def use_project_venv(*modules):
    """Returns when every module can be imported; else re-executes the running tool under
    .venv/bin/python3 with the same arguments, or exits with status 2 and a one-line message
    when there is none (or it lacks them too)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    prog = os.path.basename(sys.argv[0]) or "tool"
    if VENV_PYTHON.exists() and os.environ.get("DIFFRAG_VENV_TRIED") != "1":
        os.environ["DIFFRAG_VENV_TRIED"] = "1"
        os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), os.path.abspath(sys.argv[0]), *sys.argv[1:]])
    sys.stderr.write("%s: needs the Python package%s %s: run `make venv` first (the tool then "
                     "uses .venv by itself)\n" % (prog, "s" if len(missing) > 1 else "",
                                                    ", ".join(missing)))
    sys.exit(2)
