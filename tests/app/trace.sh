#!/usr/bin/env bash
# log.trace and optim.overlap_grad_reduce: tiny.yaml's 8-rank layout (tensor 2 x pipeline 2 x
# expert 2 x data 2) and a 4-rank one with expert-data replicas (expert 2 x data 4) trace step 2.
# scripts/trace.py check: every rank's file is valid trace JSON, every posted collective's post
# comes before its wait, and a reduction of dp (and edp) ran while a backward computed. Without
# overlap the same run posts nothing (no async pair) and trains the same loss bits (2 replicas:
# a sum of two is the same in any order). The metrics carry comm_exposed_s.
#
# usage: trace.sh FP8MOE MPIEXEC PYTHON SOURCE_DIR
set -uo pipefail
exe=$1 mpiexec=$2 python=$3 src=$4
source "$(dirname "$0")/common.sh"
tmp=$(mktemp -d /tmp/fp8moe-trace-XXXXXX)
ompi_session_dir "$tmp"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

common=(--set train.steps=3 --set train.warmup_steps=1 --set checkpoint.save=false --set eval.every=0
        --set data.path="$src/data/fortunes.train" --set data.valid_path="$src/data/fortunes.val")
run() {  # NAME RANKS ARGS...
  local name=$1 ranks=$2
  shift 2
  "$mpiexec" -n "$ranks" "$exe" train "$src/configs/tiny.yaml" "${common[@]}" --set log.jsonl="$tmp/$name.jsonl" \
    "$@" >"$tmp/$name.txt" 2>&1 || fail "$name: exit $?: $(tail -5 "$tmp/$name.txt")"
}

run tiny8 8 --set log.trace="$tmp/tiny8"
grep -q "^trace: steps 2-2 in $tmp/tiny8/rank\*.json" "$tmp/tiny8.txt" || fail "no trace line: $(tail -3 "$tmp/tiny8.txt")"
[[ $(ls "$tmp/tiny8" | wc -l) == 8 ]] || fail "expected 8 rank files: $(ls "$tmp/tiny8")"
"$python" "$src/scripts/trace.py" check "$tmp/tiny8" --overlap dp || fail "tiny8 trace check"
"$python" "$src/scripts/trace.py" summary "$tmp/tiny8" >"$tmp/summary.txt" || fail "summary"
cat "$tmp/summary.txt"
"$python" "$src/scripts/trace.py" merge "$tmp/tiny8" -o "$tmp/merged.json" || fail "merge"

run edp4 4 --set parallel.tensor=1 --set parallel.pipeline=1 --set parallel.micro_batches=2 --set log.trace="$tmp/edp4"
"$python" "$src/scripts/trace.py" check "$tmp/edp4" --overlap dp edp || fail "edp4 trace check"

run inline8 8 --set log.trace="$tmp/inline8" --set optim.overlap_grad_reduce=false
"$python" - "$tmp" <<'PY' || fail "checks of the merged trace, the in-line run and the metrics"
import glob, json, sys
tmp = sys.argv[1]
merged = json.load(open(f"{tmp}/merged.json"))["traceEvents"]
assert {e["pid"] for e in merged} == set(range(8)), "merged: one pid per rank"
assert any(e["ph"] == "b" and e["cat"] == "dp" for e in merged), "merged: posted dp reductions"
for path in glob.glob(f"{tmp}/inline8/rank*.json"):
    ev = json.load(open(path))["traceEvents"]
    assert not [e for e in ev if e["ph"] in ("b", "e")], f"{path}: posted collectives without overlap"
    assert any(e["ph"] == "X" and e.get("cat") == "dp" and e["name"] == "reduce_scatterv" for e in ev), path
for name in ("tiny8", "inline8", "edp4"):
    rows = [json.loads(l) for l in open(f"{tmp}/{name}.jsonl")]
    for r in rows:
        assert 0 <= r["comm_exposed_s"] < r["step_time_s"], (name, r)
PY
bits() { loss_bits <"$tmp/$1.txt"; }
[[ -n $(bits tiny8) && $(bits tiny8) == "$(bits inline8)" ]] || fail "overlap changed the loss bits: $(bits tiny8) vs $(bits inline8)"
echo "trace: ok"
