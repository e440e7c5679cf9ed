#!/bin/sh
# Installs every Debian package diffrag's build, `make run` and tests need. Idempotent: packages
# already present are left alone, and apt-get runs only when something is missing. The Python
# packages the tests import go into the project's virtual environment (tools/make-venv.sh,
# `make venv`), never into the system's python3.
set -eu
cd "$(dirname "$0")/.."

DEBS="build-essential pkg-config libopenblas-dev liblmdb-dev libstemmer-dev libsqlite3-dev
      libzmq3-dev libmsgpack-dev libmicrohttpd-dev libsystemd-dev libjansson-dev libssl-dev prometheus systemd
      libgumbo-dev libzip-dev libxml2-dev libseccomp-dev poppler-utils qpdf time
      clang libclang-rt-14-dev valgrind curl openssl python3 python3-pip python3-venv"

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

echo "install-deps: ok"
