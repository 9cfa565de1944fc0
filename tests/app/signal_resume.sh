#!/usr/bin/env bash
# The signal contract under mpirun: a signal, twice (the second during the stop), to a 2-rank run
# -> the ranks agree on a stop step, commit a checkpoint and exit 3; the rerun resumes from it and
# every later loss equals the uninterrupted run's bit for bit; a finished run exits 0.
#   usr1: SIGUSR1 to mpirun, which forwards it to the ranks (Slurm's --signal=B:USR1@... path);
#   term: SIGTERM to every rank directly, as slurmstepd sends it at the time limit or on scancel
#         (mpirun itself, given SIGTERM, kills its job: not the path a rank's handler sees).
#
# usage: signal_resume.sh FP8MOE MPIEXEC [usr1|term]
set -uo pipefail
exe=$1 mpiexec=$2 how=${3:-usr1}
[[ $how == usr1 || $how == term ]] || { echo "signal_resume: usr1 or term, not '$how'" >&2; exit 2; }
source "$(dirname "$0")/common.sh"
tmp=$(mktemp -d /tmp/fp8moe-signal-XXXXXX)
ompi_session_dir "$tmp"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

prepare_licence_data "$exe" "$tmp/data/lic" || fail "prepare-data"
small_moe_config "$tmp/cfg.yaml" "$tmp/data/lic" 400 50 "{dir: $tmp/ckpt, every: 100, keep_last: 2}"
train() { "$mpiexec" -n 2 "$exe" train "$tmp/cfg.yaml" "$@"; }

train --set checkpoint.dir="$tmp/ref" >"$tmp/ref.txt" 2>&1 || fail "uninterrupted run: $(tail -3 "$tmp/ref.txt")"
"$mpiexec" -n 2 "$exe" train "$tmp/cfg.yaml" >"$tmp/a.txt" 2>&1 &  # not through the function: $! must be mpirun
launcher=$!
for _ in $(seq 200); do grep -q "^step *20/" "$tmp/a.txt" && break; sleep 0.05; done
send() {
  if [[ $how == usr1 ]]; then
    kill -USR1 "$launcher" 2>/dev/null
  else
    pgrep -f "$exe train $tmp/cfg.yaml" | grep -v "^$launcher$" | xargs -r kill -TERM 2>/dev/null
  fi
}
send
sleep 0.05
send
wait "$launcher"
status=$?
[[ $status == 3 ]] || fail "signalled run exited $status, not 3: $(tail -5 "$tmp/a.txt")"
stop=$(sed -n 's/^exit 3: checkpointed at step \([0-9]*\);.*/\1/p' "$tmp/a.txt")
[[ -n $stop && $stop -lt 400 ]] || fail "no stop step in: $(tail -5 "$tmp/a.txt")"
"$exe" ckpt verify "$tmp/ckpt" >/dev/null || fail "the checkpoint of the stop is not valid"
train >"$tmp/b.txt" 2>&1 || fail "resumed run: $(tail -5 "$tmp/b.txt")"
# checkpoint.keep_last 2 of the saves at steps 100, 200, 300 and 400: the newest two remain.
kept=$(cd "$tmp/ref" && echo step_*)
[[ $kept == "step_00000300 step_00000400" ]] || fail "keep_last 2 left: $kept"
grep -q "resumed from $tmp/ckpt/step_$(printf %08d "$stop"): step $stop" "$tmp/b.txt" || fail "did not resume from step $stop"
cat "$tmp/a.txt" "$tmp/b.txt" | loss_bits | sort -n -k1,1 -u >"$tmp/got.txt"
loss_bits <"$tmp/ref.txt" >"$tmp/want.txt"
diff -q "$tmp/want.txt" "$tmp/got.txt" >/dev/null || fail "losses differ from the uninterrupted run: $(diff "$tmp/want.txt" "$tmp/got.txt" | head -4)"
echo "signal: SIG${how^^} x2 after step 20 -> stopped at step $stop with a checkpoint, exit 3; resumed -> exit 0;" \
  "all 400 losses bitwise equal to the uninterrupted run; keep_last 2 kept $kept"
