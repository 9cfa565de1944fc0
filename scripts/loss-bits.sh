#!/usr/bin/env bash
# Two fp8moe binaries, the same runs, the same bits? For changes that must not move a number (a
# refactor, a new kernel behind a switch that is off): each binary trains the same matrix of small
# runs (GQA, MLA with and without the query latent, multi-token prediction; every FP8 recipe; the
# CPU and the emulated device; recomputation; 1, 2 and 8 ranks over tensor, pipeline, expert and
# data parallelism), then scripts/compare_runs.py compares, run by run: every step's loss bits, the
# metrics records (all but timings and host memory), the final checkpoints dataset by dataset and
# attribute by attribute (h5py), and a greedy `fp8moe generate` from them. Exits 1 on any
# difference, naming it.
#   scripts/loss-bits.sh BEFORE_EXE AFTER_EXE [WORK_DIR]     (about 15 minutes here for both)
#   LOSS_BITS_ONLY=regex scripts/loss-bits.sh ...              only the cases whose name matches
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
before=$(realpath "$1") after=$(realpath "$2")
work=${3:-$(mktemp -d /tmp/fp8moe-loss-bits-XXXXXX)}
mkdir -p "$work"
source "$root/tests/app/common.sh"
ompi_session_dir "$work"
python=${FP8MOE_PYTHON:-$root/build/venv/bin/python3}
mpiexec=${MPIEXEC:-mpirun}
prepare_licence_data "$before" "$work/data/lic"

# NAME RANKS CONFIG SETTINGS...: one case.
cases=()
case_() { cases+=("$*"); }
one='parallel.tensor=1 parallel.pipeline=1 parallel.expert=1'
for r in off delayed current blockwise; do
  case_ "gqa-$r-cpu" 1 tiny.yaml $one fp8.recipe=$r
  case_ "mla-$r-cpu" 1 tiny-v3.yaml $one fp8.recipe=$r
done
case_ gqa-delayed-emulated 1 tiny.yaml $one fp8.recipe=delayed runtime.device=emulated
case_ gqa-blockwise-emulated 1 tiny.yaml $one fp8.recipe=blockwise runtime.device=emulated
case_ mla-blockwise-emulated 1 tiny-v3.yaml $one fp8.recipe=blockwise runtime.device=emulated
case_ mla-noqlatent-blockwise-cpu 1 tiny-v2-lite.yaml $one fp8.recipe=blockwise
case_ mla-noqlatent-delayed-cpu 1 tiny-v2-lite.yaml $one fp8.recipe=delayed
case_ mla-blockwise-recompute-full 1 tiny-v3.yaml $one fp8.recipe=blockwise train.recompute=full
case_ mla-delayed-recompute-moe 1 tiny-v3.yaml $one fp8.recipe=delayed train.recompute=moe
case_ gqa-delayed-recompute-full 1 tiny.yaml $one fp8.recipe=delayed train.recompute=full
case_ gqa-mtp2-blockwise-pp2 2 tiny.yaml parallel.tensor=1 parallel.pipeline=2 parallel.expert=1 model.mtp_depth=2 \
  fp8.recipe=blockwise
case_ mla-current-tp2 2 tiny-v3.yaml parallel.tensor=2 parallel.pipeline=1 parallel.expert=1 fp8.recipe=current
case_ mla-delayed-pp2 2 tiny-v3.yaml parallel.tensor=1 parallel.pipeline=2 parallel.expert=1 fp8.recipe=delayed
case_ gqa-off-ep2 2 tiny.yaml parallel.tensor=1 parallel.pipeline=1 parallel.expert=2 fp8.recipe=off
case_ gqa-blockwise-dp2 2 tiny.yaml $one fp8.recipe=blockwise
case_ gqa-blockwise-tp2pp2ep2 8 tiny.yaml fp8.recipe=blockwise
case_ mla-blockwise-tp2pp2ep2 8 tiny-v3.yaml fp8.recipe=blockwise
case_ mla-current-tp2pp2ep2-recompute-full 8 tiny-v3.yaml fp8.recipe=current train.recompute=full
case_ mla-blockwise-tp2pp2ep2-emulated 8 tiny-v3.yaml fp8.recipe=blockwise runtime.device=emulated
case_ mla-noqlatent-current-tp2pp2ep2 8 tiny-v2-lite.yaml fp8.recipe=current

common=(train.seq_len=64 train.global_batch=8 train.steps=4 train.warmup_steps=1 eval.every=2 eval.batches=1
  log.every=1 checkpoint.every=0 "data.path=$work/data/lic.train" "data.valid_path=$work/data/lic.val"
  checkpoint.dir=ck log.jsonl=metrics.jsonl)
run_case() {  # EXE OUT NAME RANKS CONFIG SETTINGS...
  local exe=$1 name=$3 out=$2/$3 ranks=$4 config=$5
  shift 5
  local sets=()
  for s in "${common[@]}" "$@"; do sets+=(--set "$s"); done
  rm -rf "$out" && mkdir -p "$out"
  (cd "$out" && "$mpiexec" -n "$ranks" "$exe" train "$root/configs/$config" "${sets[@]}" >train.txt 2>&1) ||
    { echo "loss-bits: $name failed with $exe (see $out/train.txt)"; return 1; }
  if [[ $ranks == 1 ]]; then
    (cd "$out" && "$exe" generate --checkpoint ck --prompt "The " --tokens 24 --temperature 0 >generate.txt 2>&1)
  fi
}
only=${LOSS_BITS_ONLY:-.}
for c in "${cases[@]}"; do
  read -r -a a <<<"$c"
  [[ ${a[0]} =~ $only ]] || continue
  echo "loss-bits: ${a[0]} (${a[1]} rank(s))"
  run_case "$before" "$work/before" "${a[@]}"
  run_case "$after" "$work/after" "${a[@]}"
done
"$python" "$root/scripts/compare_runs.py" "$work/before" "$work/after"
