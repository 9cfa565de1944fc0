// Token data sets: byte-level tokenisation into a binary token file, and a memory-mapped reader
// whose samples are a pure function of (seed, step, position).
//
// Tokens: one per input byte (vocabulary 256). Token 0 ends every document, so NUL bytes in the
// input are dropped. A token file (PREFIX.train.tok / PREFIX.val.tok), little-endian:
//   char[8] "FP8MOETK" | u32 version (1) | u32 bytes per token (2) | u64 token count | u64 docs
//   | u16 tokens[count] | u64 doc_start[docs + 1]   (doc d is tokens [doc_start[d], doc_start[d+1]))
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace fp8moe {

struct DataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct PrepareReport {
  int64_t train_docs = 0, val_docs = 0, train_tokens = 0, val_tokens = 0;
};

// Reads the inputs (each file one document, or split at lines equal to `split_line` when it is
// not empty, as the fortune files' "%"), assigns each document to validation with probability
// val_fraction (a deterministic function of seed and document number), and writes
// PREFIX.train.tok and PREFIX.val.tok (each through a temporary file and a rename). DataError on
// unreadable or empty input, or when no document is left for training.
PrepareReport prepare_data(const std::vector<std::string>& inputs, const std::string& prefix, double val_fraction,
                           const std::string& split_line, uint64_t seed);

// A token file, memory-mapped read-only; the header and size are checked on open.
class TokenFile {
 public:
  explicit TokenFile(const std::string& path);  // DataError naming the file and the problem
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  int64_t size() const { return count_; }
  int64_t docs() const { return docs_; }
  const uint16_t* tokens() const { return tokens_; }
  int64_t doc_start(int64_t d) const;  // d in [0, docs()]
  const std::string& path() const { return path_; }

  // Sequence number `position` of step `step`: T + 1 consecutive tokens from an offset drawn by
  // Philox from (seed, step, position); tokens = the first T, targets = the last T. Every rank,
  // micro-batch and layout computes the same sequence for the same (step, position).
  void sample(uint64_t seed, int64_t step, int64_t position, int64_t T, int32_t* tokens, int32_t* targets) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  int64_t count_ = 0, docs_ = 0;
  const uint16_t* tokens_ = nullptr;
  const char* doc_start_ = nullptr;  // u64 array, not necessarily 8-byte aligned: read with memcpy
};

}  // namespace fp8moe
