#!/usr/bin/env bash
# GPU checks of the Clover TreeAttention kernel, in one go (< 5 minutes on one GPU).
#   bash trt_plugins/tests/run_gpu_checks.sh [extra args for gpu_checks.py]
# Env: SKIP_CMAKE=1 skips step 1; BUILD_DIR (default /tmp/clover_trt_build).
# Needs: an NVIDIA GPU, nvcc, a CUDA build of torch (+ ninja) for step 2, cmake for step 1.
# TensorRT is not needed: the plugin itself is only built if TRT_ROOT is set.
set -uo pipefail
cd "$(dirname "$0")/../.."
status=0

echo "== device"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader || true
nvcc --version | tail -n 2 || true

if [ "${SKIP_CMAKE:-0}" != 1 ] && command -v cmake >/dev/null; then
  echo "== 1/2 CMake build (kernel library + C++ kernel test${TRT_ROOT:+ + TensorRT plugin})"
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
  arch=${arch:-"80;90"}
  build=${BUILD_DIR:-/tmp/clover_trt_build}
  if timeout 240 cmake -S trt_plugins -B "$build" -DCMAKE_CUDA_ARCHITECTURES="$arch" ${TRT_ROOT:+-DTRT_ROOT="$TRT_ROOT"} >"$build.configure.log" 2>&1 \
     && timeout 240 cmake --build "$build" -j "$(nproc)" >"$build.build.log" 2>&1; then
    timeout 120 "$build/tree_attention_kernel_test" || status=1
  else
    echo "CMake configure/build failed; logs: $build.configure.log $build.build.log"
    tail -n 30 "$build.configure.log" "$build.build.log" 2>/dev/null
    status=1
  fi
fi

echo "== 2/2 PyTorch extension: correctness vs clover.attention.tree_attention, timing vs SDPA"
timeout 270 python3 trt_plugins/tests/gpu_checks.py "$@" || status=1

echo "== done (status $status)"
exit $status
