#!/usr/bin/env bash
# Layouts on one GPU: tp2, ep2 and pp2 as 2 ranks sharing the GPU (runtime.comm mpi: the device
# communicators stage through pinned host memory, since NCCL refuses two ranks on one GPU), each
# step's loss against the 1-rank cuda run of the same model, data and init. Bounds, relative to the
# 1-rank loss at step s: off 1e-5 x s (summation order only: the tp shards' GEMMs and the
# replicas' reductions; the per-step allowance of cuda_vs_cpu.sh), blockwise 2e-2 (FP8 noise, the
# layout tests' bound). Attention is the reference kernel on both sides (runtime.attention
# reference): the FP32 bound is of the engine's summation order, not of BF16 roundings that a tp
# shard's inputs may move (cuDNN's fused attention is checked against it in test_kernels). Prints a table with the staged runs' host synchronisations per step; exits
# 77 (SKIPPED) without a GPU.
#
# usage: cuda_layouts.sh FP8MOE SOURCE_DIR [steps=6]
set -uo pipefail
exe=$1 src=$2 steps=${3:-6}
fail() { echo "FAIL: $*" >&2; exit 1; }
source "$(dirname "$0")/common.sh"
gpu_work_dir "$exe" cudalay
"$exe" prepare-data --output "$tmp/data/src" --val-fraction 0.1 --seed 3 \
  --input "$src"/README.md "$src"/kernels/*.h "$src"/model/*.cpp >/dev/null || fail "prepare-data"
cat >"$tmp/cfg.yaml" <<EOF2
model: {vocab_size: 256, d_model: 256, n_layers: 4, n_heads: 4, n_kv_heads: 4, head_dim: 64, first_dense_layers: 1,
        d_ff_dense: 768, moe: {n_experts: 8, top_k: 2, n_shared_experts: 1, d_expert: 256}}
train: {steps: $steps, warmup_steps: 2, global_batch: 16, seq_len: 256, lr: 1.0e-3, min_lr: 1.0e-4}
parallel: {micro_batches: 2}
fp8: {tile: 128}
eval: {every: 0}
log: {every: 1}
data: {path: $tmp/data/src.train}
checkpoint: {dir: $tmp/ck, resume: none}
runtime: {device: cuda, comm: mpi, attention: reference}
EOF2
# worst_ratio REF_LOG LOG PER_STEP BOUND: "worst ratio": the worst relative difference and the worst
# of difference / max(BOUND, PER_STEP x step) (above 1 fails).
worst_ratio() {
  paste <(loss_bits <"$1") <(loss_bits <"$2") | python3 -c '
import math, sys
per_step, bound = float(sys.argv[1]), float(sys.argv[2])
worst, ratio, n = 0.0, 0.0, 0
for line in sys.stdin:
    s1, a, s2, b = line.split()
    a, b, s = float.fromhex(a), float.fromhex(b), int(s1)
    d = abs(a - b) / abs(a) if s1 == s2 and math.isfinite(a) and math.isfinite(b) else math.inf
    worst, ratio, n = max(worst, d), max(ratio, d / max(bound, per_step * s)), n + 1
print(f"{worst:.3e} {ratio:.3f}" if n else "none inf")' "$3" "$4"
}
printf '%-10s %-10s %12s %8s %s\n' recipe layout "max rel diff" "/ bound" "syncs/step"
status=0
# (n_kv_heads 4: with blockwise FP8 every tensor-parallel shard is whole 128-wide tiles)
declare -A short=([tensor]=tp2 [expert]=ep2 [pipeline]=pp2)
for recipe in off blockwise; do
  per_step=1e-5 bound=0
  [[ $recipe == blockwise ]] && per_step=0 bound=2e-2
  "$exe" train "$tmp/cfg.yaml" --set fp8.recipe=$recipe --set checkpoint.dir="$tmp/ck-$recipe-1" >"$tmp/$recipe-1.txt" 2>&1 ||
    fail "$recipe on 1 rank: $(tail -5 "$tmp/$recipe-1.txt")"
  for layout in tensor expert pipeline; do
    mpirun -np 2 "$exe" train "$tmp/cfg.yaml" --set fp8.recipe=$recipe --set parallel.$layout=2 \
      --set checkpoint.dir="$tmp/ck-$recipe-$layout" >"$tmp/$recipe-$layout.txt" 2>&1 ||
      fail "$recipe, parallel.$layout=2: $(tail -5 "$tmp/$recipe-$layout.txt")"
    read -r worst ratio < <(worst_ratio "$tmp/$recipe-1.txt" "$tmp/$recipe-$layout.txt" $per_step $bound)
    syncs=$(sed -n 's/.* syncs \([0-9]*\) .*/\1/p' "$tmp/$recipe-$layout.txt" | sort -n | tail -1)
    ok=$(python3 -c "print(float('$ratio') <= 1.0)")
    printf '%-10s %-10s %12s %8s %s %s\n' $recipe "${short[$layout]}" "$worst" "$ratio" "$syncs" "$([[ $ok == True ]] && echo ok || echo FAIL)"
    [[ $ok == True ]] || status=1
  done
done
exit $status
