#!/usr/bin/env bash
# Everything GPU-side in one run, for the device machine: unpacks the bundle made by
# scripts/bundle.sh (no Open MPI, HDF5 or yaml-cpp needed there), then
#   1. the device and its driver (nvidia-smi)
#   2. test_kernels' CUDA cases (DeviceOps.*/cuda, CudaOps.*): every CUDA op against the CPU op,
#      cuDNN's fused attention against the reference kernel (libcudnn from the image's
#      nvidia-cudnn-cu13 wheel), the FP8 GEMMs against FP64 and the CPU, the hardware FP8 conversion, the arena (its CPU and
#      emulated-device cases run in CI); test_nccl as one rank (the NCCL communicator against MPI's)
#   3. bench_gemm_cuda: BF16 / FP8 per-tensor / FP8 block-scaled TFLOP/s at DeepSeek-V3 shapes
#   4. tests/app/cuda_vs_cpu.sh: 20 training steps on cuda vs cpu per recipe, tokens/s and MFU, and
#      the host synchronisations and bytes each way per step (asserted)
#   5. tests/app/cuda_layouts.sh: tp2, ep2, pp2 as 2 ranks sharing the GPU (runtime.comm mpi)
#      against the 1-rank losses
#   6. bench/gpu-vs-eager.sh: tokens/s of configs/tiny.yaml on cuda beside eager PyTorch (FP32,
#      BF16) on the same GPU
#   7. bench/gpu-moe.sh: configs/moe-3b.yaml (3.2B MoE) in blockwise FP8 beside bench/torch_moe.py
#      (PyTorch BF16 with torch._grouped_mm, eager only here: a cold torch.compile of this model
#      would not fit; run bench/gpu-moe.sh alone for it): tokens/s, MFU, device memory
# Each step has a time limit, and the whole check a deadline of 6 minutes (DEVICE_CHECK_BUDGET,
# seconds): a step gets at most what is left of it, and a step with under 10 s left is not started
# and counts as a failure, so the check never runs past 6 minutes (the first form of this check,
# steps 1-4, took 192 s on an H200; steps 5-7 have not run on a GPU yet). The summary grows after every step in $OUT/summary.txt (the
# device tool's output folder, when set) and is printed last. On a GPU a skipped test is a failure.
#
# usage: scripts/device-check.sh [BUNDLE=bundle/fp8moe-bundle.tar.xz]
#   here:   scripts/bundle.sh build bundle        (a CUDA build; bundle/ is git-ignored)
#   there:  device run, carry ["bundle"], command "bash scripts/device-check.sh"
set -uo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
tarball=${1:-$src/bundle/fp8moe-bundle.tar.xz}
logs=${OUT:-$(mktemp -d /tmp/fp8moe-devcheck-XXXXXX)}
[[ -f $tarball ]] || { echo "device-check: $tarball not found (make it with scripts/bundle.sh)" >&2; exit 2; }
work=$(mktemp -d /tmp/fp8moe-dev-XXXXXX)
trap 'rm -rf "$work"' EXIT
tar -C "$work" -xJf "$tarball" || { echo "device-check: cannot unpack $tarball" >&2; exit 2; }
source "$work/fp8moe-bundle/env.sh"
# cuDNN's fused attention opens libcudnn.so.9 at run time: the image's nvidia-cudnn-cu13 wheel has it.
cudnn_lib=$(python3 -c 'import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], "lib"))' 2>/dev/null)
[[ -n $cudnn_lib && -d $cudnn_lib ]] && export LD_LIBRARY_PATH="$cudnn_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
start=$(date +%s)
summary=$logs/summary.txt
: >"$summary"
budget=${DEVICE_CHECK_BUDGET:-360}
# limit SECONDS: the step's limit, cut to what is left of the budget (0: no time left).
limit() {
  local left=$(( budget - ($(date +%s) - start) ))
  (( left < 10 )) && { echo 0; return; }
  echo $(( $1 < left ? $1 : left ))
}
# out_of_time NAME LIMIT: true (and a failure noted) when LIMIT is 0.
out_of_time() {
  [[ $2 == 0 ]] || return 1
  note "$(printf '%-14s not run: the check used its %d s' "$1:" "$budget")"
  failed=1
}
section() { printf '\n==== %s (%ds) ====\n' "$1" $(( $(date +%s) - start )); }
note() { echo "$*" >>"$summary"; }
failed=0
# gtest_run NAME LIMIT [ARGS...]: runs a gtest binary of the bundle (log $logs/NAME.txt); a failure or a
# skipped test fails the check.
gtest_run() {
  local t
  t=$(limit "$2")
  out_of_time "$1" "$t" && return
  timeout "$t" "$1" "${@:3}" 2>&1 | tee "$logs/$1.txt" | grep -E "^\[ +(OK|FAILED) +\] |^\[ +(PASSED|SKIPPED) +\] [0-9]+ test"
  local status=${PIPESTATUS[0]}
  local line
  line=$(grep -E "^\[ +(PASSED|FAILED|SKIPPED) +\] [0-9]+ test" "$logs/$1.txt" | sed 's/, listed below://' | tr -s ' \n' ' ')
  grep -q "^\[  SKIPPED \]" "$logs/$1.txt" && status=${status/#0/skipped}
  note "$(printf '%-14s exit %s: %s' "$1:" "$status" "$line")"
  [[ $status == 0 ]] || failed=1
}

# script_run LOG LIMIT TITLE FROM CMD...: runs CMD within the budget (log $logs/LOG.txt) and notes TITLE,
# its exit status and its log from the first line matching FROM.
script_run() {
  local log=$1 title=$3 from=$4 t status
  t=$(limit "$2")
  shift 4
  out_of_time "$log" "$t" && return
  timeout "$t" "$@" 2>&1 | tee "$logs/$log.txt"
  status=${PIPESTATUS[0]}
  note "$title (exit $status):"
  note "$(sed -n "\\|$from|,\$p" "$logs/$log.txt" | sed 's/^/  /')"
  [[ $status == 0 ]] || failed=1
}

section "device"
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)
echo "$gpu"
fp8moe --version 2>&1 | tee "$work/version.txt"  # $OUT holds at most 8 files: 8 logs below
note "device:        $gpu"
note "               $(sed -n 's/^ *CUDA: *//p' "$work/version.txt"), NCCL $(sed -n 's/^ *NCCL: *//p' "$work/version.txt")"
note "               cuDNN: $(sed -n 's/^ *cuDNN: *//p' "$work/version.txt")"

