#!/usr/bin/env bash
# Side by side, in one run on this machine: tokens/s of fp8moe on configs/tiny.yaml (recipe off and
# blockwise FP8, one rank) and of the same model and AdamW step in eager PyTorch (FP32 and BF16
# autocast; Debian's python3-torch, installed here when missing). The first 2 steps are warm-up.
#   bench/compare-eager.sh [STEPS]     (default 12)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
steps=${1:-12}
out=build/bench-eager
mkdir -p "$out"
if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
  echo "compare-eager: installing Debian's python3-torch"
  sudo_=(); [[ $(id -u) -ne 0 ]] && sudo_=(sudo)
  "${sudo_[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-torch
fi
if [[ ! -f $out/lic.train.idx ]]; then
  build/fp8moe prepare-data --input /usr/share/common-licenses/* --output "$out/lic" --val-fraction 0 >/dev/null
fi
mean_tps() {  # mean tokens_per_s of the JSONL rows after the first two
  build/venv/bin/python3 -c "import json,sys; r=[json.loads(l)['tokens_per_s'] for l in open(sys.argv[1])][2:]; print('%.0f' % (sum(r)/len(r)))" "$1"
}
declare -A tps
for recipe in off blockwise; do
  build/fp8moe train configs/tiny.yaml --set parallel.tensor=1 --set parallel.pipeline=1 --set parallel.expert=1 \
    --set fp8.recipe=$recipe --set data.path="$out/lic.train" --set data.valid_path="$out/lic.val" --set train.steps="$steps" --set train.warmup_steps=1 \
    --set eval.every=0 --set log.every=1 --set log.jsonl="$out/$recipe.jsonl" --set checkpoint.dir="$out/ckpt" >/dev/null
  tps[$recipe]=$(mean_tps "$out/$recipe.jsonl")
done
for mode in fp32 bf16; do
  tps[torch_$mode]=$(/usr/bin/python3 bench/eager_pytorch.py $mode "$steps" | awk '/tokens_per_s/ {printf "%.0f", $2}')
done
base=${tps[torch_fp32]}
printf '\ntiny.yaml, 8 x 256 tokens per step in 4 micro-batches, AdamW, %s steps (2 warm-up), %s cores\n' "$steps" "$(nproc)"
printf '%-34s %10s %18s\n' "run" "tokens/s" "vs eager FP32"
for k in torch_fp32 torch_bf16 off blockwise; do
  case $k in
    torch_fp32) name="eager PyTorch $(/usr/bin/python3 -c 'import torch; print(torch.__version__)') FP32";;
    torch_bf16) name="eager PyTorch, BF16 autocast";;
    off) name="fp8moe, fp8.recipe off";;
    blockwise) name="fp8moe, fp8.recipe blockwise";;
  esac
  awk -v n="$name" -v t="${tps[$k]}" -v b="$base" 'BEGIN { printf "%-34s %10d %17.2fx\n", n, t, t / b }'
done
