#!/usr/bin/env bash
# log.trace and optim.overlap_grad_reduce: tiny.yaml (on the licence texts) in its 8-rank layout (tensor 2 x pipeline 2 x
# expert 2 x data 2) and a 4-rank one with expert-data replicas (expert 2 x data 4) trace step 2.
# scripts/trace.py check: every rank's file is valid trace JSON, every posted collective's post
# comes before its wait, and a reduction of dp (and edp) ran while a backward computed. Without
# overlap the same run posts no collective (its only async pairs are the pipeline's sends) and trains the same loss bits (2 replicas:
# a sum of two is the same in any order). The metrics carry comm_exposed_s. And
# runtime.ranks_per_node: 4 ranks of ep4 as 2 simulated nodes of 2 split the expert rows' bytes
# into in-node and across-node, each equal to its formula (1 peer in the node, 2 outside); a
# ranks_per_node that does not divide the world is exit 2. The relay across those nodes
# (runtime.node_dedup) keeps the loss bits and sends fewer bytes across (below). A run that stops
# inside the traced steps writes what it recorded. runtime.overlap_expert_comm: each expert
# exchange is posted and waited for inside one forward or backward (the shared expert's and the
# experts' weight-gradient work behind it), and in line the loss bits are the same (with and
# without the relay). parallel.pair_micro_batches: a forward and a backward interleaved on every
# rank, an expert exchange of one travelling while the other computes, the same loss bits.
#
# usage: trace.sh FP8MOE MPIEXEC PYTHON SOURCE_DIR
set -uo pipefail
exe=$1 mpiexec=$2 python=$3 src=$4
source "$(dirname "$0")/common.sh"
tmp=$(mktemp -d /tmp/fp8moe-trace-XXXXXX)
ompi_session_dir "$tmp"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

prepare_licence_data "$exe" "$tmp/data/lic" || fail "prepare-data"
common=(--set train.steps=3 --set train.warmup_steps=1 --set checkpoint.save=false --set eval.every=0
        --set data.path="$tmp/data/lic.train" --set data.valid_path="$tmp/data/lic.val")
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

run inline8 8 --set log.trace="$tmp/inline8" --set optim.overlap_grad_reduce=false --set runtime.overlap_expert_comm=false
# parallel.pair_micro_batches (one stage: tensor 2 x expert 2 x data 4): a forward and a backward
# at a time (parallel/pass_pair.h), against the same layout without.
one_stage=(--set parallel.pipeline=1 --set parallel.micro_batches=2)
run paired8 8 "${one_stage[@]}" --set log.trace="$tmp/paired8" --set parallel.pair_micro_batches=true
run single8 8 "${one_stage[@]}" --set log.trace="$tmp/single8"
"$python" "$src/scripts/trace.py" check "$tmp/paired8" --overlap dp || fail "paired8 trace check"

# A run that ends inside the window (train.exit_interval after step 2 of a window of steps 2-3)
# writes what it recorded.
run early4 4 --set parallel.tensor=1 --set parallel.pipeline=1 --set parallel.micro_batches=2 --set log.trace="$tmp/early4" \
  --set log.trace_steps=2 --set checkpoint.save=true --set checkpoint.dir="$tmp/ckpt" --set train.exit_interval=2
[[ $(ls "$tmp/early4" | wc -l) == 4 ]] || fail "early end: expected 4 rank files: $(ls "$tmp/early4")"
"$python" "$src/scripts/trace.py" check "$tmp/early4" --overlap dp || fail "early4 trace check"
"$python" - "$tmp" <<'PY' || fail "checks of the merged trace, the in-line run and the metrics"
import glob, json, sys
tmp = sys.argv[1]
merged = json.load(open(f"{tmp}/merged.json"))["traceEvents"]
assert {e["pid"] for e in merged} == set(range(8)), "merged: one pid per rank"
assert any(e["ph"] == "b" and e["cat"] == "dp" for e in merged), "merged: posted dp reductions"
for path in glob.glob(f"{tmp}/inline8/rank*.json"):
    ev = json.load(open(path))["traceEvents"]
    assert not [e for e in ev if e["ph"] in ("b", "e") and e["name"] != "send"], f"{path}: posted collectives without overlap"
    assert any(e["ph"] == "b" and e["name"] == "send" and e["cat"] == "pp" for e in ev), f"{path}: no pipeline send"
    assert any(e["ph"] == "X" and e.get("cat") == "dp" and e["name"] == "reduce_scatterv" for e in ev), path
