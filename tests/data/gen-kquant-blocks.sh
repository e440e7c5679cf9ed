#!/bin/sh
# Regenerates tests/data/kquant-*.blocks and kquant-*.f32: K-quant blocks made by ggml's own
# quantize_row_q*_K_ref and ggml's dequantize_row_q*_K of them (gen_kquant_blocks.c), from the
# llama.cpp that bench/build-llama-bench.sh builds (default build/llama.cpp). The tests only
# read the recorded files; this is how they were made:
#   sh bench/build-llama-bench.sh && sh tests/data/gen-kquant-blocks.sh [LLAMA_BUILD_DIR]
set -eu
LLAMA=${1:-build/llama.cpp}
LIB="$LLAMA/cmake/ggml/src"
[ -f "$LIB/libggml-base.a" ] || { echo "gen-kquant-blocks: $LIB/libggml-base.a not found (run bench/build-llama-bench.sh)" >&2; exit 1; }
DIR=$(dirname "$0")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
${CC:-cc} -std=c11 -O2 -Wall -Wextra -Werror "$DIR/gen_kquant_blocks.c" -o "$TMP/gen" \
    "$LIB/libggml-base.a" -lstdc++ -lgomp -lm -lpthread
"$TMP/gen" "$DIR"
echo "gen-kquant-blocks: wrote $(ls "$DIR"/kquant-*.blocks | wc -l) block files and their ggml values under $DIR"
