#!/usr/bin/env bash
# Side by side on this machine: tokens/s of fp8moe on configs/tiny.yaml (fp8.recipe off and
# blockwise, one rank) and of the same model and AdamW step in eager PyTorch (bench/eager_pytorch.py,
# FP32 and BF16 autocast; the torch of build/venv-hf, `scripts/setup.sh --hf`). PyTorch runs on as
# many threads as fp8moe's rank (torch.set_num_threads, from the count fp8moe's start-up line
# reports); --ranks8 adds fp8moe on tiny.yaml's own layout (tensor 2 x pipeline 2 x data 2, expert
# 2) as `mpirun -np 8 --oversubscribe`, beside the same PyTorch runs.
#
# The runs interleave: each of ROUNDS rounds runs every configuration once, in the same order, so
# that the machine's other work spreads over all of them. A run's figure is tokens per step over its
# median step time (the first 2 steps, warm-up, left out); the table gives the median over the
# rounds and their range. When the rounds of a run differ by more than 2x (a busy machine), a
# second table gives each run's best round: other work on the machine only ever slows a run.
#   bench/compare-eager.sh [--steps N] [--rounds N] [--ranks8]      (defaults: 12 steps, 3 rounds)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
steps=12 rounds=3 ranks8=0
while (($#)); do
  case $1 in
    --steps) steps=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --ranks8) ranks8=1; shift ;;
    [0-9]*) steps=$1; shift ;;  # the old form: bench/compare-eager.sh STEPS
    *) echo "compare-eager: unknown option $1 (known: --steps N, --rounds N, --ranks8)" >&2; exit 2 ;;
  esac
done
((steps >= 3 && rounds >= 1)) || { echo "compare-eager: --steps >= 3 (2 are warm-up) and --rounds >= 1" >&2; exit 2; }
torch_py=build/venv-hf/bin/python3
if ! "$torch_py" -c "import torch" 2>/dev/null; then
  echo "compare-eager: no PyTorch in build/venv-hf: run scripts/setup.sh --hf (about 2.9 GB to download)" >&2
  exit 1
fi
[[ -x build/fp8moe ]] || { echo "compare-eager: no build/fp8moe: run scripts/setup.sh" >&2; exit 1; }
source scripts/mpi-env.sh
out=build/bench-eager
mkdir -p "$out"
if [[ ! -f $out/lic.train.idx ]]; then
  build/fp8moe prepare-data --input /usr/share/common-licenses/* --output "$out/lic" --val-fraction 0 >/dev/null
fi
common=(--set data.path="$out/lic.train" --set data.valid_path="" --set train.steps="$steps"
        --set train.warmup_steps=1 --set eval.every=0 --set log.every=1 --set checkpoint.save=false
        --set checkpoint.resume=none)
one_rank=(--set parallel.tensor=1 --set parallel.pipeline=1 --set parallel.expert=1)

# fp8moe's threads: what its one rank reports (its CPUs, or OMP_NUM_THREADS when set).
threads_of() { sed -n 's/^OpenMP threads per rank: \([0-9]*\) .*/\1/p' "$1"; }
build/fp8moe train configs/tiny.yaml "${one_rank[@]}" "${common[@]}" --dry-run >"$out/dry.txt" 2>&1 ||
  { cat "$out/dry.txt" >&2; exit 1; }
threads=$(threads_of "$out/dry.txt")
[[ -n $threads ]] || { echo "compare-eager: no thread count in fp8moe's start-up lines ($out/dry.txt)" >&2; exit 1; }

# median_tps JSONL: tokens per step / the median step_time_s of the steps after the first two.
median_tps() {
  "$torch_py" - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][2:]
