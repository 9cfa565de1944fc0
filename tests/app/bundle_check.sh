#!/usr/bin/env bash
# The device bundle (scripts/bundle.sh) is self-contained: unpacked, its programs run in a
# bubblewrap sandbox whose /usr/lib/x86_64-linux-gnu holds glibc alone (no Open MPI, PMIx, HDF5,
# yaml-cpp, oneDNN, libstdc++, ...; CUDA's own folder stays, as on the GPU machine).
# There fp8moe starts, prepares data, trains as an MPI singleton and under the bundle's own
# `mpirun -np 2`, and test_kernels runs: its CUDA cases (DeviceOps.*/cuda, CudaOps.*) must all
# report SKIPPED here, without a GPU, and every other case (the CPU ops, the emulated device) must
# pass. A library the bundle failed to carry, loaded at start or later (dlopen), makes it fail.
# Exit 77 (SKIPPED) without bubblewrap or where it cannot make a sandbox.
#
# usage: bundle_check.sh BUNDLE_TAR_XZ SOURCE_DIR
set -uo pipefail
tarball=$1 src=$2
fail() { echo "FAIL: $*" >&2; exit 1; }
source "$(dirname "$0")/common.sh"  # SMALL_MOE_MODEL
command -v bwrap >/dev/null || { echo "SKIPPED: bubblewrap (bwrap) is not installed"; exit 77; }
bwrap --ro-bind / / true 2>/dev/null || { echo "SKIPPED: bwrap cannot create a sandbox here"; exit 77; }
tmp=$(mktemp -d /tmp/fp8moe-bundlecheck-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
tar -C "$tmp" -xJf "$tarball" || fail "cannot unpack $tarball"
B=$tmp/fp8moe-bundle

# The bundle's environment, from its env.sh (run out here: the sandbox has no bash libraries).
sandbox=(--ro-bind / / --dev /dev --proc /proc --bind /tmp /tmp --clearenv --setenv HOME "$tmp" --setenv OMP_NUM_THREADS 1)
while IFS='=' read -r name value; do sandbox+=(--setenv "$name" "$value"); done < <(bash -c "source '$B/env.sh'
  for v in PATH LD_LIBRARY_PATH OPAL_PREFIX PMIX_INSTALL_PREFIX PMIX_MCA_mca_base_component_path OMPI_ALLOW_RUN_AS_ROOT \
           OMPI_ALLOW_RUN_AS_ROOT_CONFIRM OMPI_MCA_mca_base_component_show_load_errors \
           OMPI_MCA_btl_vader_single_copy_mechanism; do echo \"\$v=\${!v}\"; done")
# The system's library folder replaced by glibc alone (and the loader).
libdir=/usr/lib/x86_64-linux-gnu
sandbox+=(--tmpfs "$libdir")
for f in ld-linux-x86-64.so.2 libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 libresolv.so.2 libutil.so.1 \
         libanl.so.1 libnss_files.so.2 libnss_dns.so.2; do
  [[ -e $libdir/$f ]] && sandbox+=(--ro-bind "$(readlink -f "$libdir/$f")" "$libdir/$f")
done
run() { bwrap "${sandbox[@]}" --chdir "$tmp" "$@"; }

{
  printf '%s\n' "$SMALL_MOE_MODEL"
  echo "train: {steps: 3, warmup_steps: 1, global_batch: 4, seq_len: 32}"
  echo "fp8: {recipe: blockwise, tile: 16}"
  echo "data: {path: $tmp/data/src.train, valid_path: $tmp/data/src.val}"
  echo "checkpoint: {resume: none}"
} >"$tmp/cfg.yaml"
out=$tmp/out.txt
cuda_cases='*/cuda:CudaOps.*'
(
  set -e
  run "$B/bin/fp8moe" --version
  run "$B/bin/test_kernels" --gtest_brief=1 --gtest_filter="$cuda_cases" >"$tmp/cuda_cases.txt" 2>&1 ||
    { tail -20 "$tmp/cuda_cases.txt"; exit 1; }
  run "$B/bin/test_kernels" --gtest_brief=1 --gtest_filter="-$cuda_cases" >"$tmp/host_cases.txt" 2>&1 ||
    { grep -v MEASURE "$tmp/host_cases.txt" | tail -40; exit 1; }
  grep -h -E '^\[ +(PASSED|SKIPPED|FAILED) +\] [0-9]+ test' "$tmp/cuda_cases.txt" "$tmp/host_cases.txt"
  run "$B/bin/fp8moe" prepare-data --output "$tmp/data/src" --val-fraction 0.2 \
    --input "$src"/README.md "$src"/kernels/*.h "$src"/model/*.cpp >/dev/null
  run "$B/bin/fp8moe" train "$tmp/cfg.yaml" --set checkpoint.dir="$tmp/ck1" | grep '^step'
  run "$B/ompi/bin/mpirun" -np 2 --oversubscribe "$B/bin/fp8moe" train "$tmp/cfg.yaml" \
    --set checkpoint.dir="$tmp/ck2" | grep '^step'
) >"$out" 2>&1
status=$?
cat "$out"
[[ $status == 0 ]] || fail "the bundle failed in the sandbox (exit $status)"
grep -Eq '^\[  SKIPPED \] [1-9][0-9]* tests?' "$tmp/cuda_cases.txt" && grep -q '^\[  PASSED  \] 0 tests' "$tmp/cuda_cases.txt" ||
  fail "test_kernels' CUDA cases did not all report SKIPPED without a GPU"
grep -Eq '^\[  PASSED  \] [1-9][0-9]* tests' "$tmp/host_cases.txt" && ! grep -q '^\[  SKIPPED \]' "$tmp/host_cases.txt" ||
  fail "test_kernels' CPU and emulated-device cases did not all pass"
[[ $(grep -c '^step *3/3' "$out") == 2 ]] || fail "the singleton and the mpirun -np 2 run did not both finish"
echo "bundle_check: OK ($(du -sh "$tarball" | cut -f1) packed; ran with glibc alone in $libdir)"