section "test_kernels, the CUDA cases"
gtest_run test_kernels 120 --gtest_filter='*/cuda:CudaOps.*'
# The FP8 GEMMs' measured errors, worst per recipe and GEMM (their bounds are not yet measured).
note "FP8 GEMM dissimilarity, worst over the shapes (bounds: vs FP64 1e-3, hybrid dgrad/wgrad 4e-3;
               vs CPU 1e-6, fprop with fast accumulation 2e-6):"
note "$(awk '/^\[ MEASURE  \] gemm/ { k = $5 " " $6; if (!(k in e) || $(NF-3) + 0 > e[k]) e[k] = $(NF-3) + 0;
  if (!(k in c) || $NF + 0 > c[k]) c[k] = $NF + 0 }
  END { for (k in e) printf "  %-18s vs FP64 %.2e  vs CPU %.2e\n", k, e[k], c[k] }' "$logs/test_kernels.txt" | sort)"
section "test_nccl (one rank: NCCL against MPI, self send/recv)"
gtest_run test_nccl 30

section "bench_gemm_cuda"
script_run bench_gemm 60 "GEMMs, dense FP8 peak 1979 TFLOP/s" '^shape' bench_gemm_cuda 20

section "cuda vs cpu, 20 steps"
script_run e2e 130 "end to end, cuda vs cpu" '^recipe' bash "$src/tests/app/cuda_vs_cpu.sh" "$(command -v fp8moe)" "$src" 20

section "layouts on one GPU, 2 ranks with runtime.comm mpi"
script_run layouts 60 "layouts on one GPU vs 1 rank" '^recipe' \
  bash "$src/tests/app/cuda_layouts.sh" "$(command -v fp8moe)" "$src" 6

section "tiny.yaml on cuda beside eager PyTorch"
script_run eager 60 "throughput" '^tiny.yaml' bash "$src/bench/gpu-vs-eager.sh" "$(command -v fp8moe)" 12

section "configs/moe-3b.yaml beside PyTorch BF16"
script_run moe3b 130 "3.2B MoE" '^configs/moe-3b.yaml' \
  env GPU_MOE_COMPILE=0 GPU_MOE_RUN_LIMIT=55 bash "$src/bench/gpu-moe.sh" "$(command -v fp8moe)" 8

note "total $(( $(date +%s) - start )) s; $([[ $failed == 0 ]] && echo "all passed" || echo "FAILED")"
section "summary"
cat "$summary"
exit $failed
