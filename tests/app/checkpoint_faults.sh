#!/usr/bin/env bash
# Kills a rank of a 2-rank training job during a checkpoint save, at every save event of rank 0
# (each dataset written, the close, the agreement, fsync, rename, latest, each deletion) and of
# rank 1 (each dataset written, the close), through FP8MOE_CKPT_KILL, of a blocking save and of an
# asynchronous one (the copy to host memory, then the writer thread's events); then at random moments with
# a real `kill -9` while the job saves every step. After every kill: <dir>/latest must name a
# complete checkpoint that `fp8moe ckpt verify` accepts, and (every few kills, and always after a
# random one) training must resume from it and reproduce the uninterrupted run's loss bit for bit.
# Every other random kill waits for a save in progress (a step_*.tmp directory) and kills then.
# A run counts as killed only when mpirun reports the signal (any other failure fails the test);
# no checkpoint may be lost (latest never older than the last "committed" the run printed); at
# least MIN_DURING_SAVE kills must have landed inside a save (left its step_*.tmp behind; measured:
# 9 of 12, twice, on a 2-core VM).
#
# FP8MOE is the tests' build, fp8moe-faults (the product has no fault points: io/checkpoint_faults.h).
#
# usage: checkpoint_faults.sh FP8MOE_FAULTS MPIEXEC [RANDOM_KILLS] [MIN_DURING_SAVE]
set -uo pipefail
exe=$1 mpiexec=$2 random_kills=${3:-12} min_during_save=${4:-4}
source "$(dirname "$0")/common.sh"
export OMPI_MCA_odls_base_sigkill_timeout=0  # a killed job ends at once

tmp=$(mktemp -d /tmp/fp8moe-faults-XXXXXX)
ompi_session_dir "$tmp"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

prepare_licence_data "$exe" "$tmp/data/lic" || fail "prepare-data"
# Few datasets (2 routed experts): the sweep below kills once per save event.
small_moe_config "$tmp/cfg.yaml" "$tmp/data/lic" 40 0 "{dir: $tmp/base, keep_last: 1}"
export FP8MOE_CKPT_KILL=""  # RANK:K kills rank RANK at its K-th save event (io/checkpoint_faults.h)
train() { "$mpiexec" -n 2 -x FP8MOE_CKPT_KILL "$exe" train "$tmp/cfg.yaml" "$@"; }
loss_of() { grep -o "^step *$1/[0-9]* .*\[.*\]" | sed 's/.*\[\(.*\)\]/\1/'; }

# The uninterrupted reference, and a checkpoint at step 4 to start each faulty save from.
train --set checkpoint.dir="$tmp/ref" >"$tmp/ref.txt" 2>&1 || fail "reference run: $(tail -5 "$tmp/ref.txt")"
train --set train.exit_interval=4 >/dev/null 2>&1 || fail "base run"
[[ $(cat "$tmp/base/latest") == step_00000004 ]] || fail "base run did not leave step 4"

