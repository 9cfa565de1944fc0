#!/usr/bin/env bash
# slurm/train.sbatch against a real single-node Slurm started here (auth/none, no systemd):
# submit a 2-rank run, signal its batch shell with `scancel --signal=USR1 --batch`, check that it
# checkpoints and requeues itself (Restarts=1), release the requeued job at once (scontrol update
# StartTime=now: it would be held ~2 minutes), let it resume and finish, and compare every loss
# with an uninterrupted mpirun run bit for bit. The daemons are stopped by PID at the end, also on
# failure. Prints the timeline.
#
# usage: slurm_requeue.sh FP8MOE MPIEXEC SOURCE_DIR
set -uo pipefail
exe=$1 mpiexec=$2 src=$3
for tool in slurmctld slurmd sbatch scontrol scancel squeue sinfo; do
  command -v $tool >/dev/null || { echo "[  SKIPPED ] $tool not installed (scripts/setup.sh installs slurm-wlm)"; exit 77; }
done
source "$(dirname "$0")/../app/common.sh"
tmp=$(mktemp -d /tmp/fp8moe-slurm-XXXXXX)
ompi_session_dir "$tmp"
export SLURM_CONF=$tmp/slurm.conf
t0=$(date +%s.%N)
stamp() { printf "%7.1f s  %s\n" "$(echo "$(date +%s.%N) - $t0" | bc)" "$*"; }
stop_slurm() {
  for f in "$tmp/slurmd.pid" "$tmp/slurmctld.pid"; do [[ -f $f ]] && kill "$(cat "$f")" 2>/dev/null; done
  sleep 1
  for f in "$tmp/slurmd.pid" "$tmp/slurmctld.pid"; do [[ -f $f ]] && kill -9 "$(cat "$f")" 2>/dev/null; done
  rm -rf "$tmp"
}
trap stop_slurm EXIT
fail() {
  echo "FAIL: $*" >&2
  [[ -f $tmp/job.out ]] && tail -20 "$tmp/job.out" >&2
  [[ -f $tmp/slurmctld.log ]] && tail -5 "$tmp/slurmctld.log" >&2
  [[ -f $tmp/slurmd.log ]] && tail -5 "$tmp/slurmd.log" >&2
  squeue -o "%i %T %r" >&2
  exit 1
}

host=$(hostname -s)
mkdir -p "$tmp/spool" "$tmp/state"
cat >"$SLURM_CONF" <<CONF
ClusterName=fp8moetest
SlurmctldHost=$host(127.0.0.1)
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmdSpoolDir=$tmp/spool
StateSaveLocation=$tmp/state
SlurmctldLogFile=$tmp/slurmctld.log
SlurmdLogFile=$tmp/slurmd.log
SlurmUser=root
ReturnToService=2
JobRequeue=1
NodeName=$host CPUs=$(getconf _NPROCESSORS_ONLN) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start"
slurmd -f "$SLURM_CONF" || fail "slurmd did not start"
for _ in $(seq 50); do sinfo -h -o %t 2>/dev/null | grep -q idle && break; sleep 0.2; done
sinfo -h -o %t | grep -q idle || fail "the node did not come up"
stamp "slurmctld and slurmd up"

prepare_licence_data "$exe" "$tmp/data/lic" || fail "prepare-data"
small_moe_config "$tmp/cfg.yaml" "$tmp/data/lic" 600 100 "{dir: $tmp/ckpt, every: 200, keep_last: 2}"
"$mpiexec" -n 2 "$exe" train "$tmp/cfg.yaml" --set checkpoint.dir="$tmp/ref" >"$tmp/ref.txt" 2>&1 || fail "reference run"
stamp "uninterrupted reference run (mpirun -np 2) done"

job=$(FP8MOE=$exe sbatch --parsable --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1 --time=10 \
        --output="$tmp/job.out" --error="$tmp/job.out" "$src/slurm/train.sbatch" "$tmp/cfg.yaml") || fail "sbatch"
stamp "submitted job $job (slurm/train.sbatch, 2 tasks)"
for _ in $(seq 150); do grep -q "^step *30/" "$tmp/job.out" 2>/dev/null && break; sleep 0.1; done
grep -q "^step *30/" "$tmp/job.out" || fail "the job did not reach step 30"
scancel --signal=USR1 --batch "$job" || fail "scancel --signal=USR1 --batch"
stamp "scancel --signal=USR1 --batch $job"
for _ in $(seq 300); do grep -q "requeueing job" "$tmp/job.out" && break; sleep 0.1; done
stop=$(sed -n 's/^exit 3: checkpointed at step \([0-9]*\);.*/\1/p' "$tmp/job.out")
[[ -n $stop ]] || fail "no checkpoint on the signal"
stamp "checkpoint committed at step $stop, fp8moe exited 3"
grep -q "requeueing job $job" "$tmp/job.out" || fail "the batch script did not requeue"
for _ in $(seq 100); do scontrol show job "$job" 2>/dev/null | grep -q 'Restarts=1' && break; sleep 0.1; done
scontrol show job "$job" | grep -q 'Restarts=1' || fail "the job was not requeued (Restarts=1)"
stamp "requeued: Restarts=1, state $(squeue -h -j "$job" -o %T)"
# Release at once (Slurm holds a requeued job ~2 minutes), but only after the first run's step is
# fully cleaned up: a new step 1.0 of the same job id racing the old one's PMIx teardown fails.
for _ in $(seq 400); do pgrep -f "slurmstepd: \[$job\." >/dev/null || break; sleep 0.1; done
for _ in $(seq 100); do scontrol update JobId="$job" StartTime=now 2>/dev/null && break; sleep 0.2; done
stamp "released: scontrol update JobId=$job StartTime=now"
for _ in $(seq 1200); do grep -q "^fp8moe: finished" "$tmp/job.out" && break; sleep 0.1; done
grep -q "^fp8moe: finished" "$tmp/job.out" || fail "the requeued job did not finish"
grep -q "restart 1 on" "$tmp/job.out" || fail "the second run did not see SLURM_RESTART_COUNT=1"
grep -q "resumed from $tmp/ckpt/step_$(printf %08d "$stop"): step $stop" "$tmp/job.out" || fail "did not resume from step $stop"
stamp "restart 1 resumed from step $stop and finished (exit 0, not requeued)"

loss_bits <"$tmp/job.out" | sort -n -k1,1 -u >"$tmp/got.txt"
loss_bits <"$tmp/ref.txt" >"$tmp/want.txt"
[[ $(wc -l <"$tmp/want.txt") == 600 ]] || fail "the reference has $(wc -l <"$tmp/want.txt") losses"
diff -q "$tmp/want.txt" "$tmp/got.txt" >/dev/null || fail "losses differ: $(diff "$tmp/want.txt" "$tmp/got.txt" | head -4)"
stamp "all 600 losses of the two runs bitwise equal to the uninterrupted run's"
