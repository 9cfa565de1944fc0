#!/usr/bin/env bash
# Everything GPU-side in one run (under 6 minutes on an H200), for the device machine: unpacks the
# bundle made by scripts/bundle.sh (no Open MPI, HDF5 or yaml-cpp needed there), then
#   1. the device and its driver (nvidia-smi)
#   2. test_cuda_ops: every CUDA op against the CPU op, the FP8 GEMMs against FP64 and the CPU;
#      test_nccl as one rank (the NCCL communicator against MPI's)
#   3. bench_gemm_cuda: BF16 / FP8 per-tensor / FP8 block-scaled TFLOP/s at DeepSeek-V3 shapes
#   4. tests/app/cuda_vs_cpu.sh: 20 training steps on cuda vs cpu per recipe, tokens/s and MFU
# and prints the summary table last. Logs go to $OUT (the device tool's output folder) when set.
#
# usage (from the repository root): scripts/device-check.sh [BUNDLE=bundle/fp8moe-bundle.tar.xz]
#   here:   scripts/bundle.sh build bundle        (a CUDA build; bundle/ is git-ignored)
#   there:  device run, carry ["bundle"], command "bash scripts/device-check.sh"
set -uo pipefail
tarball=${1:-bundle/fp8moe-bundle.tar.xz}
src=$(pwd)
logs=${OUT:-$(mktemp -d /tmp/fp8moe-devcheck-XXXXXX)}
[[ -f $tarball ]] || { echo "device-check: $tarball not found (make it with scripts/bundle.sh)" >&2; exit 2; }
work=$(mktemp -d /tmp/fp8moe-dev-XXXXXX)
tar -C "$work" -xJf "$tarball" || { echo "device-check: cannot unpack $tarball" >&2; exit 2; }
source "$work/fp8moe-bundle/env.sh"
start=$(date +%s)
section() { printf '\n==== %s (%ds) ====\n' "$1" $(( $(date +%s) - start )); }

section "device"
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)
echo "$gpu"
fp8moe --version 2>&1 | tee "$logs/version.txt"

section "test_cuda_ops"
timeout 200 test_cuda_ops 2>&1 | tee "$logs/test_cuda_ops.txt" | grep -E "^\[ +(OK|FAILED) +\] |^\[ +(PASSED|SKIPPED) +\] [0-9]+ test"
ops_status=${PIPESTATUS[0]}
ops_summary=$(grep -E "^\[ +(PASSED|FAILED|SKIPPED) +\] [0-9]+ test" "$logs/test_cuda_ops.txt" | sed 's/, listed below://' | tr -s ' \n' ' ')

section "test_nccl (one rank: NCCL against MPI, self send/recv)"
timeout 60 test_nccl 2>&1 | tee "$logs/test_nccl.txt" | grep -E "^\[ +(OK|FAILED) +\] |^\[ +(PASSED|SKIPPED) +\] [0-9]+ test"
nccl_status=${PIPESTATUS[0]}
nccl_summary=$(grep -E "^\[ +(PASSED|FAILED|SKIPPED) +\] [0-9]+ test" "$logs/test_nccl.txt" | sed 's/, listed below://' | tr -s ' \n' ' ')

section "bench_gemm_cuda"
timeout 120 bench_gemm_cuda 20 2>&1 | tee "$logs/bench_gemm.txt"
bench_status=${PIPESTATUS[0]}

section "cuda vs cpu, 20 steps"
timeout 240 bash "$src/tests/app/cuda_vs_cpu.sh" "$(command -v fp8moe)" "$src" 20 2>&1 | tee "$logs/e2e.txt"
e2e_status=${PIPESTATUS[0]}

section "summary"
{
  echo "device:        $gpu"
  echo "                $(sed -n 's/^ *CUDA: *//p' "$logs/version.txt"), NCCL $(sed -n 's/^ *NCCL: *//p' "$logs/version.txt")"
  echo "test_cuda_ops: exit $ops_status: $ops_summary"
  echo "test_nccl:     exit $nccl_status: $nccl_summary"
  echo "GEMMs (exit $bench_status), dense FP8 peak 1979 TFLOP/s:"
  sed -n '/^shape/,$p' "$logs/bench_gemm.txt" | sed 's/^/  /'
  echo "end to end, cuda vs cpu (exit $e2e_status):"
  sed -n '/^recipe/,$p' "$logs/e2e.txt" | sed 's/^/  /'
  echo "total $(( $(date +%s) - start )) s"
} | tee "$logs/summary.txt"
rm -rf "$work"
(( ops_status == 0 && nccl_status == 0 && bench_status == 0 && e2e_status == 0 ))
