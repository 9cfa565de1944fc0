#!/usr/bin/env bash
# The device bundle (scripts/bundle.sh) is self-contained: unpacked in a sandbox (bubblewrap) where
# the system's Open MPI, PMIx and every library the bundle carries are hidden, its fp8moe starts,
# trains as an MPI singleton and under the bundle's own `mpirun -np 2`, and its test_cuda_ops runs
# (SKIPPED here, without a GPU). Exit 77 (SKIPPED) without bubblewrap or user namespaces.
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
# Hide what the bundle should bring: the system copy of each carried library, Open MPI and PMIx.
hide=(--tmpfs /usr/lib/x86_64-linux-gnu/openmpi --tmpfs /usr/share/openmpi)
[[ -d /usr/lib/x86_64-linux-gnu/pmix2 ]] && hide+=(--tmpfs /usr/lib/x86_64-linux-gnu/pmix2)
for so in "$B"/lib/*; do
  for d in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu/openblas-openmp; do
    [[ -e $d/$(basename "$so") ]] && hide+=(--ro-bind /dev/null "$(readlink -f "$d/$(basename "$so")")")
  done
done
for t in mpirun mpiexec orted orterun; do p=$(command -v $t) && hide+=(--ro-bind /dev/null "$(readlink -f "$p")"); done
cat >"$tmp/run.sh" <<EOS
set -e
source "$B/env.sh"
cd "$tmp"
ldd "$B/bin/fp8moe" | grep -q 'not found' && { ldd "$B/bin/fp8moe" | grep 'not found'; exit 11; }
fp8moe --version
test_cuda_ops --gtest_brief=1 | tail -3
fp8moe prepare-data --output data/src --val-fraction 0.2 --input $src/README.md $src/kernels/*.h $src/model/*.cpp >/dev/null
cat >cfg.yaml <<EOF2
$SMALL_MOE_MODEL
train: {steps: 3, warmup_steps: 1, global_batch: 4, seq_len: 32}
fp8: {recipe: blockwise, tile: 16}
data: {path: data/src}
checkpoint: {dir: ck, resume: none}
EOF2
OMP_NUM_THREADS=1 fp8moe train cfg.yaml --set checkpoint.dir=ck1 | grep '^step'
OMP_NUM_THREADS=1 mpirun -np 2 --oversubscribe fp8moe train cfg.yaml --set checkpoint.dir=ck2 | grep '^step'
EOS
bwrap --ro-bind / / --dev /dev --proc /proc --bind /tmp /tmp "${hide[@]}" bash "$tmp/run.sh" >"$tmp/out.txt" 2>&1
status=$?
cat "$tmp/out.txt"
[[ $status == 0 ]] || fail "the bundle failed in the sandbox (exit $status)"
grep -q "SKIPPED" "$tmp/out.txt" || fail "test_cuda_ops did not report SKIPPED without a GPU"
[[ $(grep -c '^step *3/3' "$tmp/out.txt") == 2 ]] || fail "the singleton and the mpirun -np 2 run did not both finish"
echo "bundle_check: OK ($(du -sh "$tarball" | cut -f1) packed; fp8moe ran with the system's Open MPI, PMIx and ${#hide[@]} paths hidden)"
