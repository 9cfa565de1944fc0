#!/usr/bin/env bash
# End to end on the GPU: 20 steps of a small MoE from the same init and data on runtime.device cpu
# and cuda, per FP8 recipe; the largest relative difference of the per-step losses (a non-finite
# loss on either side fails) must stay within
#   off        1e-4  FP32 everywhere: only summation order differs (cuBLASLt vs OpenBLAS, the GPU's
#                    reductions and exp), ~1e-7 per step, amplified by 20 steps of training
#   current,   2e-2  both sides quantize with the same code, but their inputs differ by that order
#   blockwise        noise: where it moves a value across an FP8 rounding boundary the runs separate
#                    at FP8 noise level (the bound of the layout tests, README)
# Prints a table (with tokens/s and MFU of the cuda runs) and exits 77 (SKIPPED) without a GPU.
#
# usage: cuda_vs_cpu.sh FP8MOE SOURCE_DIR [steps=20]
set -uo pipefail
exe=$1 src=$2 steps=${3:-20}
fail() { echo "FAIL: $*" >&2; exit 1; }
source "$(dirname "$0")/common.sh"
unset OMP_NUM_THREADS  # one process: every core
if ! "$exe" --version 2>/dev/null | grep -q "GPUs: *[0-9]* visible"; then
  echo "[  SKIPPED ] no CUDA device visible ($("$exe" --version 2>&1 | sed -n 's/^ *GPUs: *//p'))"
  exit 77
fi
tmp=$(mktemp -d /tmp/fp8moe-cuda-XXXXXX)
ompi_session_dir "$tmp"
trap 'rm -rf "$tmp"' EXIT
"$exe" prepare-data --output "$tmp/data/src" --val-fraction 0.1 --seed 3 \
  --input "$src"/README.md "$src"/kernels/*.h "$src"/kernels/cpu/*.cpp "$src"/model/*.cpp "$src"/io/*.cpp >/dev/null ||
  fail "prepare-data"
cat >"$tmp/cfg.yaml" <<EOF2
model: {vocab_size: 256, d_model: 256, n_layers: 4, n_heads: 4, n_kv_heads: 2, head_dim: 64, first_dense_layers: 1,
        d_ff_dense: 768, moe: {n_experts: 8, top_k: 2, n_shared_experts: 1, d_expert: 256}}
train: {steps: $steps, warmup_steps: 2, global_batch: 16, seq_len: 256, lr: 1.0e-3, min_lr: 1.0e-4}
parallel: {micro_batches: 2}
eval: {every: 0}
log: {every: 1}
data: {path: $tmp/data/src.train, valid_path: $tmp/data/src.val}
checkpoint: {dir: $tmp/ck, resume: none}
EOF2
printf '%-10s %14s %12s %10s %8s %s\n' recipe "max rel diff" bound "cuda tok/s" "mfu" "cpu tok/s"
status=0
for recipe in off current blockwise; do
  bound=2e-2
  [[ $recipe == off ]] && bound=1e-4
  for dev in cpu cuda; do
    "$exe" train "$tmp/cfg.yaml" --set fp8.recipe=$recipe --set runtime.device=$dev \
      --set checkpoint.dir="$tmp/ck-$recipe-$dev" >"$tmp/$recipe-$dev.txt" 2>&1 ||
      fail "$recipe on $dev: $(tail -5 "$tmp/$recipe-$dev.txt")"
  done
  grep -q "^device: cuda" "$tmp/$recipe-cuda.txt" || fail "runtime.device=cuda did not run on cuda"
  diff=$(paste <(loss_bits <"$tmp/$recipe-cpu.txt") <(loss_bits <"$tmp/$recipe-cuda.txt") | python3 -c '
import math, sys
worst, n = 0.0, 0
for line in sys.stdin:
    s1, a, s2, b = line.split()
    assert s1 == s2, "step mismatch"
    a, b = float.fromhex(a), float.fromhex(b)
    d = abs(a - b) / abs(a) if math.isfinite(a) and math.isfinite(b) else math.inf  # NaN never passes
    worst, n = max(worst, d), n + 1
print(f"{worst:.3e}" if n else "none")') || fail "$recipe: comparing the losses failed: ${diff:-no output}"
  [[ $diff != none ]] || fail "$recipe: no losses to compare"
  [[ $diff =~ ^[0-9.]+e[-+][0-9]+$|^inf$ ]] || fail "$recipe: the comparison printed '$diff', not a number"
  last_cuda=$(grep '^step' "$tmp/$recipe-cuda.txt" | tail -1)
  last_cpu=$(grep '^step' "$tmp/$recipe-cpu.txt" | tail -1)
  tok=$(sed -n 's/.* \([0-9]*\) tok\/s.*/\1/p' <<<"$last_cuda")
  mfu=$(sed -n 's/.*mfu \([0-9.a-z]*\) .*/\1/p' <<<"$last_cuda")
  ctok=$(sed -n 's/.* \([0-9]*\) tok\/s.*/\1/p' <<<"$last_cpu")
  ok=$(python3 -c "print(float('$diff') <= float('$bound'))")
  printf '%-10s %14s %12s %10s %8s %s %s\n' $recipe "$diff" "$bound" "$tok" "$mfu" "$ctok" "$([[ $ok == True ]] && echo ok || echo FAIL)"
  [[ $ok == True ]] || status=1
done
grep -h "dmem" "$tmp"/*-cuda.txt | tail -1 | sed 's/.*\(dmem [0-9]* MB\).*/peak device memory (arena) of the last run: \1/'
exit $status
