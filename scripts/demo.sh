#!/usr/bin/env bash
# Set-up + the main job:
#  1. the 8-rank layout of configs/tiny.yaml (tensor 2 x pipeline 2 x data 2, expert 2), validated
#     and printed by `fp8moe train --dry-run` under mpirun;
#  2. the fortunes corpus (Debian's `fortunes` package) tokenised once into data/fortunes.*;
#  3. configs/tiny.yaml trained afresh on that layout (8 ranks, oversubscribed here), a metrics line
#     per 10 steps and logs/tiny.jsonl, checkpoints at steps 100 and 200 in checkpoints/tiny/, the
#     communication per group; then `ckpt verify` and a sample from the last checkpoint (1 process).
# usage: scripts/demo.sh [--set key=value ...]   (the overrides go to the training run of step 3;
#        scripts/fresh-check.sh trains 30 steps with them: the whole path, a seventh of the time)
set -euo pipefail
overrides=("$@")
for ((i = 0; i < ${#overrides[@]}; i += 2)); do
  [[ ${overrides[i]} == --set && -n ${overrides[i + 1]:-} ]] ||
    { echo "demo: usage: scripts/demo.sh [--set key=value ...]" >&2; exit 2; }
done
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
source scripts/mpi-env.sh

echo "demo: mpirun -np 8 --oversubscribe build/fp8moe train configs/tiny.yaml --dry-run"
mpirun -np 8 --oversubscribe build/fp8moe train configs/tiny.yaml --dry-run

if [[ ! -f data/fortunes.train.idx ]]; then
  inputs=()
  for f in /usr/share/games/fortunes/*; do
    [[ -f $f && $f != *.dat && $f != *.u8 ]] && inputs+=("$f")
  done
  echo "demo: build/fp8moe prepare-data (${#inputs[@]} fortune files) --output data/fortunes --split-on %"
  build/fp8moe prepare-data --input "${inputs[@]}" --output data/fortunes --split-on % --val-fraction 0.05
fi

echo "demo: mpirun -np 8 --oversubscribe build/fp8moe train configs/tiny.yaml ${overrides[*]}"
mpirun -np 8 --oversubscribe build/fp8moe train configs/tiny.yaml --set checkpoint.resume=none "${overrides[@]}"
build/fp8moe ckpt verify checkpoints/tiny
build/fp8moe generate --checkpoint checkpoints/tiny --prompt "The " --tokens 120
