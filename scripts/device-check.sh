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
# Each step has a time limit (590 s in all, within the device tool's 600 s per command; the whole
# check should stay under 6 minutes: the first form of this check, steps 1-4, took 192 s on an
# H200; steps 5-7 have not run on a GPU yet). The summary grows after every step in $OUT/summary.txt (the
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
section() { printf '\n==== %s (%ds) ====\n' "$1" $(( $(date +%s) - start )); }
note() { echo "$*" >>"$summary"; }
failed=0
# gtest_run NAME LIMIT [ARGS...]: runs a gtest binary of the bundle (log $logs/NAME.txt); a failure or a
# skipped test fails the check.
gtest_run() {
  timeout "$2" "$1" "${@:3}" 2>&1 | tee "$logs/$1.txt" | grep -E "^\[ +(OK|FAILED) +\] |^\[ +(PASSED|SKIPPED) +\] [0-9]+ test"
  local status=${PIPESTATUS[0]}
  local line
  line=$(grep -E "^\[ +(PASSED|FAILED|SKIPPED) +\] [0-9]+ test" "$logs/$1.txt" | sed 's/, listed below://' | tr -s ' \n' ' ')
  grep -q "^\[  SKIPPED \]" "$logs/$1.txt" && status=${status/#0/skipped}
  note "$(printf '%-14s exit %s: %s' "$1:" "$status" "$line")"
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
timeout 60 bench_gemm_cuda 20 2>&1 | tee "$logs/bench_gemm.txt"
status=${PIPESTATUS[0]}
note "GEMMs (exit $status), dense FP8 peak 1979 TFLOP/s:"
note "$(sed -n '/^shape/,$p' "$logs/bench_gemm.txt" | sed 's/^/  /')"
[[ $status == 0 ]] || failed=1

section "cuda vs cpu, 20 steps"
timeout 130 bash "$src/tests/app/cuda_vs_cpu.sh" "$(command -v fp8moe)" "$src" 20 2>&1 | tee "$logs/e2e.txt"
status=${PIPESTATUS[0]}
note "end to end, cuda vs cpu (exit $status):"
note "$(sed -n '/^recipe/,$p' "$logs/e2e.txt" | sed 's/^/  /')"
[[ $status == 0 ]] || failed=1

section "layouts on one GPU, 2 ranks with runtime.comm mpi"
timeout 60 bash "$src/tests/app/cuda_layouts.sh" "$(command -v fp8moe)" "$src" 6 2>&1 | tee "$logs/layouts.txt"
status=${PIPESTATUS[0]}
note "layouts on one GPU vs 1 rank (exit $status):"
note "$(sed -n '/^recipe/,$p' "$logs/layouts.txt" | sed 's/^/  /')"
[[ $status == 0 ]] || failed=1

section "tiny.yaml on cuda beside eager PyTorch"
timeout 60 bash "$src/bench/gpu-vs-eager.sh" "$(command -v fp8moe)" 12 2>&1 | tee "$logs/eager.txt"
status=${PIPESTATUS[0]}
note "throughput (exit $status):"
note "$(sed -n '/^tiny.yaml/,$p' "$logs/eager.txt" | sed 's/^/  /')"
[[ $status == 0 ]] || failed=1

section "configs/moe-3b.yaml beside PyTorch BF16"
GPU_MOE_COMPILE=0 GPU_MOE_RUN_LIMIT=55 timeout 130 bash "$src/bench/gpu-moe.sh" "$(command -v fp8moe)" 8 2>&1 | tee "$logs/moe3b.txt"
status=${PIPESTATUS[0]}
note "3.2B MoE (exit $status):"
note "$(sed -n '/^configs\/moe-3b.yaml/,$p' "$logs/moe3b.txt" | sed 's/^/  /')"
[[ $status == 0 ]] || failed=1

note "total $(( $(date +%s) - start )) s; $([[ $failed == 0 ]] && echo "all passed" || echo "FAILED")"
section "summary"
cat "$summary"
exit $failed
