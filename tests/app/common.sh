# Shared by the shell tests (source it): Open MPI as root and oversubscribed, one OpenMP thread per
# rank, the small MoE they train, its data set, and the loss bits of the metrics lines.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1

# ompi_session_dir DIR: this test's own Open MPI session directory, DIR/ompi. Open MPI 4 races on
# creating a shared one when two jobs start at once (open-mpi/ompi#8510), as they do under ctest -j.
ompi_session_dir() {
  mkdir -p "$1/ompi"
  export OMPI_MCA_orte_tmpdir_base=$1/ompi
}

# 2 blocks (one dense, one MoE with 2 routed experts and a shared one): few checkpoint datasets.
SMALL_MOE_MODEL='model: {d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, head_dim: 16, first_dense_layers: 1, d_ff_dense: 64,
        moe: {n_experts: 2, top_k: 1, n_shared_experts: 1, d_expert: 32}}'

# small_moe_config FILE DATA STEPS EVAL_EVERY CHECKPOINT: the config the MPI shell tests train
# (delayed FP8 on the small MoE, data prefix DATA); CHECKPOINT is the checkpoint section (YAML flow).
small_moe_config() {
  cat >"$1" <<CFG
$SMALL_MOE_MODEL
train: {steps: $3, warmup_steps: 2, global_batch: 4, seq_len: 32, lr: 3.0e-3, min_lr: 3.0e-4}
fp8: {recipe: delayed, amax_history_len: 4}
eval: {every: $4, batches: 1}
log: {every: 1}
data: {path: $2.train, valid_path: $2.val}
checkpoint: $5
CFG
}

# prepare_licence_data FP8MOE PREFIX: four licence texts, byte-level, 30% of them for validation.
prepare_licence_data() {
  "$1" prepare-data --output "$2" --val-fraction 0.3 --seed 5 \
    --input /usr/share/common-licenses/{GPL-3,GPL-2,LGPL-3,Apache-2.0} >/dev/null
}

# loss_bits < LOG: "STEP LOSS" per metrics line, the loss as its exact bits (%a).
loss_bits() { sed -n 's/^step *\([0-9]*\)\/.*\[\(.*\)\]$/\1 \2/p'; }

# gpu_work_dir FP8MOE TAG: exits 77 (SKIPPED, with the reason) unless FP8MOE sees a CUDA device;
# else sets $tmp to a fresh directory (removed on exit) with its own Open MPI session directory.
gpu_work_dir() {
  if ! "$1" --version 2>/dev/null | grep -q "GPUs: *[0-9]* visible"; then
    echo "[  SKIPPED ] no CUDA device visible ($("$1" --version 2>&1 | sed -n 's/^ *GPUs: *//p'))"
    exit 77
  fi
  tmp=$(mktemp -d "/tmp/fp8moe-$2-XXXXXX")
  ompi_session_dir "$tmp"
  trap 'rm -rf "$tmp"' EXIT
}
