#!/usr/bin/env bash
# Side by side on one GPU, in one run: tokens/s of fp8moe on configs/tiny.yaml (one rank, recipe
# off and blockwise FP8, runtime.device cuda) and of the same model and AdamW step in eager PyTorch
# on the same GPU (bench/eager_pytorch.py: FP32 and BF16 autocast). The first 2 steps are warm-up.
# Needs a GPU and PyTorch in `python3`; exits 77 (SKIPPED) without a GPU.
#   bench/gpu-vs-eager.sh FP8MOE [STEPS=12]
set -uo pipefail
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exe=$1 steps=${2:-12}
if ! "$exe" --version 2>/dev/null | grep -q "GPUs: *[0-9]* visible"; then
  echo "[  SKIPPED ] no CUDA device visible"
  exit 77
fi
out=$(mktemp -d /tmp/fp8moe-gpueager-XXXXXX)
trap 'rm -rf "$out"' EXIT
"$exe" prepare-data --output "$out/src" --val-fraction 0 --seed 1 --input "$src"/README.md "$src"/kernels/*.h \
  "$src"/kernels/cpu/*.cpp "$src"/model/*.cpp >/dev/null || { echo "prepare-data failed" >&2; exit 1; }
mean_tps() {  # mean tokens_per_s of the JSONL rows after the first two
  python3 -c "import json,sys; r=[json.loads(l)['tokens_per_s'] for l in open(sys.argv[1])][2:]; print('%.0f' % (sum(r)/len(r)))" "$1"
}
declare -A tps mem
status=0
for recipe in off blockwise; do
  if "$exe" train "$src/configs/tiny.yaml" --set parallel.tensor=1 --set parallel.pipeline=1 --set parallel.expert=1 \
      --set runtime.device=cuda --set fp8.recipe=$recipe --set data.path="$out/src.train" --set data.valid_path='' \
      --set train.steps="$steps" --set train.warmup_steps=1 --set eval.every=0 --set log.every=1 \
      --set log.jsonl="$out/$recipe.jsonl" --set checkpoint.dir="$out/ckpt-$recipe" >"$out/$recipe.txt" 2>&1; then
    tps[$recipe]=$(mean_tps "$out/$recipe.jsonl")
    mem[$recipe]=$(python3 -c "import json,sys; print(max(json.loads(l)['peak_device_mem_bytes'] for l in open(sys.argv[1])) // 2**20)" "$out/$recipe.jsonl")
  else
    echo "fp8moe $recipe failed:" >&2; tail -5 "$out/$recipe.txt" >&2; tps[$recipe]=0 mem[$recipe]=-; status=1
  fi
done
for mode in fp32 bf16; do
  tps[torch_$mode]=$(python3 "$src/bench/eager_pytorch.py" $mode "$steps" cuda 2>"$out/torch-$mode.err" | awk '/tokens_per_s/ {printf "%.0f", $2}')
  [[ -n ${tps[torch_$mode]} ]] || { echo "eager PyTorch $mode failed: $(tail -3 "$out/torch-$mode.err")" >&2; tps[torch_$mode]=0; status=1; }
done
base=${tps[torch_fp32]}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
printf 'tiny.yaml on one %s, 8 x 256 tokens per step in 4 micro-batches, AdamW, %s steps (2 warm-up)\n' "${gpu:-GPU}" "$steps"
printf '%-34s %10s %14s %10s\n' "run" "tokens/s" "vs eager FP32" "dmem MiB"
for k in torch_fp32 torch_bf16 off blockwise; do
  case $k in
    torch_fp32) name="eager PyTorch $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null) FP32";;
    torch_bf16) name="eager PyTorch, BF16 autocast";;
    off) name="fp8moe cuda, fp8.recipe off";;
    blockwise) name="fp8moe cuda, fp8.recipe blockwise";;
  esac
  awk -v n="$name" -v t="${tps[$k]}" -v b="$base" -v m="${mem[$k]:--}" 'BEGIN { printf "%-34s %10d %13.2fx %10s\n", n, t, (b > 0 ? t / b : 0), m }'
done
exit $status
