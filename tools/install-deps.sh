#!/bin/sh
# Installs every Debian and PyPI package diffrag's build and tests need. Idempotent: packages
# already present are left alone, and apt-get runs only when something is missing.
set -eu
cd "$(dirname "$0")/.."

DEBS="build-essential pkg-config libopenblas-dev liblmdb-dev libstemmer-dev libsqlite3-dev
      libzmq3-dev libmsgpack-dev libmicrohttpd-dev libsystemd-dev prometheus systemd
      clang libclang-rt-14-dev valgrind curl"

missing=""
for p in $DEBS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "install-deps: installing Debian packages:$missing"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
fi

PY="${PYTHON:-python3}"
if ! "$PY" -c "import sys; sys.exit(0)" 2>/dev/null; then
    echo "install-deps: $PY not found" >&2
    exit 1
fi
# Install only when a pinned requirement is not satisfied (pip check is slow; compare versions).
if ! "$PY" tools/check-requirements.py tests/requirements.txt; then
    "$PY" -m pip install -q --disable-pip-version-check -r tests/requirements.txt
fi
echo "install-deps: ok"