killed_by_signal() { grep -q "exited on signal 9" "$1"; }  # mpirun's report of a SIGKILLed rank
check_dir() {  # $1: dir, $2: what happened; prints the step latest names
  local d=$1 name
  name=$(cat "$d/latest" 2>/dev/null) || fail "$2: $d/latest is missing"
  [[ $name == step_00000004 || $name == step_00000005 ]] || fail "$2: latest names '$name'"
  "$exe" ckpt verify "$d" >"$tmp/verify.txt" 2>&1 || fail "$2: latest is not valid: $(cat "$tmp/verify.txt")"
  echo "$name"
}
resume_and_compare() {  # $1: dir; trains one step from latest and compares its loss with the reference's
  local d=$1 n want got
  n=$((10#$(sed 's/step_//' "$d/latest") + 1))
  train --set checkpoint.dir="$d" --set train.exit_interval=$n >"$tmp/resume.txt" 2>&1 || fail "resume from $d: $(tail -5 "$tmp/resume.txt")"
  want=$(loss_of $n <"$tmp/ref.txt")
  got=$(loss_of $n <"$tmp/resume.txt")
  [[ -n $want && $want == "$got" ]] || fail "resumed loss of step $n is '$got', uninterrupted '$want'"
}

kills=0 lost=0 resumed=0 before=0 after=0
# sweep RANK LABEL ARGS...: kills rank RANK at its save event 1, 2, ... of a run with ARGS, each
# time from the step-4 checkpoint, until a run ends (K past the last event; its output stays in
# $tmp/run.txt); after every kill `latest` must be valid, and every 8th kill the run resumes
# bit-exact. Sets $events.
sweep() {
  local rank=$1 label=$2 k=1 status name
  shift 2
  while :; do
    rm -rf "$tmp/w" && cp -r "$tmp/base" "$tmp/w"
    FP8MOE_CKPT_KILL=$rank:$k train --set checkpoint.dir="$tmp/w" "$@" >"$tmp/run.txt" 2>&1
    status=$?
    [[ $status == 0 ]] && break
    killed_by_signal "$tmp/run.txt" || fail "$label, rank $rank, save event $k: exit $status without the kill: $(tail -5 "$tmp/run.txt")"
    kills=$((kills + 1))
    name=$(check_dir "$tmp/w" "$label: rank $rank killed at save event $k") || exit 1
    [[ $name == step_00000004 ]] && before=$((before + 1)) || after=$((after + 1))
    if ((k % 8 == 1)); then resume_and_compare "$tmp/w"; resumed=$((resumed + 1)); fi
    k=$((k + 1))
  done
  events=$((k - 1))
  ((k > 20)) || fail "$label: rank $rank had only $events save events: FP8MOE_CKPT_KILL not honoured?"
}
for rank in 0 1; do
  sweep $rank "blocking save" --set train.exit_interval=5
  echo "rank $rank: $events save events, each one killed"
done
# The same sweep over an asynchronous save (checkpoint.async true; auto blocks on the cpu device): the
# save at step 5 is copied to host memory (a fault point halfway through the copy) and written by
# the writer thread while steps 6 and 7 train; train.exit_interval 7 then saves again (blocking)
# and ends the run. Every event of the step-5 save is killed on each rank.
async_events=()
for rank in 0 1; do
  sweep $rank "asynchronous save" --set checkpoint.every=5 --set checkpoint.async=true --set checkpoint.keep_last=3 \
    --set train.exit_interval=7
  grep -q "^checkpoint step 5: copied .* writing in the background$" "$tmp/run.txt" ||
    fail "the step-5 save did not run in the background: $(grep -m3 checkpoint "$tmp/run.txt")"
  # Training went on while it was written: step 6 is reported before the save's commit.
  order=$(grep -o -e "^step *6/" -e "^checkpoint .*step_00000005 committed" "$tmp/run.txt" | head -1)
  [[ $order == step* ]] || fail "the step-5 save committed before step 6 ran: $(grep -e '^step' -e '^checkpoint' "$tmp/run.txt" | sed -n 5,9p)"
  async_events+=("$events")
  echo "rank $rank: $events events of an asynchronous save (the copy's and the writer's), each one killed"
done
# Random real kills of a random rank while the job checkpoints every step, half of the runs in the
# background (checkpoint.async true), half blocking; either way of waiting for a save in progress.
during_save=0 random=0
for ((i = 0; i < 4 * random_kills && random < random_kills; i++)); do
  rm -rf "$tmp/w" && cp -r "$tmp/base" "$tmp/w"
  "$mpiexec" -n 2 "$exe" train "$tmp/cfg.yaml" --set checkpoint.dir="$tmp/w" --set checkpoint.every=1 \
    --set checkpoint.async=$([[ $((i % 4)) -lt 2 ]] && echo true || echo false) >"$tmp/run.txt" 2>&1 &
  launcher=$!
  if ((i % 2 == 0)); then
    sleep "0.$((RANDOM % 7 + 3))$((RANDOM % 10))"
    victim=$(pgrep -f "$exe train $tmp/cfg.yaml" | grep -v "^$launcher$" | shuf -n 1)
  else  # inside a save: the ranks' pids first, then kill as soon as a step_*.tmp appears after step 10
    victim=""
    while [[ -z $victim ]] && kill -0 "$launcher" 2>/dev/null; do
      ranks=($(pgrep -f "$exe train $tmp/cfg.yaml" | grep -v "^$launcher$"))
      ((${#ranks[@]} == 2)) && victim=${ranks[RANDOM % 2]}
    done
    for ((poll = 0; poll < 200000; poll++)); do
      compgen -G "$tmp/w/step_000000[1-9]*.tmp" >/dev/null && break
      kill -0 "$launcher" 2>/dev/null || break
    done
  fi
  [[ -n $victim ]] && kill -9 "$victim" 2>/dev/null
  wait "$launcher"
  status=$?
  if ((status == 0)); then continue; fi  # the run ended before the kill
  killed_by_signal "$tmp/run.txt" || fail "random run $i: exit $status without the kill: $(tail -5 "$tmp/run.txt")"
  kills=$((kills + 1)) random=$((random + 1))
  compgen -G "$tmp/w/step_*.tmp" >/dev/null && during_save=$((during_save + 1))
  name=$(cat "$tmp/w/latest" 2>/dev/null) || fail "random kill $i: latest is missing"
  "$exe" ckpt verify "$tmp/w" >"$tmp/verify.txt" 2>&1 || fail "random kill $i: latest ($name) is not valid: $(cat "$tmp/verify.txt")"
  committed=$(sed -n 's/^checkpoint .*\/\(step_[0-9]*\) committed$/\1/p' "$tmp/run.txt" | tail -1)
  if [[ -n $committed && $name < $committed ]]; then
    lost=$((lost + 1))
    fail "random kill $i: latest names $name, but the run had committed $committed"
  fi
  if [[ $name < step_00000040 ]]; then resume_and_compare "$tmp/w"; resumed=$((resumed + 1)); fi
done
((random >= random_kills)) || fail "only $random of $i random runs were killed before they ended"
((during_save >= min_during_save)) ||
  fail "only $during_save of $random random kills landed inside a save (left a step_*.tmp); wanted $min_during_save"
echo "checkpoint faults: $kills kills (of them every event of an asynchronous save: ${async_events[*]} on ranks 0 and 1;" \
  "$before left step 4 as latest, $after had committed step 5;" \
  "$random random kills in $i runs, $during_save of them inside a save), $resumed resumed bit-exact," \
  "$lost checkpoints lost (latest older than the last committed)"
