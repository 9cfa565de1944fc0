// `fp8moe generate --checkpoint DIR --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed S]`
#pragma once

#include <cstdint>
#include <string>

namespace fp8moe {

// --tokens at most (a bound against a typo of a few zeros: each token is one forward pass).
constexpr int kMaxGenerateTokens = 1000000;

struct GenerateOptions {
  std::string checkpoint;  // a checkpoint.dir (its latest) or a step directory
  std::string prompt;
  int tokens = 200;
  double temperature = 0.8;
  int top_k = 40;
  uint64_t seed = 1;
};

// Prints the prompt and a sample continuation, streamed as it is sampled (bytes that are not valid
// UTF-8 shown as \xNN); stops at a document end or after o.tokens bytes.
// Returns the exit status.
int run_generate(const GenerateOptions& options);

}  // namespace fp8moe
