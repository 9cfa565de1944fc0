#!/usr/bin/env bash
# One run per checkpoint directory (io/dir_lock.h): while a run trains on checkpoint.dir, a second
# `fp8moe train` on it is refused at once (exit 2, naming the holder's host and pid) and writes
# nothing there; the first run ends as it would alone; once the holder is SIGKILLed, its stale lock
# is no lock and the next run takes it and resumes the dead run's last checkpoint.
#
# usage: checkpoint_lock.sh FP8MOE MPIEXEC
set -uo pipefail
exe=$1 mpiexec=$2
source "$(dirname "$0")/common.sh"
tmp=$(mktemp -d /tmp/fp8moe-lock-XXXXXX)
ompi_session_dir "$tmp"
first=""
trap '[[ -n $first ]] && kill -9 "$first" 2>/dev/null; rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

prepare_licence_data "$exe" "$tmp/data/lic" || fail "prepare-data"
small_moe_config "$tmp/cfg.yaml" "$tmp/data/lic" 100000 50 "{dir: $tmp/ckpt, every: 20, keep_last: 2}"

# The first run, one process (no launcher: $! is the rank), trains long enough to be in the way.
"$exe" train "$tmp/cfg.yaml" >"$tmp/a.txt" 2>&1 &
first=$!
for _ in $(seq 600); do grep -q "^step *25/" "$tmp/a.txt" && break; sleep 0.05; done
grep -q "^step *25/" "$tmp/a.txt" || fail "the first run did not reach step 25: $(tail -3 "$tmp/a.txt")"
before=$(cd "$tmp/ckpt" && ls -A | sort | tr '\n' ' ')

# The second, under mpirun on 2 ranks, while the first holds the lock.
start=$(date +%s%N)
timeout 60 "$mpiexec" -n 2 --oversubscribe "$exe" train "$tmp/cfg.yaml" >"$tmp/b.txt" 2>&1  # refused at once, not waiting
status=$?
ms=$((($(date +%s%N) - start) / 1000000))
[[ $status == 2 ]] || fail "a second run on a held checkpoint.dir exited $status, not 2: $(tail -3 "$tmp/b.txt")"
grep -q "^fp8moe: error: checkpoint.dir: $tmp/ckpt is in use by fp8moe train, host $(hostname), pid $first, started " \
  "$tmp/b.txt" || fail "the refusal does not name the holder: $(cat "$tmp/b.txt")"
(($(grep -c "fp8moe: error:" "$tmp/b.txt") == 1)) || fail "not one error line: $(cat "$tmp/b.txt")"
grep -q "^step " "$tmp/b.txt" && fail "the refused run trained"
kill -0 "$first" 2>/dev/null || fail "the first run did not survive the second's start: $(tail -3 "$tmp/a.txt")"

# The holder dies without a word; the lock file stays, the lock does not.
holder=$first
kill -9 "$first"
wait "$first" 2>/dev/null
first=""
[[ -f $tmp/ckpt/.fp8moe.lock ]] || fail "no lock file in the checkpoint.dir"
last=$(cat "$tmp/ckpt/latest")
"$exe" train "$tmp/cfg.yaml" --set train.steps=$((10#${last#step_} + 5)) >"$tmp/c.txt" 2>&1 ||
  fail "after the holder's death, a run was refused: $(tail -3 "$tmp/c.txt")"
grep -q "resumed from $tmp/ckpt/$last" "$tmp/c.txt" || fail "did not resume the dead run's $last: $(head -5 "$tmp/c.txt")"
echo "checkpoint lock: a second run (2 ranks) refused with exit 2 in $ms ms naming pid $holder, its host and start;" \
  "checkpoint.dir held [${before% }] then; after SIGKILL of the holder the next run took the lock and resumed $last"