# runtime.overlap_expert_comm (on by default): every expert exchange posted inside a MoE layer's
# forward or backward is waited for inside it (the shared expert, the experts' weight gradients
# between), each rank's forward and backward post some.
for path in glob.glob(f"{tmp}/tiny8/rank*.json"):
    ev = json.load(open(path))["traceEvents"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e["ph"] == "X" and e["name"] in ("forward", "backward")]
    posts = {e["id"]: e["ts"] for e in ev if e["ph"] == "b" and e["cat"] == "ep"}
    ends = {e["id"]: e["ts"] for e in ev if e["ph"] == "e" and e["cat"] == "ep"}
    assert posts and set(posts) == set(ends), f"{path}: posted ep exchanges {len(posts)}, ended {len(ends)}"
    assert all(any(a <= posts[i] <= ends[i] <= b for a, b in spans) for i in posts), f"{path}: an ep exchange outside a forward or backward"
    for kind in ("forward", "backward"):
        assert any(any(a <= t <= b for a, b in [(e["ts"], e["ts"] + e["dur"])] for t in posts.values())
                   for e in ev if e["ph"] == "X" and e["name"] == kind), f"{path}: no ep exchange posted in a {kind}"
# Pairs: on every rank a forward and a backward of two micro-batches interleaved (their spans
# overlap), and an expert exchange of one posted while the other computed: a compute span of the
# other kind starts between its post and its end.
for path in glob.glob(f"{tmp}/paired8/rank*.json"):
    ev = json.load(open(path))["traceEvents"]
    span = {k: [(e["ts"], e["ts"] + e["dur"]) for e in ev if e["ph"] == "X" and e["name"] == k] for k in ("forward", "backward")}
    assert any(a < d and c < b for a, b in span["forward"] for c, d in span["backward"]), f"{path}: no pair interleaved"
    posts = {e["id"]: e["ts"] for e in ev if e["ph"] == "b" and e["cat"] == "ep"}
    ends = {e["id"]: e["ts"] for e in ev if e["ph"] == "e" and e["cat"] == "ep"}
    behind = 0
    for i in posts:
        for kind, other in (("forward", "backward"), ("backward", "forward")):
            inside = any(a <= posts[i] <= ends[i] <= b for a, b in span[kind])
            if inside and any(posts[i] < a < ends[i] for a, _ in span[other]): behind += 1
    assert behind > 0, f"{path}: no expert exchange travelled while the other pass computed"
    # (inside a pair the forward's combine is posted too: more posted exchanges than without pairs)
    alone = json.load(open(path.replace("paired8", "single8")))["traceEvents"]
    n_alone = len([e for e in alone if e["ph"] == "b" and e["cat"] == "ep"])
    assert len(posts) > n_alone, f"{path}: {len(posts)} exchanges posted in pairs, {n_alone} without"
for name in ("tiny8", "inline8", "edp4", "paired8"):
    rows = [json.loads(l) for l in open(f"{tmp}/{name}.jsonl")]
    for r in rows:
        assert 0 <= r["comm_exposed_s"] < r["step_time_s"], (name, r)
PY
run nodes4 4 --set parallel.tensor=1 --set parallel.pipeline=1 --set parallel.expert=4 --set parallel.micro_batches=2 \
  --set runtime.ranks_per_node=2 --set log.every=1
# The relay across nodes (runtime.node_dedup, on by default) gives the experts the same rows as
# sending each row straight to its expert's rank, and sums the input gradients' rows of a token in
# the node before they cross back: step 1's loss the same bits (the forward's exchanges are the
# same), later steps within 5e-4 (the gradients' sums in another order), fewer bytes across nodes.
# With node-limited routing (2 groups of 4 experts, one per simulated node; 1 group per token) and
# the gates in the experts (whose forward combine is summed in the node too, in BF16), each
# token's row crosses at most once per exchange, step 1 within 1e-6, and every group still equals
# its formula.
node_split() {  # NAME -> "in_measured across_measured", after checking both against their formulas
  local in x in_m in_a in_r x_m x_a x_r
  in=$(awk '$1 == "ep-in" {print $2, $3, $4}' "$tmp/$1.txt")
  x=$(awk '$1 == "ep-x" {print $2, $3, $4}' "$tmp/$1.txt")
  read -r in_m in_a in_r <<<"$in"
  read -r x_m x_a x_r <<<"$x"
  [[ $in_r == 1.000 && $x_r == 1.000 && $in_m == "$in_a" && $x_m == "$x_a" ]] || fail "$1 node split: in '$in' across '$x'"
  awk '$1 == "ep" {exit !($4 == "1.000" && $2 == $3)}' "$tmp/$1.txt" || fail "$1: ep against its formula: $(grep ' ep ' "$tmp/$1.txt")"
  echo "$in_m $x_m"
}
# The relay's exchanges posted (the default) and in line: the same loss bits.
run nodes4i 4 --set parallel.tensor=1 --set parallel.pipeline=1 --set parallel.expert=4 --set parallel.micro_batches=2 \
  --set runtime.ranks_per_node=2 --set log.every=1 --set runtime.overlap_expert_comm=false
