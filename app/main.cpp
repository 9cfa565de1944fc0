// fp8moe: the one executable. Subcommands are added as they become real.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>

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

using namespace fp8moe;  // (main.cpp: the one user of every subcommand)

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

// Every subcommand: its options and, once parsed, which one was given.
struct Commands {
  TrainOptions train;
  std::vector<std::string> prep_inputs;
  std::string prep_output, prep_split;
  double prep_val = 0.05;
  uint64_t prep_seed = 1234;
  GenerateOptions gen;
  std::string ckpt_dir;
  ExportOptions exp;
  ImportOptions imp;
  PlanOptions plan;
  CLI::App *train_cmd = nullptr, *prep_cmd = nullptr, *gen_cmd = nullptr, *inspect_cmd = nullptr,
           *verify_cmd = nullptr, *export_cmd = nullptr, *import_cmd = nullptr, *plan_cmd = nullptr,
           *defaults_cmd = nullptr;
};

void add_train(CLI::App& app, Commands& c) {
  c.train_cmd = app.add_subcommand(
      "train", "Validate CONFIG, build the process grid, print both, then train (resuming per checkpoint.resume)");
  c.train_cmd->add_option("config", c.train.config_path, "YAML config file (see `fp8moe defaults`)")->required();
  c.train_cmd->add_option("--set", c.train.overrides, "Override one key: --set train.lr=1e-4 (repeatable)")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  CLI::Option* dry_run = c.train_cmd->add_flag(
      "--dry-run", c.train.dry_run,
      "Validate, build the grid, print the effective config and the layout, exit 0 without training; on a machine "
      "without the configured device (a login node) the device is not checked, and the output says so");
  c.train_cmd->add_option("--world", c.train.world,
                        "With --dry-run, from one process: validate and lay out the run for N ranks (before sbatch)")
      ->type_name("N")
      ->check(CLI::Range(1, 1 << 24))
      ->needs(dry_run);
}

void add_prepare_data(CLI::App& app, Commands& c) {
  c.prep_cmd = app.add_subcommand(
      "prepare-data",
      "Tokenize text files byte by byte (vocabulary 256) into the Megatron indexed data sets PREFIX.train and "
      "PREFIX.val (.bin + .idx); for a BPE tokenizer, scripts/tokenize-data.py");
  c.prep_cmd->add_option("--input", c.prep_inputs, "Input files (each a document unless --split-on)")->required();
  c.prep_cmd->add_option("--output", c.prep_output, "Output prefix")->required();
  c.prep_cmd->add_option("--val-fraction", c.prep_val, "Fraction of documents held out for validation (default 0.05)");
  c.prep_cmd->add_option("--split-on", c.prep_split, "Split inputs into documents at lines equal to this (fortunes: %)");
  c.prep_cmd->add_option("--seed", c.prep_seed, "Seed of the train/validation assignment (default 1234)");
}

void add_generate_and_ckpt(CLI::App& app, Commands& c) {
  c.gen_cmd = app.add_subcommand("generate", "Sample text from a checkpoint (one process, whatever layout trained it)");
  c.gen_cmd->add_option("--checkpoint", c.gen.checkpoint, "A checkpoint.dir (the checkpoint its `latest` names) or one step_<N> directory")
      ->required();
  c.gen_cmd->add_option("--prompt", c.gen.prompt, "Text to continue")->required();
  c.gen_cmd->add_option("--tokens", c.gen.tokens, "Bytes to generate at most (default 200, at most 1000000; stops at a document end; printed as they come)");
  c.gen_cmd->add_option("--temperature", c.gen.temperature, "Sampling temperature; 0 = greedy (default 0.8)");
  c.gen_cmd->add_option("--top-k", c.gen.top_k, "Sample among the k most likely bytes; 0 = all (default 40)");
  c.gen_cmd->add_option("--seed", c.gen.seed, "Sampling seed (default 1)");

  CLI::App* ckpt_cmd = app.add_subcommand("ckpt", "Examine a checkpoint (no MPI launch needed)");
  ckpt_cmd->require_subcommand(1);
  c.inspect_cmd = ckpt_cmd->add_subcommand(
      "inspect", "Step, tokens, config summary and every dataset (global shape, size, checksum status); exit 0 if valid, else 1");
  c.inspect_cmd->add_option("dir", c.ckpt_dir, "A step_<N> directory, or a checkpoint.dir (the one its `latest` names)")
      ->required();
  c.verify_cmd = ckpt_cmd->add_subcommand(
      "verify", "Recompute every checksum and check every dataset against the stored config; exit 0 if valid, else 1");
  c.verify_cmd->add_option("dir", c.ckpt_dir, "A step_<N> directory, or a checkpoint.dir (the one its `latest` names)")
      ->required();
}

