#!/usr/bin/env bash
# The data-parallel gradient reduction behind the backward (optim.overlap_grad_reduce; or with
# --key runtime.overlap_expert_comm the expert all-to-all behind the MoE layers' compute) against in
# line, side by side: configs/tiny.yaml on a layout (default: its 8 ranks, tensor 2 x pipeline 2 x
# expert 2 x data 2), ROUNDS rounds of one run each way, interleaved; per run the median over
# steps 3.. of the step time and of comm_exposed_s (the ranks' mean seconds blocked in
# collectives and waits, pipeline receives excluded), then the medians over the rounds. On this
# 2-core machine 8 ranks are oversubscribed: the figures say whether the waits shrink, not what a
# cluster gains.
#
# usage: bench/overlap.sh [--rounds N] [--ranks N] [--steps N] [--key KEY] [extra --set options...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=3 ranks=8 steps=12 key=optim.overlap_grad_reduce
while [[ $# -gt 0 ]]; do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --key) key=$2; shift 2 ;;
    *) break ;;
  esac
done
exe=build/fp8moe
source scripts/mpi-env.sh
[[ -f data/fortunes.train.idx ]] || { echo "overlap: run scripts/demo.sh once (it prepares data/fortunes)"; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
for round in $(seq "$rounds"); do
  for overlap in true false; do
    mpirun -np "$ranks" --oversubscribe "$exe" train configs/tiny.yaml --set train.steps="$steps" \
      --set train.warmup_steps=1 --set eval.every=0 --set checkpoint.save=false --set log.every=1 \
      --set log.jsonl="$tmp/$overlap.jsonl" \
      --set "$key=$overlap" "$@" >"$tmp/out.txt" 2>&1 || { tail -5 "$tmp/out.txt"; exit 1; }
    python3 - "$tmp/$overlap.jsonl" >>"$tmp/$overlap.runs" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][2:]
print(statistics.median(r["step_time_s"] for r in rows), statistics.median(r["comm_exposed_s"] for r in rows))
PY
  done
done
printf "%-10s %8s %14s   (%s; medians over %d rounds of the per-run medians, steps 3-%d)\n" overlap "s/step" "comm_exposed_s" "$key" "$rounds" "$steps"
for overlap in true false; do
  s=$(cut -d' ' -f1 "$tmp/$overlap.runs" | median)
  c=$(cut -d' ' -f2 "$tmp/$overlap.runs" | median)
  printf "%-10s %8.4f %14.4f\n" "$overlap" "$s" "$c"
done
