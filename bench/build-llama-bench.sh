#!/bin/sh
# Builds llama.cpp's llama-bench (for `make bench-llamacpp`) and llama-server (for
# `make bench-serving`) from the llama.cpp sources that the PyPI sdist of llama-cpp-python
# vendors (the only registry that carries them), into $1 (default build/llama.cpp). CPU only, no
# BLAS, the instruction sets the engine uses on this processor: AVX2, FMA and F16C, and each of
# AVX-512 (F/BW/VL/DQ), its VNNI, BF16 and VBMI where /proc/cpuinfo lists it (the engine is built
# with -march=native too; a build with AVX-512 on a processor without it stops with SIGILL). AMX is
# left off: its kernels need a permission this kind of machine does not grant (they stop with
# SIGILL). The server is built without curl, OpenSSL or its web UI.
set -eu
OUT=${1:-build/llama.cpp}
VERSION=0.3.36
TARGETS=""
for t in llama-bench llama-server; do
    if [ -x "$OUT/bin/$t" ]; then
        echo "$t: $OUT/bin/$t is built"
    else
        TARGETS="$TARGETS $t"
    fi
done
[ -n "$TARGETS" ] || exit 0
command -v cmake >/dev/null || { echo "build-llama-bench: cmake is needed (apt-get install cmake)" >&2; exit 1; }
mkdir -p "$OUT"
SRC="$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    if [ ! -f "$OUT/llama_cpp_python-$VERSION.tar.gz" ]; then
        python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$OUT"
    fi
    tar -xzf "$OUT/llama_cpp_python-$VERSION.tar.gz" -C "$OUT"
fi
has() { if grep -qw "$1" /proc/cpuinfo; then echo ON; else echo OFF; fi; }
# Configuring an existing cmake folder again keeps what it has compiled: only the missing
# targets build.
cmake -S "$SRC" -B "$OUT/cmake" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
    -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)" \
    -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)" \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
    -DGGML_AMX_BF16=OFF >"$OUT/cmake.log" 2>&1 || { tail -20 "$OUT/cmake.log" >&2; exit 1; }
mkdir -p "$OUT/bin"
for t in $TARGETS; do
    cmake --build "$OUT/cmake" --target "$t" -j "${JOBS:-$(nproc)}" >"$OUT/build-$t.log" 2>&1 \
        || { tail -20 "$OUT/build-$t.log" >&2; exit 1; }
    cp "$OUT/cmake/bin/$t" "$OUT/bin/$t"
    echo "$t: built $OUT/bin/$t (llama.cpp from llama-cpp-python $VERSION)"
done
