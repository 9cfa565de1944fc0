#include "app/generate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>

#include "app/exit_codes.h"
#include "io/config.h"
#include "io/token_data.h"
#include "io/checkpoint.h"
#include "model/transformer.h"

namespace fp8moe {

int run_generate(const GenerateOptions& o) {
  if (o.tokens < 0) return usage_error("--tokens: expected a number >= 0");
  if (!(o.temperature >= 0)) return usage_error("--temperature: expected a number >= 0 (0 = greedy)");
  if (o.top_k < 0) return usage_error("--top-k: expected a number >= 0 (0 = all)");
  std::vector<std::vector<float>> params;
  Config cfg;
  try {
    cfg = load_checkpoint_weights(o.checkpoint, &params);
  } catch (const CheckpointError& e) {
    return usage_error(std::string("--checkpoint: ") + e.what());
  }
  if (cfg.model.vocab_size != 256)
    return usage_error("--checkpoint: a vocabulary of " + std::to_string(cfg.model.vocab_size) +
                       " tokens; generate reads and writes bytes, so it samples byte-level models (vocabulary 256) "
                       "only: decoding through a tokenizer is not implemented");
  Transformer model(cfg);
  model.params() = std::move(params);

  // A new document starts after token 0; the prompt's bytes follow (NUL bytes dropped).
  std::vector<int32_t> ctx = {0};
  for (unsigned char c : o.prompt)
    if (c) ctx.push_back(c);
  std::string generated;
  const int64_t window = cfg.train.seq_len;
  for (int i = 0; i < o.tokens; ++i) {
    const int64_t T = std::min<int64_t>(int64_t(ctx.size()), window);
    std::vector<float> logits = model.next_token_logits(ctx.data() + ctx.size() - T, T);
    const int64_t V = int64_t(logits.size());
    std::vector<int32_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    int32_t next = order[0];
    if (o.temperature > 0) {
      const int64_t k = o.top_k > 0 ? std::min<int64_t>(o.top_k, V) : V;
      std::vector<double> p(static_cast<size_t>(k));
      for (int64_t j = 0; j < k; ++j) p[j] = std::exp((double(logits[order[j]]) - logits[order[0]]) / o.temperature);
      const double total = std::accumulate(p.begin(), p.end(), 0.0);
      const Philox4x32 r = philox4x32_10(uint32_t(i), 0, 0x47454eu, 0, uint32_t(o.seed), uint32_t(o.seed >> 32));
      double u = (double(r.v[0]) + 0.5) * 0x1p-32 * total;
      for (int64_t j = 0; j < k; ++j) {
        next = order[j];
        if ((u -= p[j]) <= 0) break;
      }
    }
    if (next == 0) break;  // the end of a document
    ctx.push_back(next);
    generated += char(next);
  }
  std::printf("%s%s\n", printable_utf8(o.prompt).c_str(), printable_utf8(generated).c_str());
  return kExitOk;
}

}  // namespace fp8moe
