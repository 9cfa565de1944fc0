#!/usr/bin/env bash
# Resume must tell "absent" from "cannot read" (checkpoint.resume: auto, run as the user `nobody`,
# so that file permissions apply): a checkpoint directory, its `latest` or its newest checkpoint.h5
# that cannot be read stops the run with exit 2, naming the path and the error, before any training
# step — never a fresh start and never a fall-back to an older checkpoint (which the next save would
# then replace). An absent directory still starts afresh. Skipped (77) where this is not root.
#
# usage: checkpoint_unreadable.sh FP8MOE
set -uo pipefail
exe=$1
source "$(dirname "$0")/common.sh"
if [[ $(id -u) != 0 ]] || ! command -v setpriv >/dev/null; then
  echo "SKIPPED: needs root and setpriv to run as another user"
  exit 77
fi
tmp=$(mktemp -d /tmp/fp8moe-unreadable-XXXXXX)
trap 'chmod -R u+rwX "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
fail() { echo "FAIL ($case): $*" >&2; exit 1; }
as_nobody() { setpriv --reuid=nobody --regid=nogroup --clear-groups env HOME="$tmp" "$@"; }
case=set-up

prepare_licence_data "$exe" "$tmp/data" || fail "prepare-data"
small_moe_config "$tmp/cfg.yaml" "$tmp/data" 20 0 "{dir: $tmp/ck, every: 10, keep_last: 3}"
chown -R nobody:nogroup "$tmp"
as_nobody "$exe" train "$tmp/cfg.yaml" >"$tmp/a.txt" 2>&1 || fail "the first run: $(tail -3 "$tmp/a.txt")"
[[ -f $tmp/ck/step_00000020/checkpoint.h5 ]] || fail "no step_20"

summary=""
expect_refusal() {  # PATH: the run must exit 2 naming PATH and "Permission denied", before step 1
  as_nobody "$exe" train "$tmp/cfg.yaml" --set train.steps=30 >"$tmp/b.txt" 2>&1
  local status=$?
  [[ $status == 2 ]] || fail "exit $status, not 2: $(grep -m2 "error\|WARNING\|^step" "$tmp/b.txt")"
  local message
  message=$(grep -m1 "fp8moe: error:" "$tmp/b.txt") || fail "no error message"
  [[ $message == *"$1"*"Permission denied"* ]] || fail "the message does not name $1 and the error: $message"
  grep -q "^step " "$tmp/b.txt" && fail "it trained: $(grep -m1 "^step " "$tmp/b.txt")"
  grep -q "falling back\|resumed from" "$tmp/b.txt" && fail "it fell back: $(grep -m1 "falling back\|resumed from" "$tmp/b.txt")"
  summary+="  $case: exit 2; ${message#fp8moe: error: }"$'\n'
}

case=directory
chmod 000 "$tmp/ck"
expect_refusal "$tmp/ck"
chmod 755 "$tmp/ck"

case=latest
chmod 000 "$tmp/ck/latest"
expect_refusal "$tmp/ck/latest"
chmod 644 "$tmp/ck/latest"

case=newest-file
chmod 000 "$tmp/ck/step_00000020/checkpoint.h5"
expect_refusal "$tmp/ck/step_00000020/checkpoint.h5"
chmod 644 "$tmp/ck/step_00000020/checkpoint.h5"
[[ -f $tmp/ck/step_00000010/checkpoint.h5 && $(cat "$tmp/ck/latest") == step_00000020 ]] || fail "the checkpoints changed"

case=absent
as_nobody "$exe" train "$tmp/cfg.yaml" --set checkpoint.dir="$tmp/none" --set train.steps=3 >"$tmp/c.txt" 2>&1 ||
  fail "an absent directory: $(tail -3 "$tmp/c.txt")"
grep -q "^step *1/3" "$tmp/c.txt" || fail "an absent directory did not start afresh"

case=readable
as_nobody "$exe" train "$tmp/cfg.yaml" --set train.steps=22 >"$tmp/d.txt" 2>&1 || fail "the readable rerun: $(tail -3 "$tmp/d.txt")"
grep -q "resumed from $tmp/ck/step_00000020" "$tmp/d.txt" || fail "the readable rerun did not resume from step_20"

echo "checkpoint_unreadable (as nobody): an absent checkpoint.dir starts afresh; the readable one resumes; unreadable:"
printf '%s' "$summary" | cut -c1-220
