#!/bin/sh
# Makes the project's Python virtual environment (default .venv, git-ignored) from the python3
# on PATH and installs the pinned packages of tests/requirements.txt into it: what the tests,
# tools, benchmarks and the Python client examples import. Debian's own python3 refuses
# `pip install` outside a virtual environment (PEP 668); `make run` needs none of this.
# Idempotent: pip runs only when a pinned requirement is not installed at its version.
set -eu
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
if [ ! -x "$VENV/bin/python3" ] || ! "$VENV/bin/python3" -m pip --version >/dev/null 2>&1; then
    if ! python3 -m venv --clear "$VENV"; then
        echo "make-venv: python3 -m venv failed; on Debian install python3-venv (make deps does)" >&2
        exit 1
    fi
fi
if ! "$VENV/bin/python3" tools/check-requirements.py tests/requirements.txt >/dev/null; then
    "$VENV/bin/python3" -m pip install -q --disable-pip-version-check -r tests/requirements.txt
fi
cp tests/requirements.txt "$VENV/.requirements"
echo "make-venv: $VENV ready"
