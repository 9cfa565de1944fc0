// Token data: Megatron-LM's indexed data sets (the one on-disk format), byte-level preparation of
// text into them, and the blend of several data sets that training samples from.
//
// A data set with prefix P is P.bin (the tokens of every sequence, back to back) and P.idx,
// little-endian (Megatron-Core's MMIDIDX index, version 1):
//   char[9] "MMIDIDX\0\0" | u64 version = 1 | u8 dtype code | u64 sequence count S | u64 document
//   count D | i32 sequence_lengths[S] | i64 sequence_pointers[S] (byte offsets into P.bin) |
//   i64 document_indices[D] (the first sequence of each document, then S)
// dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16 (6 float64 and 7 float32 exist
// in Megatron's table but hold no token ids, and are refused). Megatron's preprocessing writes one
// sequence per document with the end-of-document token appended; training reads the sequences as
// one stream in file order, so documents are packed into windows with their end tokens, as
// Megatron's GPTDataset does (which also shuffles the documents before packing; here the windows
// are cut from the file order and only the order of visiting them is shuffled).
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/config.h"  // DataSource

namespace fp8moe {

struct DataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct PrepareReport {
  int64_t train_docs = 0, val_docs = 0, train_tokens = 0, val_tokens = 0;
};

// Byte-level tokenisation (vocabulary 256): every input byte is a token, token 0 ends every
// document (NUL bytes in the input are dropped). Reads the inputs (each file one document, or
// split at lines equal to `split_line` when it is not empty, as the fortune files' "%"), assigns
// each document to validation with probability val_fraction (a deterministic function of seed and
// document number), and writes the data sets PREFIX.train and PREFIX.val (uint16 tokens, one
// sequence per document). The four files are written under temporary names (PATH.tmp.PID, beside
// PATH) and renamed into place only when all four are complete, so a failed or killed run leaves
// every existing output as it was and no partial file under a final name. DataError on unreadable
// or empty input, when no document is left for training, or when an output cannot be written (its
// temporary files removed).
PrepareReport prepare_data(const std::vector<std::string>& inputs, const std::string& prefix, double val_fraction,
                           const std::string& split_line, uint64_t seed);

// Which tokens an opening checks against the vocabulary: part `part` of `parts` equal parts (the
// ranks of a job each check theirs, so that no rank reads the whole corpus at start).
struct TokenCheck {
  int64_t vocab_size = 0;  // ids must be in [0, vocab_size); 0: in [0, 2^31)
  int part = 0, parts = 1;
};

// One indexed data set, both files memory-mapped read-only (kMapsPerDataSet maps; an empty file
// maps to nothing). Each file must be a regular file: a FIFO or a device is refused without
// waiting on it. Opening validates the index (magic,
// version, dtype, counts against the file size, every length, pointer and document index) and the
// .bin's size against it, and that every token id of the checked part is in range; each problem
// is a DataError naming the file, the field and the value.
class IndexedDataset {
 public:
  IndexedDataset(const std::string& prefix, TokenCheck check);
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  int64_t size() const { return count_; }  // tokens in all sequences
  int64_t sequences() const { return sequences_; }
  int64_t documents() const { return documents_; }
  const char* dtype_name() const;
  int64_t token(int64_t i) const;  // i in [0, size())

  // Sample number `index`: the token stream is cut into W = (size - 1) / T windows of T + 1 tokens
  // (neighbours share one token), and epoch index / W visits them in a seeded random order (a
  // bijection: no window twice in an epoch). tokens = the window's first T, targets = its last T.
  // A pure function of (seed, index).
  void sample(uint64_t seed, int64_t index, int64_t T, int32_t* tokens, int32_t* targets) const;
  int64_t windows(int64_t T) const { return count_ > T ? (count_ - 1) / T : 0; }

 private:
  struct Map {  // a read-only mapping of a whole file, unmapped with its owner (or a failed opening)
    void* addr = nullptr;
    size_t bytes = 0;
    Map() = default;
    Map(const Map&) = delete;
    Map& operator=(const Map&) = delete;
    ~Map();
  };
  std::string prefix_;
  Map idx_, bin_;
  int dtype_ = 0;  // Megatron's code
  int item_ = 0;   // bytes per token
  int64_t count_ = 0, sequences_ = 0, documents_ = 0;
  const char* tokens_ = nullptr;
};

constexpr int kMapsPerDataSet = 2;  // the .idx and the .bin

// The most entries a blend may have: each sample looks at every entry (and a resume at sample n
// walks n samples), so a blend of this size already costs 65,536 operations a sample. Megatron's
// blends have tens to a few hundred entries.
constexpr int64_t kMaxBlendEntries = 65536;

// DataError unless `data_sets` distinct data sets (kMapsPerDataSet maps each) fit in half of the
// memory maps the process has left (max_map_count - maps_in_use; the other half for the rest of
// the program: libraries, allocations, the GPU runtime), naming the counts.
void check_map_budget(int64_t data_sets, int64_t max_map_count, int64_t maps_in_use);

// The data sets training or evaluation samples from: one, or a weighted blend (data.path as
// Megatron's --data-path). Entries that name the same pair of files (by device and inode: another
// spelling of the path, a symbolic link) share one opening, so a blend maps each distinct data set
// once however many entries name it; each entry still samples as its own member of the blend (its
// own share and window order below), as if it had opened its files alone. Before any file is
// opened, the entries are limited to kMaxBlendEntries and the distinct data sets by
// check_map_budget against /proc/sys/vm/max_map_count (where it exists).
// Sample i of the blend is taken from the entry furthest behind its share after i + 1 samples —
// the k maximising weight_k * (i + 1) - taken_k(i), lowest k on ties — and is that entry's sample
// number taken_k(i) (entry 0 with the plain seed, entry k with seed ^ (0x9E3779B97F4A7C15 x k)).
// Sample i is a pure function of (sources, seed, i): the same on every layout, and after a
// resume. An entry is never a whole sample ahead of its share; it may fall behind by up to
// (entries - 1) in the worst case (Megatron's blend uses the same rule; the tests measure the
// worst over random weights).
class DataBlend {
 public:
  DataBlend(const std::vector<DataSource>& sources, TokenCheck check);

  // Not thread-safe: it walks a cursor forward from the last index asked (from 0 when an earlier
  // index is asked), so increasing indices cost O(entries) each, and the first sample after a
  // resume at sample n costs O(n x entries) once.
  void sample(uint64_t seed, int64_t index, int64_t T, int32_t* tokens, int32_t* targets);
  // Which entry sample `index` comes from, and its sample number there.
  std::pair<int, int64_t> locate(int64_t index);

  // The distinct data sets, in the order the entries first name them.
  const std::vector<std::unique_ptr<IndexedDataset>>& sets() const { return sets_; }
  int64_t entries() const { return int64_t(entry_set_.size()); }
  int64_t min_size() const;  // tokens of the smallest data set

 private:
  std::vector<std::unique_ptr<IndexedDataset>> sets_;
  std::vector<int> entry_set_;   // entry k samples from sets_[entry_set_[k]]
  std::vector<double> weights_;  // per entry, normalised to sum 1
  int64_t cursor_ = 0;           // taken_ holds the counts over samples [0, cursor_)
  std::vector<int64_t> taken_;   // per entry
};

}  // namespace fp8moe
