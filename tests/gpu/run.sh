#!/usr/bin/env bash
# The GPU checks in one go (docs/performance.md, "CUDA backend"): builds the CUDA backend and
# tests/gpu/gpu_check unless GPU_CHECK_DIR names a folder holding both already built, then
# checks every GPU operation against the CPU backend, the default model end to end (GQA and
# DIFF V2 forms) against CPU contexts, and prints the speed table; then the same checks and
# speed rows for the Hopper (wgmma) prefill kernels, loading with cp.async in a second process
# and fed by TMA in a third. Exit status 1 on any failed check. Needs a CUDA GPU; about 3
# minutes on an H200.
#   tests/gpu/run.sh [MODEL.gguf] [--no-time]
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
shift || true
if [ -n "${GPU_CHECK_DIR:-}" ]; then
    dir=$GPU_CHECK_DIR
else
    make -s -j"$(nproc)" build/libdiffrag_cuda.so build/tests/gpu/gpu_check
    dir=build
    cp build/tests/gpu/gpu_check build/gpu_check
fi
export DIFFRAG_CUDA_LIB=$PWD/$dir/libdiffrag_cuda.so
# cuBLAS where the loader does not find it by itself (a toolkit elsewhere, or a Python wheel's)
if ldd "$DIFFRAG_CUDA_LIB" | grep -q "libcublas.*not found"; then
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
             $(python3 -c 'import nvidia.cublas, os; print(os.path.join(nvidia.cublas.__path__[0], "lib"))' 2>/dev/null || true); do
        if [ -e "$d/libcublas.so.13" ]; then
            export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            break
        fi
    done
fi
ldd "$DIFFRAG_CUDA_LIB" | grep -E "cublas|cudart" || true
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv || true
args=()
[ -f "$model" ] && args+=("$model") || echo "no model at $model: operation checks only"
# the Hopper prefill kernels in processes of their own, after the others: a fault in them
# cannot spoil the results above (and a hang ends after 150 s)
rc=0
"$dir/gpu_check" "${args[@]}" --threads "$(nproc)" "$@" || rc=1
echo "-- the Hopper (wgmma) prefill kernels, cp.async"
timeout 150 "$dir/gpu_check" "${args[@]}" --threads "$(nproc)" --wgmma "$@" || rc=1
echo "-- the Hopper (wgmma) prefill kernels, TMA and a producer warp"
timeout 150 "$dir/gpu_check" "${args[@]}" --threads "$(nproc)" --tma "$@" || rc=1
exit $rc
