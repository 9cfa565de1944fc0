#include "app/generate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>

#include "app/exit_codes.h"
#include "io/config.h"
#include "io/text.h"
#include "io/checkpoint.h"
#include "model/sampling.h"
#include "kernels/backend.h"
#include "model/transformer.h"

namespace fp8moe {

int run_generate(const GenerateOptions& o) {
  if (o.tokens < 0 || o.tokens > kMaxGenerateTokens)
    return usage_error("--tokens: expected a number in [0, " + std::to_string(kMaxGenerateTokens) + "], got " +
                       std::to_string(o.tokens));
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
  // One process, on the CPU backend: generation samples token by token.
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::cpu);
  Transformer model(*be, cfg);
  for (size_t i = 0; i < params.size(); ++i) model.set_param(i, params[i]);

  // A new document starts after token 0; the prompt's bytes follow (NUL bytes dropped).
  std::vector<int32_t> ctx = {0};
  for (unsigned char c : o.prompt)
    if (c) ctx.push_back(c);
  // Streamed: each byte is printed (and flushed) as it is sampled, except the start of a UTF-8
  // sequence, which waits for the bytes that finish it.
  std::printf("%s", printable_utf8(o.prompt).c_str());
  std::fflush(stdout);
  std::string pending;
  const int64_t window = cfg.train.seq_len;
  for (int i = 0; i < o.tokens; ++i) {
    const int64_t T = std::min<int64_t>(int64_t(ctx.size()), window);
    std::vector<float> logits = model.next_token_logits(ctx.data() + ctx.size() - T, T);
    const Philox4x32 r = philox4x32_10(uint32_t(i), 0, 0x47454eu, 0, uint32_t(o.seed), uint32_t(o.seed >> 32));
    const int32_t next = sample_token(logits.data(), int64_t(logits.size()), o.temperature, o.top_k,
                                      (double(r.v[0]) + 0.5) * 0x1p-32);
    if (next == 0) break;  // the end of a document
    ctx.push_back(next);
    if (int64_t(ctx.size()) > 2 * window) ctx.erase(ctx.begin(), ctx.end() - window);  // the model sees `window`
    pending += char(next);
    if (const size_t n = utf8_complete_prefix(pending); n > 0) {
      std::fputs(printable_utf8(pending.substr(0, n)).c_str(), stdout);
      std::fflush(stdout);
      pending.erase(0, n);
    }
  }
  std::printf("%s\n", printable_utf8(pending).c_str());
  return kExitOk;
}

}  // namespace fp8moe
