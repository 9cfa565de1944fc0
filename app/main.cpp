// fp8moe: the one executable. Subcommands are added as they become real.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "app/ckpt.h"
#include "app/exit_codes.h"
#include "app/generate.h"
#include "app/hf.h"
#include "app/plan.h"
#include "app/train.h"
#include "io/build_info.h"
#include "io/config.h"
#include "io/token_data.h"
#include "kernels/backend_info.h"
#include "kernels/check.h"
#include "parallel/mpi_session.h"

namespace {

// Before MPI starts, the launcher's environment says which rank this process is: only rank 0
// prints command-line help and errors (every rank still exits with the same status).
int launcher_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"})
    if (const char* v = std::getenv(var)) return std::atoi(v);
  return 0;
}

std::string version_text() {
  std::string s = "fp8moe " FP8MOE_VERSION ", C++20, built with GCC " __VERSION__;
#ifdef FP8MOE_HAVE_CUDA
  s += ", CUDA backend for sm_" FP8MOE_CUDA_ARCHS;
#else
  s += ", CPU backend only";
#endif
  s += "\n  MPI:        " + fp8moe::mpi_library_version() + "\n  NCCL:       " + fp8moe::nccl_version() + "\n";
  s += fp8moe::io_build_info();
  s += fp8moe::kernels_build_info();
  if (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace fp8moe;
  CLI::App app{"fp8moe: trains Mixture-of-Experts transformers (DeepSeek-V3 family) in FP8 mixed precision\n"
               "with tensor, pipeline, expert and data parallelism. Launch with mpirun or srun."};
  app.set_version_flag("--version", version_text, "Print the version and the libraries in use, then exit");
  app.require_subcommand(1);
  app.footer(
      "Exit status: 0 success (also after train.exit_interval); 1 internal error (the job is aborted with\n"
      "MPI_Abort), a checkpoint save that failed (the previous one is intact), or a stop signal with\n"
      "checkpoint.save false (nothing saved); 2 bad command line,\n"
      "config, file, checkpoint to resume from or world size (reported once by rank 0, every rank exits 2);\n"
      "3 stopped by SIGUSR1 or SIGTERM after committing a checkpoint: run again (requeue) to continue;\n"
      "4 a rank made no progress for runtime.timeout_s (the watchdog aborted the job): requeue to resume.\n"
      "As root, Open MPI needs OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; more ranks\n"
      "than cores needs mpirun --oversubscribe.");

  TrainOptions train;
  CLI::App* train_cmd = app.add_subcommand(
      "train", "Validate CONFIG, build the process grid, print both, then train (resuming per checkpoint.resume)");
  train_cmd->add_option("config", train.config_path, "YAML config file (see `fp8moe defaults`)")->required();
  train_cmd->add_option("--set", train.overrides, "Override one key: --set train.lr=1e-4 (repeatable)")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  train_cmd->add_flag("--dry-run", train.dry_run,
                      "Validate, build the grid, print the effective config and the layout, exit 0 without training");

  std::vector<std::string> prep_inputs;
  std::string prep_output, prep_split;
  double prep_val = 0.05;
  uint64_t prep_seed = 1234;
  CLI::App* prep_cmd = app.add_subcommand(
      "prepare-data",
      "Tokenize text files byte by byte (vocabulary 256) into the Megatron indexed data sets PREFIX.train and "
      "PREFIX.val (.bin + .idx); for a BPE tokenizer, scripts/tokenize-data.py");
  prep_cmd->add_option("--input", prep_inputs, "Input files (each a document unless --split-on)")->required();
  prep_cmd->add_option("--output", prep_output, "Output prefix")->required();
  prep_cmd->add_option("--val-fraction", prep_val, "Fraction of documents held out for validation (default 0.05)");
  prep_cmd->add_option("--split-on", prep_split, "Split inputs into documents at lines equal to this (fortunes: %)");
  prep_cmd->add_option("--seed", prep_seed, "Seed of the train/validation assignment (default 1234)");

  GenerateOptions gen;
  CLI::App* gen_cmd = app.add_subcommand("generate", "Sample text from a checkpoint (one process, whatever layout trained it)");
  gen_cmd->add_option("--checkpoint", gen.checkpoint, "A checkpoint.dir (the checkpoint its `latest` names) or one step_<N> directory")
      ->required();
  gen_cmd->add_option("--prompt", gen.prompt, "Text to continue")->required();
  gen_cmd->add_option("--tokens", gen.tokens, "Bytes to generate at most (default 200, at most 1000000; stops at a document end; printed as they come)");
  gen_cmd->add_option("--temperature", gen.temperature, "Sampling temperature; 0 = greedy (default 0.8)");
  gen_cmd->add_option("--top-k", gen.top_k, "Sample among the k most likely bytes; 0 = all (default 40)");
  gen_cmd->add_option("--seed", gen.seed, "Sampling seed (default 1)");

  std::string ckpt_dir;
  CLI::App* ckpt_cmd = app.add_subcommand("ckpt", "Examine a checkpoint (no MPI launch needed)");
  ckpt_cmd->require_subcommand(1);
  CLI::App* inspect_cmd = ckpt_cmd->add_subcommand(
      "inspect", "Step, tokens, config summary and every dataset (global shape, size, checksum status); exit 0 if valid, else 1");
  inspect_cmd->add_option("dir", ckpt_dir, "A step_<N> directory, or a checkpoint.dir (the one its `latest` names)")
      ->required();
  CLI::App* verify_cmd = ckpt_cmd->add_subcommand(
      "verify", "Recompute every checksum and check every dataset against the stored config; exit 0 if valid, else 1");
  verify_cmd->add_option("dir", ckpt_dir, "A step_<N> directory, or a checkpoint.dir (the one its `latest` names)")
      ->required();

  ExportOptions exp;
  CLI::App* export_cmd = app.add_subcommand(
      "export",
      "Write a checkpoint (any layout's; one process) as a Hugging Face DeepSeek-V3 model directory: safetensors "
      "shards, model.safetensors.index.json and config.json, read by transformers, vLLM and SGLang");
  export_cmd->add_option("checkpoint", exp.checkpoint, "A checkpoint.dir (the checkpoint its `latest` names) or one step_<N> directory")
      ->required();
  export_cmd->add_option("out_dir", exp.out_dir, "The directory to write (created; config.json and an earlier export's weights there are replaced)")
      ->required();
  export_cmd->add_option("--dtype", exp.dtype,
                         "bf16 (default), fp32, or fp8: E4M3 linear weights with 128x128 weight_scale_inv blocks and a "
                         "quantization_config, as DeepSeek-V3 publishes its weights")
      ->check(CLI::IsMember({"bf16", "fp32", "fp8"}));
  export_cmd->add_option("--max-shard-size", exp.max_shard_bytes, "Bytes per safetensors file at most (default 5e9)")
      ->check(CLI::PositiveNumber);

  ImportOptions imp;
  CLI::App* import_cmd = app.add_subcommand(
      "import",
      "Read a Hugging Face DeepSeek-V3 model directory (safetensors in BF16, FP16, FP32 or DeepSeek's FP8 form) into a "
      "step-0 checkpoint that training on any layout resumes from (launch with mpirun like train, on any layout: each "
      "rank reads and writes its own shards)");
  import_cmd->add_option("hf_dir", imp.hf_dir, "The directory with config.json and *.safetensors")->required();
  import_cmd->add_option("checkpoint_dir", imp.checkpoint_dir, "The checkpoint.dir to write (step_00000000 and `latest`)")
      ->required();
  import_cmd->add_option("--config", imp.config_path,
                         "The fp8moe config to train with; its model section must match config.json (differences are named)")
      ->required();
  import_cmd->add_option("--set", imp.overrides, "Override one key of --config, as for train (repeatable)")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);

  PlanOptions plan;
  CLI::App* plan_cmd = add_plan_command(app, &plan);

  CLI::App* defaults_cmd = app.add_subcommand(
      "defaults", "Print every config key with its default value, what it accepts and what it means");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int status = launcher_rank() == 0 ? app.exit(e) : e.get_exit_code();
    return status == 0 ? kExitOk : kExitUsage;
  }

  try {
    if (*train_cmd) return run_train(train, &argc, &argv);
    if (*prep_cmd) {
      try {
        const PrepareReport r = prepare_data(prep_inputs, prep_output, prep_val, prep_split, prep_seed);
        std::printf("prepare-data: %s.train: %lld documents, %lld tokens; %s.val: %lld documents, %lld tokens\n",
                    prep_output.c_str(), (long long)r.train_docs, (long long)r.train_tokens, prep_output.c_str(),
                    (long long)r.val_docs, (long long)r.val_tokens);
        return kExitOk;
      } catch (const DataError& e) {
        return usage_error(e.what());
      }
    }
    if (*gen_cmd) return launcher_rank() == 0 ? run_generate(gen) : kExitOk;
    if (*export_cmd) return launcher_rank() == 0 ? run_export(exp) : kExitOk;
    if (*import_cmd) return run_import(imp, &argc, &argv);
    if (*plan_cmd) return launcher_rank() == 0 ? run_plan(plan) : kExitOk;
    if (*inspect_cmd) return run_ckpt_inspect(ckpt_dir);
    if (*verify_cmd) return run_ckpt_verify(ckpt_dir);
    if (*defaults_cmd) {
      if (launcher_rank() == 0) std::fputs(config_reference().c_str(), stdout);
      return kExitOk;
    }
  } catch (const std::exception& e) {
    fatal_error(__FILE__, __LINE__, std::string("unexpected exception: ") + e.what());
  }
  return kExitFailure;
}