run direct4 4 --set parallel.tensor=1 --set parallel.pipeline=1 --set parallel.expert=4 --set parallel.micro_batches=2 \
  --set runtime.ranks_per_node=2 --set runtime.node_dedup=false --set log.every=1
split=$(node_split nodes4) || exit 1
read -r _ relay_x <<<"$split"
split=$(node_split direct4) || exit 1
read -r direct_in direct_x <<<"$split"
(( direct_in > 0 && direct_x > direct_in )) || fail "node split: in $direct_in across $direct_x (2 peers across, 1 in the node)"
(( relay_x < direct_x )) || fail "the relay sent $relay_x bytes across nodes, straight $direct_x"
grep -q "relay (runtime.node_dedup)" "$tmp/nodes4.txt" || fail "no relay line: $(grep -A4 ep-in "$tmp/nodes4.txt")"
! grep -q "relay (runtime.node_dedup)" "$tmp/direct4.txt" || fail "a relay line without the relay"
limited=(--set parallel.tensor=1 --set parallel.pipeline=1 --set parallel.expert=4 --set parallel.micro_batches=2
         --set runtime.ranks_per_node=2 --set model.moe.n_group=2 --set model.moe.topk_group=1 --set train.moe_gates=expert
         --set log.every=1)
run limited4 4 "${limited[@]}"
run limited4d 4 "${limited[@]}" --set runtime.node_dedup=false
split=$(node_split limited4) || exit 1
read -r _ lim_x <<<"$split"
split=$(node_split limited4d) || exit 1
read -r _ lim_dx <<<"$split"
(( lim_x < lim_dx )) || fail "node-limited: the relay sent $lim_x bytes across nodes, straight $lim_dx"
per_token=$(sed -n 's/.*routed tokens (\([0-9.]*\) per token).*/\1/p' "$tmp/limited4.txt")
[[ -n $per_token ]] && awk -v p="$per_token" 'BEGIN {exit !(p > 0 && p <= 1)}' ||
  fail "node-limited to 1 node: $per_token token rows across nodes per token: $(grep relay "$tmp/limited4.txt")"
grep relay "$tmp/limited4.txt"
"$mpiexec" -n 4 "$exe" train "$src/configs/tiny.yaml" "${common[@]}" --set parallel.tensor=1 --set parallel.pipeline=1 \
  --set parallel.expert=4 --set parallel.micro_batches=2 --set runtime.ranks_per_node=3 >"$tmp/bad.txt" 2>&1
status=$?
[[ $status == 2 ]] || fail "ranks_per_node 3 of 4 ranks: exit $status, expected 2"
grep -q "runtime.ranks_per_node.*a divisor of the world size 4" "$tmp/bad.txt" || fail "no message: $(tail -3 "$tmp/bad.txt")"

bits() { loss_bits <"$tmp/$1.txt"; }
[[ -n $(bits tiny8) && $(bits tiny8) == "$(bits inline8)" ]] || fail "overlap changed the loss bits: $(bits tiny8) vs $(bits inline8)"
[[ -n $(bits single8) && $(bits single8) == "$(bits paired8)" ]] || fail "pairs changed the loss bits: $(bits single8) vs $(bits paired8)"
[[ -n $(bits nodes4) && $(bits nodes4) == "$(bits nodes4i)" ]] || fail "the relay posted changed the loss bits: $(bits nodes4) vs $(bits nodes4i)"
close() {  # A B STEP1_BOUND: every step's loss of run A within 5e-4 of run B's (relative), step 1's within STEP1_BOUND
  "$python" - "$tmp/$1.txt" "$tmp/$2.txt" "$3" <<'PY'
import re, sys
def losses(path):
    return {int(m[1]): float.fromhex(m[2]) for m in re.finditer(r"^step +(\d+)/.*\[(.*)\]$", open(path).read(), re.M)}
a, b, first = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
assert sorted(a) == sorted(b) == [1, 2, 3], (sorted(a), sorted(b))
for s in a:
    d = abs(a[s] - b[s]) / abs(b[s])
    print(f"step {s}: relative {d:.2e}")
    assert d <= (first if s == 1 else 5e-4), (s, a[s], b[s])
PY
}
close nodes4 direct4 0 || fail "the relay against the direct exchange, gates at combine"
close limited4 limited4d 1e-6 || fail "the relay against the direct exchange, node-limited routing, gates in the experts"
echo "trace: ok"
