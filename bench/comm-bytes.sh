#!/usr/bin/env bash
# Communication accounting per layout: bytes each group (tp, ep, dp, edp, pp) sent in one training
# step, summed over the ranks, beside the analytical count of the layout (README "Communication"),
# and the step time. configs/tiny.yaml (recipe blockwise), 3 steps, the last one reported.
# Step times on this 2-core machine with up to 8 oversubscribed ranks are noisy and say little
# about a cluster: compare the byte ratios, not the times.
#
# usage: bench/comm-bytes.sh [build/fp8moe] [extra --set options...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exe=${1:-build/fp8moe}
shift || true
source scripts/mpi-env.sh
[[ -f data/fortunes.train.idx ]] || { echo "comm-bytes: run scripts/demo.sh once (it prepares data/fortunes)"; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

layouts=(
  "1|"
  "2|parallel.tensor=2"
  "2|parallel.pipeline=2"
  "2|parallel.expert=2"
  "2|optim.zero=0"
  "4|parallel.tensor=2 parallel.pipeline=2"
  "4|parallel.tensor=2 parallel.expert=2"
  "4|parallel.pipeline=2 parallel.expert=2"
  "8|parallel.tensor=2 parallel.pipeline=2 parallel.expert=2"
  "4|parallel.pipeline=4 parallel.micro_batches=8"
)
printf "%-48s %6s  %-44s %s\n" "layout (tiny.yaml)" "ranks" "measured / analytical bytes per group" "s/step"
for entry in "${layouts[@]}"; do
  ranks=${entry%%|*}
  sets=(--set parallel.tensor=1 --set parallel.pipeline=1 --set parallel.expert=1 --set train.steps=3
        --set train.warmup_steps=1 --set eval.every=0 --set log.every=1 --set "checkpoint.dir=$tmp/ckpt"
        --set checkpoint.resume=none --set checkpoint.every=0 --set log.jsonl= "$@")
  for s in ${entry#*|}; do sets+=(--set "$s"); done
  out=$(mpirun -np "$ranks" --oversubscribe "$exe" train configs/tiny.yaml "${sets[@]}" 2>&1) || { echo "$out" | tail -5; exit 1; }
  ratios=$(echo "$out" | awk '/^communication/{on=1; next} on && /^  [a-z]+ / && $1 != "group"{printf "%s %.3f  ", $1, $4} /^done/{on=0}')
  step=$(echo "$out" | awk '/^step +3\/3/{for (i = 1; i <= NF; ++i) if ($i == "s/step") print $(i-1)}')
  printf "%-48s %6s  %-44s %s\n" "${entry#*|}" "$ranks" "${ratios:-(no communication)}" "$step"
done