tokens = round(rows[0]["tokens_per_s"] * rows[0]["step_time_s"])
print("%.1f" % (tokens / statistics.median(r["step_time_s"] for r in rows)))
PY
}
# run KEY: one run of configuration KEY; appends its tokens/s to $out/KEY.tps.
run() {
  local key=$1 log=$out/$1.txt
  case $key in
    torch_fp32|torch_bf16)
      "$torch_py" bench/eager_pytorch.py "${key#torch_}" "$steps" cpu --threads "$threads" >"$log" 2>&1 ||
        { tail -5 "$log" >&2; exit 1; }
      [[ $(sed -n 's/^threads //p' "$log") == "$threads" ]] || { echo "compare-eager: $key: not on $threads threads" >&2; exit 1; }
      sed -n 's/^tokens_per_s //p' "$log" >>"$out/$key.tps" ;;
    off|blockwise)
      build/fp8moe train configs/tiny.yaml "${one_rank[@]}" "${common[@]}" --set fp8.recipe="$key" \
        --set log.jsonl="$out/$key.jsonl" >"$log" 2>&1 || { tail -5 "$log" >&2; exit 1; }
      [[ $(threads_of "$log") == "$threads" ]] || { echo "compare-eager: $key: not on $threads threads" >&2; exit 1; }
      median_tps "$out/$key.jsonl" >>"$out/$key.tps" ;;
    off8|blockwise8)
      mpirun -np 8 --oversubscribe build/fp8moe train configs/tiny.yaml "${common[@]}" --set fp8.recipe="${key%8}" \
        --set log.jsonl="$out/$key.jsonl" >"$log" 2>&1 || { tail -5 "$log" >&2; exit 1; }
      threads8=$(threads_of "$log")
      median_tps "$out/$key.jsonl" >>"$out/$key.tps" ;;
  esac
}
keys=(torch_fp32 torch_bf16 off blockwise)
((ranks8)) && keys+=(off8 blockwise8)
for k in "${keys[@]}"; do rm -f "$out/$k.tps"; done
threads8=""
load_start=$(cut -d' ' -f1 /proc/loadavg)
for ((r = 1; r <= rounds; r++)); do
  for k in "${keys[@]}"; do
    printf 'compare-eager: round %d of %d: %s\n' "$r" "$rounds" "$k" >&2
    run "$k"
  done
done

load="$load_start $(cut -d' ' -f1 /proc/loadavg)"
version=$("$torch_py" -c 'import torch; print(torch.__version__)')
"$torch_py" - "$out" "$steps" "$rounds" "$threads" "$(nproc)" "$version" "${threads8:-}" "$load" "${keys[@]}" <<'PY'
import statistics, sys
out, steps, rounds, threads, cpus, version, threads8, load, *keys = sys.argv[1:]
runs = {k: [float(x) for x in open(f"{out}/{k}.tps").read().split()] for k in keys}
med = {k: statistics.median(v) for k, v in runs.items()}
names = {
    "torch_fp32": f"eager PyTorch {version} FP32",
    "torch_bf16": f"eager PyTorch {version} BF16 autocast",
    "off": "fp8moe, fp8.recipe off",
    "blockwise": "fp8moe, fp8.recipe blockwise",
    "off8": "fp8moe off, 8 ranks",
    "blockwise8": "fp8moe blockwise, 8 ranks",
}
# The ratios that compare like with like: FP32 with FP32, FP8 with BF16 autocast and with its own
# recipe off.
ratios = {
    "off": {"vs eager FP32": "torch_fp32"},
    "blockwise": {"vs eager BF16": "torch_bf16", "vs fp8moe off": "off"},
    "off8": {"vs eager FP32": "torch_fp32"},
    "blockwise8": {"vs eager BF16": "torch_bf16", "vs fp8moe off": "off8"},
}
cols = ["vs eager FP32", "vs eager BF16", "vs fp8moe off"]
print(f"\ntiny.yaml, 8 x 256 tokens per step in 4 micro-batches, AdamW; {steps} steps (2 warm-up), {rounds} "
      f"interleaved round{'s' if rounds != '1' else ''}; tokens/s = tokens per step / median step time, median "
      "over the rounds")
print(f"threads: fp8moe 1 rank x {threads}, eager PyTorch torch.set_num_threads({threads}); {cpus} CPUs")
if threads8:
    print(f"8 ranks: tiny.yaml's layout (tensor 2 x pipeline 2 x data 2, expert 2), mpirun -np 8 --oversubscribe, "
          f"{threads8} thread{'s' if threads8 != '1' else ''} each")
start, end = load.split()
print(f"load average (1 min) {start} at the start, {end} at the end: other work on the {cpus} CPUs slows some "
      "rounds (their range)")
def table(values, with_range):
    head = "| run | tokens/s |" + (" rounds (min-max) |" if with_range else "") + "".join(f" {c} |" for c in cols)
    print(head)
    print("| --- | ---: |" + (" ---: |" if with_range else "") + " ---: |" * len(cols))
    for k in keys:
        cells = [f"{values[k] / values[ratios[k][c]]:.2f}x" if c in ratios.get(k, {}) else "" for c in cols]
        span = f" {min(runs[k]):.0f}-{max(runs[k]):.0f} |" if with_range else ""
        print(f"| {names[k]} | {values[k]:.0f} |{span} {' | '.join(cells)} |")


table(med, True)
# NOTE: the machine's other work only ever slows a run; on a busy machine the best round of each
# configuration is the nearer to its speed alone, and the medians say little.
busy = [k for k in keys if max(runs[k]) > 2 * min(runs[k])]
if busy:
    print(f"\nNOTE: the rounds of {len(busy)} of the {len(keys)} runs differ by more than 2x: the machine was busy "
          "and those medians are not reliable. The best round of each:")
    table({k: max(v) for k, v in runs.items()}, False)
PY
