#include "app/ckpt.h"

#include <cstdio>

#include "app/exit_codes.h"
#include "io/checkpoint.h"
#include "io/config.h"
#include "model/param_table.h"

namespace fp8moe {
namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "(";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + ")";
}

int report(const std::string& dir, bool verbose) {
  CheckpointReport r;
  try {
    r = inspect_checkpoint(dir, true);
  } catch (const CheckpointError& e) {
    std::fprintf(stderr, "fp8moe: error: %s\n", e.what());
    return kExitFailure;
  }
  int64_t bytes = 0;
  for (const auto& d : r.datasets) bytes += d.bytes;
  if (verbose) {
    std::printf("checkpoint %s\n  format version %lld, step %lld, %lld sequences, %lld tokens consumed\n",
                r.file.c_str(), (long long)r.format_version, (long long)r.step, (long long)r.samples,
                (long long)r.tokens);
    std::printf("  written by %s under %s\n", r.code_version.c_str(), r.layout.c_str());
    try {
      const Config c = load_config(ConfigSource{r.file + " (stored config)", r.config_yaml, {}}, 0);
      const ModelConfig& m = c.model;
      char attn[160];
      if (m.mla())
        std::snprintf(attn, sizeof attn, "%d MLA heads (q_lora %d, kv_lora %d, qk %d + %d rotary, v %d)", m.n_heads,
                      m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
      else
        std::snprintf(attn, sizeof attn, "%d heads (%d kv) x %d", m.n_heads, m.n_kv_heads, m.head_dim);
      std::printf("  model: vocab %d, d_model %d, %d layers (%d dense), %s, %d routed experts "
                  "top-%d + %d shared, d_expert %d; %lld trainable parameters\n",
                  m.vocab_size, m.d_model, m.n_layers, m.first_dense_layers, attn, m.moe.n_experts, m.moe.top_k,
                  m.moe.n_shared_experts, m.moe.d_expert, (long long)build_param_table(m).trainable_numel());
      std::printf("  train: %lld steps, global batch %d x %d tokens, lr %g; fp8 recipe %s; moments %s\n",
                  (long long)c.train.steps, c.train.global_batch, c.train.seq_len, c.train.lr,
                  std::string(to_string(c.fp8.recipe)).c_str(), std::string(to_string(c.train.moments_dtype)).c_str());
    } catch (const std::exception& e) {
      std::printf("  config: unreadable (%s)\n", e.what());
    }
    std::printf("  %zu datasets, %.1f MB\n\n  %-48s %-14s %-9s %12s  %-16s %s\n", r.datasets.size(), double(bytes) / 1e6,
                "dataset", "shape", "dtype", "bytes", "checksum", "status");
    for (const auto& d : r.datasets) {
      char sum[32];  // a stacked dataset's: the sum of its slots' (one per expert, or per block)
      std::snprintf(sum, sizeof sum, "%016llx", (unsigned long long)d.stored_checksum);
      std::printf("  %-48s %-14s %-9s %12lld  %s %s\n", d.path.c_str(), shape_text(d.shape).c_str(), d.dtype.c_str(),
                  (long long)d.bytes, sum, !d.checked ? "unread" : d.ok ? "ok" : "CORRUPT");
    }
  }
  for (const auto& p : r.problems) std::fprintf(stderr, "fp8moe: error: %s\n", p.c_str());
  if (!r.problems.empty()) {
    std::printf("%s: INVALID (%zu problem%s)\n", r.file.c_str(), r.problems.size(), r.problems.size() == 1 ? "" : "s");
    return kExitFailure;
  }
  std::printf("%s: valid: step %lld, %zu datasets, %.1f MB, every checksum matches\n", r.file.c_str(),
              (long long)r.step, r.datasets.size(), double(bytes) / 1e6);
  return kExitOk;
}

}  // namespace

int run_ckpt_inspect(const std::string& dir) { return report(dir, true); }
int run_ckpt_verify(const std::string& dir) { return report(dir, false); }

}  // namespace fp8moe
