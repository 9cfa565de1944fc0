#!/usr/bin/env bash
# The watchdog (runtime.timeout_s): one rank of a RANKS-rank run is frozen with SIGSTOP mid-training;
# the others wait in a collective it never joins. Within the limit + 10 s the job must end with
# exit 4 and a report naming the rank, the step and phase, and the call it is stuck in; then a
# rerun resumes from the last committed checkpoint. Then a rank frozen in the middle of a save,
# through FP8MOE_CKPT_STOP, which only the tests' build FP8MOE_FAULTS (fp8moe-faults) reads.
#
# usage: watchdog.sh FP8MOE MPIEXEC RANKS FP8MOE_FAULTS
set -uo pipefail
exe=$1 mpiexec=$2 ranks=$3 faults_exe=$4
source "$(dirname "$0")/common.sh"
tmp=$(mktemp -d /tmp/fp8moe-watchdog-XXXXXX)
ompi_session_dir "$tmp"
cleanup() {
  pkill -KILL -f "$tmp/cfg.yaml" 2>/dev/null  # a frozen rank the launcher left behind
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
limit=3

prepare_licence_data "$exe" "$tmp/data/lic" || fail "prepare-data"
small_moe_config "$tmp/cfg.yaml" "$tmp/data/lic" 100000 0 "{dir: $tmp/ckpt, every: 10, keep_last: 2}"
echo "runtime: {timeout_s: $limit}" >>"$tmp/cfg.yaml"

# Saves every 20 steps here, so that the freeze after step 25 lands mid-training and not inside the
# save of step 30 (steps take ~4 ms: with saves every 10, a CI run once froze a rank in that save,
# and the close's guard ended the job before the watchdog's report); the save is the second part's.
every=(--set checkpoint.every=20)
"$mpiexec" -n "$ranks" "$exe" train "$tmp/cfg.yaml" "${every[@]}" >"$tmp/a.txt" 2>"$tmp/a.err" &
launcher=$!
for _ in $(seq 3000); do grep -q "^step *25/" "$tmp/a.txt" && break; sleep 0.01; done
grep -q "^step *25/" "$tmp/a.txt" || fail "the run did not reach step 25: $(tail -3 "$tmp/a.err")"
victim=$(pgrep -f "$exe train $tmp/cfg.yaml" | grep -v "^$launcher$" | tail -1)
[[ -n $victim ]] || fail "no rank process found"
kill -STOP "$victim"
t0=$(date +%s%N)
( sleep $((limit + 30)); kill -KILL "$launcher" 2>/dev/null ) &
guard=$!
wait "$launcher"
status=$?
t1=$(date +%s%N)
kill "$guard" 2>/dev/null
ms=$(((t1 - t0) / 1000000))
took=$((ms / 1000)).$((ms % 1000 / 100))
[[ $status == 4 ]] || fail "a frozen rank: exit $status, not 4, after $took s: $(tail -3 "$tmp/a.err")"
((ms <= (limit + 10) * 1000)) || fail "the job ended $took s after the freeze, more than $limit + 10"
report=$(grep -m1 "no progress for" "$tmp/a.err") || fail "no watchdog report: $(tail -3 "$tmp/a.err")"
[[ $report =~ rank\ [0-9]+:\ no\ progress\ for\ [0-9]+\ s.*step\ [0-9]+\ \(.*\),\ in\ .* ]] ||
  fail "the report does not name the rank, step, phase and call: $report"
kill -KILL "$victim" 2>/dev/null

# The rerun resumes from the newest committed checkpoint (a multiple of 20, at least 20).
last=$(sed -n 's/^checkpoint .*step_\([0-9]*\) committed$/\1/p' "$tmp/a.txt" | tail -1)
[[ -n $last ]] || fail "no checkpoint was committed before the freeze"
"$mpiexec" -n "$ranks" "$exe" train "$tmp/cfg.yaml" "${every[@]}" --set train.steps=$((10#$last + 2)) >"$tmp/b.txt" 2>&1 ||
  fail "the rerun failed: $(tail -3 "$tmp/b.txt")"
grep -q "resumed from $tmp/ckpt/step_$last" "$tmp/b.txt" || fail "the rerun did not resume from step_$last"
echo "watchdog: SIGSTOP of 1 of $ranks ranks after step 25 -> exit 4 after $took s" \
  "(runtime.timeout_s $limit); report: ${report#fp8moe: error: }; the rerun resumed from step_$last"

# The last rank freezes itself in the middle of a checkpoint save (after its third dataset of the
# save at step 10): the others wait inside HDF5's collectives; still exit 4 within the limit + 10 s.
rm -rf "$tmp/ckpt"
t0=$(date +%s%N)
timeout $((limit + 30)) "$mpiexec" -n "$ranks" -x FP8MOE_CKPT_STOP=$((ranks - 1)):3 "$faults_exe" train "$tmp/cfg.yaml" \
  >"$tmp/c.txt" 2>"$tmp/c.err"
status=$?
ms=$((($(date +%s%N) - t0) / 1000000))
pkill -KILL -f "$tmp/cfg.yaml" 2>/dev/null
[[ $status == 4 ]] || fail "a rank frozen mid-save: exit $status, not 4: $(tail -3 "$tmp/c.err")"
report=$(grep -m1 "no progress for" "$tmp/c.err") || fail "no report for the frozen save: $(tail -3 "$tmp/c.err")"
[[ $report == *"after step 10"* ]] || fail "the report does not place the freeze after step 10: $report"
echo "  frozen mid-save (FP8MOE_CKPT_STOP, the save of step 10): exit 4 after $ms ms in all; report: ${report#fp8moe: error: }"

# frozen_wait NAME WHAT ARGS...: the last rank freezes itself before its third wait
# (FP8MOE_WAIT_STOP); the job exits 4 within the limit + 10 s, with a report naming the step.
frozen_wait() {
  local name=$1 what=$2
  shift 2
  local t0 status ms report
  t0=$(date +%s%N)
  timeout $((limit + 30)) "$mpiexec" -n "$ranks" -x FP8MOE_WAIT_STOP=$((ranks - 1)):3 "$faults_exe" train "$tmp/cfg.yaml" \
    --set checkpoint.save=false "$@" >"$tmp/$name.txt" 2>"$tmp/$name.err"
  status=$?
  ms=$((($(date +%s%N) - t0) / 1000000))
  pkill -KILL -f "$tmp/cfg.yaml" 2>/dev/null
  [[ $status == 4 ]] || fail "a rank frozen $what: exit $status, not 4: $(tail -3 "$tmp/$name.err")"
  ((ms <= (limit + 10) * 1000 + 15000)) || fail "the job ended $ms ms after its start, more than the limit + 10 s (+ 15 s to start)"
  report=$(grep -m1 "no progress for" "$tmp/$name.err") || fail "no report for the rank frozen $what: $(tail -3 "$tmp/$name.err")"
  [[ $report =~ step\ [0-9]+ ]] || fail "the report does not name the step: $report"
  echo "  frozen $what (FP8MOE_WAIT_STOP, its third wait): exit 4 after $ms ms in all; report: ${report#fp8moe: error: }"
}

# The last rank freezes itself inside an overlapped collective: before its third wait for the
# data-parallel gradients' reduce-scatter, which every rank posted during its backward
# (optim.overlap_grad_reduce, on by default). Its peers cannot finish that reduction, or the next
# collective.
frozen_wait d "in an overlapped reduce-scatter wait" --set optim.overlap_grad_reduce=true

# The same inside a MoE layer: with the 2 experts over the ranks (expert parallelism) and the
# gradient reduction in line, the last rank's third wait is for an expert exchange it posted
# (runtime.overlap_expert_comm, on by default; one MoE layer: the forward's dispatch, the
# backward's, then the backward's combine, posted behind the experts' weight gradients); its peer
# blocks in the next exchange (on 4 ranks the other expert group's ranks in the data-parallel
# reduction, which may report first).
frozen_wait e "in an expert exchange's wait" --set optim.overlap_grad_reduce=false --set parallel.expert=2

# The same with micro-batches in pairs (parallel.pair_micro_batches): the third wait is the
# backward's dispatch of the first pair, on the pair's second thread (parallel/pass_pair.h).
frozen_wait p "inside a pair of micro-batches" --set optim.overlap_grad_reduce=false --set parallel.expert=2 \
  --set parallel.micro_batches=2 --set train.global_batch=$((2 * ranks)) --set parallel.pair_micro_batches=true
