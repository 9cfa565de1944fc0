#!/usr/bin/env bash
# A full file system during a checkpoint save, on RANKS ranks (a small tmpfs as checkpoint.dir).
# Each case: step_10 is committed, then the save of step 20 meets a full disk —
#   static         the disk cannot hold a second checkpoint when the save starts;
#   first-dataset, middle, before-close, before-latest
#                  another writer fills it at that point of the save (FP8MOE_CKPT_FILL);
# then the middle and before-close cases in a background save (checkpoint.async true, the save of
# step 20 of a run to step 30);
# and every rank must exit 1 with the message at most 10 s later than the same run would have
# ended without the failure (the blocking cases) (runtime.timeout_s 5: the limit of a close that never returns),
# `latest` must still name step_10 and `ckpt verify` accept it, and once the space is freed the
# next run resumes from it and commits.
# Skipped (77) where a tmpfs cannot be mounted (not root).
#
# FP8MOE is the tests' build, fp8moe-faults (FP8MOE_CKPT_FILL: io/checkpoint_faults.h).
#
# usage: checkpoint_full.sh FP8MOE_FAULTS MPIEXEC RANKS
set -uo pipefail
exe=$1 mpiexec=$2 ranks=$3
source "$(dirname "$0")/common.sh"
tmp=$(mktemp -d /tmp/fp8moe-full-XXXXXX)
ompi_session_dir "$tmp"
mkdir -p "$tmp/fs"
cleanup() {
  umount "$tmp/fs" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL ($case): $*" >&2; exit 1; }
case=set-up
if ! mount -t tmpfs -o size=1m tmpfs "$tmp/fs" 2>"$tmp/mount.err"; then
  echo "SKIPPED: cannot mount a tmpfs for a full checkpoint directory: $(cat "$tmp/mount.err")"
  exit 77
fi
umount "$tmp/fs"

prepare_licence_data "$exe" "$tmp/data/lic" || fail "prepare-data"
# Checkpoints of about 0.5 MB (the space check asks for about 0.7 MB).
small_moe_config "$tmp/cfg.yaml" "$tmp/data/lic" 20 0 "{dir: $tmp/fs/ck, every: 10, keep_last: 1}"
echo "runtime: {timeout_s: 5}" >>"$tmp/cfg.yaml"
fill=()  # mpiexec's options for the failing run
train() { "$mpiexec" -n "$ranks" "${fill[@]}" "$exe" train "$tmp/cfg.yaml" --set train.global_batch=6 "$@"; }

summary=""
for case in static first-dataset middle before-close before-latest; do
  size=2000k
  [[ $case == static ]] && size=900k
  mount -t tmpfs -o size=$size tmpfs "$tmp/fs" || fail "mount"
  fill=()
  t0=$(date +%s%N)
  train --set train.steps=10 >"$tmp/a.txt" 2>&1 || fail "the run to step 10: $(tail -3 "$tmp/a.txt")"
  base_ms=$((($(date +%s%N) - t0) / 1000000))  # start-up, 10 steps and a save: what the next run does besides failing
  [[ $case != static ]] && fill=(-x "FP8MOE_CKPT_FILL=0:$case")
  t0=$(date +%s%N)
  train >"$tmp/b.txt" 2>&1
  status=$?
  fill=()
  ms=$((($(date +%s%N) - t0) / 1000000))
  [[ $status == 1 ]] || fail "exit $status, not 1: $(grep -m3 "error\|fatal" "$tmp/b.txt")"
  message=$(grep -m1 "fp8moe: error: .*checkpoint save failed" "$tmp/b.txt") || fail "no message: $(tail -5 "$tmp/b.txt")"
  # Too full at the start: found by the space check, before HDF5 opens a file.
  [[ $case != static || $message == *"No space left on device: the checkpoint needs about"* ]] ||
    fail "not found by the space check: $message"
  grep -q "Segmentation\|core dumped" "$tmp/b.txt" && fail "a crash: $(grep -m1 "Segmentation\|core dumped" "$tmp/b.txt")"
  # The failing run does what the run to step 10 did (start-up, resume instead of initialisation,
  # 10 steps, a save) and then fails: it may take 10 s longer, no more.
  ((ms <= base_ms + 10000)) || fail "the failing run took $ms ms, the run to step 10 $base_ms ms: more than 10 s longer"
  [[ $(cat "$tmp/fs/ck/latest") == step_00000010 ]] || fail "latest names '$(cat "$tmp/fs/ck/latest")', not step_00000010"
  "$exe" ckpt verify "$tmp/fs/ck" >"$tmp/v.txt" 2>&1 || fail "ckpt verify rejects latest: $(tail -3 "$tmp/v.txt")"
  # Free the space: the other writer's file goes; the static case's file system grows.
  rm -f "$tmp/fs/ck/fill.bin"
  [[ $case == static ]] && { mount -o remount,size=2000k "$tmp/fs" || fail "remount"; }
  train >"$tmp/c.txt" 2>&1 || fail "the rerun after freeing the space: $(grep -m2 "error" "$tmp/c.txt")"
  grep -q "resumed from $tmp/fs/ck/step_00000010" "$tmp/c.txt" || fail "the rerun did not resume from step_10"
  [[ $(cat "$tmp/fs/ck/latest") == step_00000020 ]] || fail "the rerun did not commit step_20"
  summary+="  $case: exit 1 after $ms ms (the run to step 10: $base_ms ms); ${message#fp8moe: error: }"$'\n'
  umount "$tmp/fs"
done
# The same in a background save (checkpoint.async): the periodic save of step 20 of a run to step
# 30 fills the disk while steps 21.. train; the failure ends the run on every rank with exit 1 and
# the message, latest still names step_10, and the rerun resumes from it.
for case in async-middle async-before-close; do
  mount -t tmpfs -o size=2000k tmpfs "$tmp/fs" || fail "mount"
  fill=()
  train --set train.steps=10 >"$tmp/a.txt" 2>&1 || fail "the run to step 10: $(tail -3 "$tmp/a.txt")"
  fill=(-x "FP8MOE_CKPT_FILL=0:${case#async-}")
  t0=$(date +%s%N)
  train --set train.steps=30 --set checkpoint.async=true >"$tmp/b.txt" 2>&1
  status=$?
  fill=()
  ms=$((($(date +%s%N) - t0) / 1000000))
  grep -q "^checkpoint step 20: copied .* writing in the background$" "$tmp/b.txt" ||
    fail "the step-20 save did not run in the background: $(grep -m3 "checkpoint" "$tmp/b.txt")"
  [[ $status == 1 ]] || fail "exit $status, not 1: $(grep -m3 "error\|fatal" "$tmp/b.txt")"
  message=$(grep -m1 "fp8moe: error: .*checkpoint save failed" "$tmp/b.txt") || fail "no message: $(tail -5 "$tmp/b.txt")"
  grep -q "Segmentation\|core dumped" "$tmp/b.txt" && fail "a crash: $(grep -m1 "Segmentation\|core dumped" "$tmp/b.txt")"
  [[ $(cat "$tmp/fs/ck/latest") == step_00000010 ]] || fail "latest names '$(cat "$tmp/fs/ck/latest")', not step_00000010"
  "$exe" ckpt verify "$tmp/fs/ck" >"$tmp/v.txt" 2>&1 || fail "ckpt verify rejects latest: $(tail -3 "$tmp/v.txt")"
  rm -f "$tmp/fs/ck/fill.bin"
  train --set train.steps=30 --set checkpoint.async=true >"$tmp/c.txt" 2>&1 || fail "the rerun after freeing the space: $(grep -m2 "error" "$tmp/c.txt")"
  grep -q "resumed from $tmp/fs/ck/step_00000010" "$tmp/c.txt" || fail "the rerun did not resume from step_10"
  [[ $(cat "$tmp/fs/ck/latest") == step_00000030 ]] || fail "the rerun did not commit step_30"
  summary+="  $case: exit 1 after $ms ms; ${message#fp8moe: error: }"$'\n'
  umount "$tmp/fs"
done
echo "checkpoint_full on $ranks rank(s): latest named step_10 and verified after every failure; the reruns resumed"
printf '%s' "$summary" | cut -c1-220
