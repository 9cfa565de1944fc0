#!/usr/bin/env bash
# A rank's OpenMP threads follow the CPUs mpirun binds it to (parallel/cpu_binding.h), checked
# against the binding the same launch gives a plain process (its Cpus_allowed_list), on a dry run
# of tiny.yaml on 1 and 2 ranks (the threads are set before a dry run stops):
#  - `mpirun -np 1`: Open MPI binds one rank to one core: threads = that core's CPUs, and the one
#    warning that the node's other CPUs idle, with their count and the two launch forms;
#  - `mpirun -np 1 --bind-to none`: threads = this machine's CPUs (nproc), no warning;
#  - `mpirun -np 2`: a core each (2 ranks sharing one binding split it): rank 0's CPUs and sharers,
#    and the warning exactly when the two bindings leave CPUs idle;
#  - OMP_NUM_THREADS=3 still overrides, and says so.
# SKIPPED (77) on one CPU (no binding can leave one idle), or where `mpirun -np 1` binds to every CPU.
#
# usage: threads_binding.sh FP8MOE MPIEXEC
set -uo pipefail
exe=$1 mpiexec=$2
source "$(dirname "$0")/common.sh"
unset OMP_NUM_THREADS  # common.sh sets one thread per rank: here the count is what is tested
config=$(cd "$(dirname "$0")/../.." && pwd)/configs/tiny.yaml
cpus=$(nproc)
if ((cpus < 2)); then
  echo "[  SKIPPED ] this machine has $cpus CPU: no binding can leave one idle"
  exit 77
fi
tmp=$(mktemp -d /tmp/fp8moe-threads-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
ompi_session_dir "$tmp"
fail() { echo "FAIL ($case): $*" >&2; exit 1; }

# bindings ARGS...: "RANK CPU,CPU,..." per rank of `mpirun ARGS`, from each rank's Cpus_allowed_list.
bindings() {
  "$mpiexec" "$@" bash -c 'echo "$OMPI_COMM_WORLD_RANK $(sed -n "s/^Cpus_allowed_list:\s*//p" /proc/self/status)"' |
    sort -n | awk '{ n = split($2, r, ","); s = ""
      for (i = 1; i <= n; i++) { m = split(r[i], b, "-"); hi = m == 2 ? b[2] : b[1]
        for (c = b[1]; c <= hi; c++) s = s (s == "" ? "" : ",") c }
      print $1, s }'
}
count() { awk -F, '{ print NF }' <<<"$1"; }
union_count() { tr ',' '\n' <<<"$1" | sort -un | wc -l; }
# dry_run ARGS...: the output of a dry run of tiny.yaml on one data-parallel layout under `mpirun ARGS`.
dry_run() {
  "$mpiexec" "$@" "$exe" train "$config" --set parallel.tensor=1 --set parallel.pipeline=1 \
    --set parallel.expert=1 --dry-run >"$tmp/out.txt" 2>&1 || fail "exit $?: $(tail -3 "$tmp/out.txt")"
  threads=$(sed -n 's/^OpenMP threads per rank: \([0-9]*\) .*/\1/p' "$tmp/out.txt")
  local launch="launch with \`mpirun --bind-to none\` .* or \`mpirun --map-by slot:pe=N\`"
  warnings=$(grep -c "^fp8moe: warning: .* idle; $launch" "$tmp/out.txt")
}
summary=""

case="mpirun -np 1"
read -r _ b0 < <(bindings -np 1)
bound=$(count "$b0")
dry_run -np 1
[[ $threads == "$bound" ]] || fail "threads '$threads', not the $bound CPUs of its binding ($b0): $(grep OpenMP "$tmp/out.txt")"
skip_idle=""
if ((bound < cpus)); then
  want="fp8moe: warning: the 1 rank of this node is bound to $bound of its $cpus CPUs, $((cpus - bound)) idle;"
  [[ $warnings == 1 ]] && grep -qF "$want" "$tmp/out.txt" ||
    fail "not one warning '$want...': $(grep warning "$tmp/out.txt")"
  summary+="  $case: bound to CPUs $b0 of $cpus: $threads thread(s) and the warning"$'\n'
else
  [[ $warnings == 0 ]] || fail "a warning, but the binding $b0 covers all $cpus CPUs"
  skip_idle="mpirun -np 1 binds to all $cpus CPUs here: no idle CPUs to report"
fi

case="mpirun -np 1 --bind-to none"
dry_run -np 1 --bind-to none
[[ $threads == "$cpus" ]] || fail "threads '$threads', not this machine's $cpus CPUs: $(grep OpenMP "$tmp/out.txt")"
[[ $warnings == 0 ]] || fail "a warning: $(grep warning "$tmp/out.txt")"
summary+="  $case: $threads threads, no warning"$'\n'

case="mpirun -np 2"
mapfile -t two < <(bindings -np 2)
r0=${two[0]#* } r1=${two[1]#* }
sharing=1
[[ $r0 == "$r1" ]] && sharing=2
dry_run -np 2
grep -qF "rank 0: $(count "$r0") / $sharing" "$tmp/out.txt" ||
  fail "not 'rank 0: $(count "$r0") / $sharing' (bindings $r0 and $r1): $(grep OpenMP "$tmp/out.txt")"
want=0
(($(union_count "$r0,$r1") < cpus)) && want=1
[[ $warnings == "$want" ]] || fail "$warnings warnings, expected $want (bindings $r0 and $r1 of $cpus CPUs)"
summary+="  $case: bindings $r0 and $r1: $threads thread(s), $warnings warning(s)"$'\n'

case="OMP_NUM_THREADS=3 mpirun -np 1 --bind-to none"
OMP_NUM_THREADS=3 dry_run -np 1 --bind-to none -x OMP_NUM_THREADS
grep -q "^OpenMP threads per rank: 3 (OMP_NUM_THREADS" "$tmp/out.txt" || fail "$(grep OpenMP "$tmp/out.txt")"
summary+="  $case: 3 threads (OMP_NUM_THREADS)"$'\n'

printf '%s' "$summary"
if [[ -n $skip_idle ]]; then
  echo "[  SKIPPED ] the idle-CPU warning: $skip_idle"
  exit 77
fi
echo "threads_binding: passed"
