// Hugging Face interchange: `fp8moe export` (a checkpoint as a DeepSeek-V3 safetensors directory)
// and `fp8moe import` (such a directory as a step-0 checkpoint). Formats and names: io/hf_format.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fp8moe {

struct ExportOptions {
  std::string checkpoint, out_dir;
  std::string dtype = "bf16";  // bf16 | fp32 | fp8
  std::string max_shard_size = "5e9";  // bytes per file at most: digits or E notation (run_export checks it)
};
int run_export(const ExportOptions& o);

struct ImportOptions {
  std::string hf_dir, checkpoint_dir, config_path;
  std::vector<std::string> overrides;
};
// Starts MPI (one process, or a job under mpirun: every rank reads its shard).
int run_import(const ImportOptions& o, int* argc, char*** argv);

}  // namespace fp8moe