void add_export_import(CLI::App& app, Commands& c) {
  c.export_cmd = app.add_subcommand(
      "export",
      "Write a checkpoint (any layout's; one process) as a Hugging Face DeepSeek-V3 model directory: safetensors "
      "shards, model.safetensors.index.json and config.json, read by transformers, vLLM and SGLang");
  c.export_cmd->add_option("checkpoint", c.exp.checkpoint, "A checkpoint.dir (the checkpoint its `latest` names) or one step_<N> directory")
      ->required();
  c.export_cmd->add_option("out_dir", c.exp.out_dir, "The directory to write: made, or replaced whole once the export is complete (an earlier "
                           "export's config.json and weights go, other files stay; a second export into it at once is "
                           "refused)")
      ->required();
  c.export_cmd->add_option("--dtype", c.exp.dtype,
                         "bf16 (default), fp32, or fp8: E4M3 linear weights with 128x128 weight_scale_inv blocks and a "
                         "quantization_config, as DeepSeek-V3 publishes its weights")
      ->check(CLI::IsMember({"bf16", "fp32", "fp8"}));
  c.export_cmd->add_option("--max-shard-size", c.exp.max_shard_size,
                           "Bytes per safetensors file at most: a whole number of bytes from 1 to 1e18, in digits or "
                           "E notation (5000000000 or 5e9, the default; no unit suffix such as GB)")
      ->type_name("BYTES");

  c.import_cmd = app.add_subcommand(
      "import",
      "Read a Hugging Face DeepSeek-V3 model directory (safetensors in BF16, FP16, FP32 or DeepSeek's FP8 form) into a "
      "step-0 checkpoint that training on any layout resumes from (launch with mpirun like train, on any layout: each "
      "rank reads and writes its own shards)");
  c.import_cmd->add_option("hf_dir", c.imp.hf_dir, "The directory with config.json and *.safetensors")->required();
  c.import_cmd->add_option("checkpoint_dir", c.imp.checkpoint_dir, "The checkpoint.dir to write (step_00000000 and `latest`)")
      ->required();
  c.import_cmd->add_option("--config", c.imp.config_path,
                         "The fp8moe config to train with; its model section must match config.json (differences are named)")
      ->required();
  c.import_cmd->add_option("--set", c.imp.overrides, "Override one key of --config, as for train (repeatable)")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

int run(const Commands& c, int* argc, char*** argv) {
  try {
    if (*c.train_cmd) return run_train(c.train, argc, argv);
    if (*c.prep_cmd) {
      try {
        const PrepareReport r = prepare_data(c.prep_inputs, c.prep_output, c.prep_val, c.prep_split, c.prep_seed);
        std::printf("prepare-data: %s.train: %lld documents, %lld tokens; %s.val: %lld documents, %lld tokens\n",
                    c.prep_output.c_str(), (long long)r.train_docs, (long long)r.train_tokens, c.prep_output.c_str(),
                    (long long)r.val_docs, (long long)r.val_tokens);
        return kExitOk;
      } catch (const DataError& e) {
        return usage_error(e.what());
      }
    }
    if (*c.gen_cmd) return launcher_rank() == 0 ? run_generate(c.gen) : kExitOk;
    if (*c.export_cmd) return launcher_rank() == 0 ? run_export(c.exp) : kExitOk;
    if (*c.import_cmd) return run_import(c.imp, argc, argv);
    if (*c.plan_cmd) return launcher_rank() == 0 ? run_plan(c.plan) : kExitOk;
    if (*c.inspect_cmd) return run_ckpt_inspect(c.ckpt_dir);
    if (*c.verify_cmd) return run_ckpt_verify(c.ckpt_dir);
    if (*c.defaults_cmd) {
      if (launcher_rank() == 0) std::fputs(config_reference().c_str(), stdout);
      return kExitOk;
    }
  } catch (const std::exception& e) {
    fatal_error(__FILE__, __LINE__, std::string("unexpected exception: ") + e.what());
  }
  return kExitFailure;
}

}  // namespace

int main(int argc, char** argv) {
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

  Commands c;
  add_train(app, c);
  add_prepare_data(app, c);
  add_generate_and_ckpt(app, c);
  add_export_import(app, c);
  c.plan_cmd = add_plan_command(app, &c.plan);
  c.defaults_cmd = app.add_subcommand(
      "defaults", "Print every config key with its default value, what it accepts and what it means");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {  // --help, --version
      if (launcher_rank() == 0) app.exit(e);
      return kExitOk;
    }
    // A bad command line: fp8moe's one line, like every other usage error (rank 0 only). The other
    // ranks wait a moment before they exit: the launcher aborts the job at the first non-zero exit,
    // which could otherwise come before rank 0 has printed the message (MPI has not started: no
    // barrier to wait at).
    if (launcher_rank() == 0) {
      usage_error(std::string(e.what()) + " (see fp8moe --help)");
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(2));
    }
    return kExitUsage;
  }
  return run(c, &argc, &argv);
}
