#!/usr/bin/env bash
# The checkpoint save's fault points (io/checkpoint_faults.h) are in the tests' build only: the
# product `fp8moe` holds none of the variables' names, and a 2-rank run of it with
# FP8MOE_CKPT_KILL, FP8MOE_CKPT_STOP and FP8MOE_CKPT_FILL set at the save's first event commits
# its checkpoint (exit 0, `ckpt verify` accepts it); the same run of `fp8moe-faults` is killed
# there (the control: the variables are the ones the fault build reads).
#
# usage: checkpoint_faults_not_in_product.sh FP8MOE FP8MOE_FAULTS MPIEXEC
set -uo pipefail
exe=$1 faults_exe=$2 mpiexec=$3
source "$(dirname "$0")/common.sh"
export OMPI_MCA_odls_base_sigkill_timeout=0  # a killed job ends at once
tmp=$(mktemp -d /tmp/fp8moe-nofaults-XXXXXX)
ompi_session_dir "$tmp"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

names=(FP8MOE_CKPT_KILL FP8MOE_CKPT_STOP FP8MOE_CKPT_FILL FP8MOE_EXPORT_KILL FP8MOE_EXPORT_STOP FP8MOE_EXPORT_NO_EXCHANGE
       FP8MOE_WAIT_STOP)
for name in "${names[@]}"; do
  grep -q -a "$name" "$exe" && fail "$exe holds the name $name"
  grep -q -a "$name" "$faults_exe" || fail "$faults_exe does not hold the name $name"
done

prepare_licence_data "$exe" "$tmp/data/lic" || fail "prepare-data"
small_moe_config "$tmp/cfg.yaml" "$tmp/data/lic" 3 0 "{dir: $tmp/ck, keep_last: 1}"
run() {  # $1: the executable, $2: the checkpoint directory
  "$mpiexec" -n 2 -x FP8MOE_CKPT_KILL=0:1 -x FP8MOE_CKPT_STOP=1:1 -x FP8MOE_CKPT_FILL=0:first-dataset \
    "$1" train "$tmp/cfg.yaml" --set checkpoint.dir="$2"
}

run "$exe" "$tmp/ck" >"$tmp/a.txt" 2>&1 || fail "the product with the fault variables set: exit $?: $(tail -5 "$tmp/a.txt")"
grep -q "^checkpoint .*step_00000003 committed$" "$tmp/a.txt" || fail "no checkpoint committed: $(tail -5 "$tmp/a.txt")"
[[ $(cat "$tmp/ck/latest") == step_00000003 ]] || fail "latest names '$(cat "$tmp/ck/latest")'"
"$exe" ckpt verify "$tmp/ck" >"$tmp/v.txt" 2>&1 || fail "ckpt verify: $(tail -3 "$tmp/v.txt")"
grep -q "FP8MOE_CKPT" "$tmp/a.txt" && fail "the product mentions a fault variable: $(grep -m1 FP8MOE_CKPT "$tmp/a.txt")"

run "$faults_exe" "$tmp/ck-faults" >"$tmp/b.txt" 2>&1
status=$?
grep -q "exited on signal 9" "$tmp/b.txt" || fail "fp8moe-faults was not killed at the first save event: exit $status"
[[ -e $tmp/ck-faults/latest ]] && fail "fp8moe-faults committed a checkpoint although killed"
echo "the product holds none of ${names[*]}, ignores them set (step_00000003 committed and verified);" \
  "fp8moe-faults was killed at the save's first event"
