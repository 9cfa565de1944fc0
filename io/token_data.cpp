#include "io/token_data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "io/read_file.h"
#include "model/param_table.h"  // philox4x32_10

namespace fp8moe {
namespace {

// ---------------------------------------------------------------------------------------------
// The MMIDIDX format
// ---------------------------------------------------------------------------------------------

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kVersion = 1;
constexpr size_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;
constexpr uint8_t kUint16 = 8;

struct DtypeInfo {
  int code, bytes;
  const char* name;
};
// Megatron-Core's DType table, less the floating-point codes (6 float64, 7 float32).
constexpr DtypeInfo kDtypes[] = {{1, 1, "uint8"}, {2, 1, "int8"}, {3, 2, "int16"},
                                 {4, 4, "int32"}, {5, 8, "int64"}, {8, 2, "uint16"}};

const DtypeInfo* dtype_info(int code) {
  for (const DtypeInfo& d : kDtypes)
    if (d.code == code) return &d;
  return nullptr;
}

template <class T>
T load(const char* p) {  // unaligned little-endian read (x86-64 and aarch64 are little-endian)
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

// Output files written under temporary names (PATH.tmp.PID, in PATH's directory) and renamed into
// place together by commit(): until then every final name keeps what it had (a reader that has it
// mapped keeps its file), and a failed run's temporary files are removed by the destructor. A
// killed run can leave PATH.tmp.PID files, never a partial file under a final name.
class AtomicOutputs {
 public:
  AtomicOutputs() = default;
  AtomicOutputs(const AtomicOutputs&) = delete;
  AtomicOutputs& operator=(const AtomicOutputs&) = delete;
  ~AtomicOutputs() {
    for (const File& f : files_)
      if (!f.committed) ::unlink(f.tmp.c_str());
  }

  // Writes the temporary file of `path`, complete and on disk (fsync) on return.
  void write(const std::string& path, const void* data, size_t bytes) {
    files_.push_back({path, path + ".tmp." + std::to_string(::getpid())});
    const std::string& tmp = files_.back().tmp;
    auto fail = [&] {
      throw DataError(path + ": cannot write " + tmp + ": " + std::strerror(errno) + "; no output was replaced");
    };
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0) fail();
    const char* p = static_cast<const char*>(data);
    for (size_t done = 0; done < bytes;) {
      const ssize_t n = ::write(fd, p + done, bytes - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int e = errno;
        ::close(fd);
        errno = e;
        fail();
      }
      done += size_t(n);
    }
    if (::fsync(fd) != 0) {
      const int e = errno;
      ::close(fd);
      errno = e;
      fail();
    }
    if (::close(fd) != 0) fail();
  }

  // Renames every file into place, then makes the renames durable (fsync of the directories).
  void commit() {
    for (File& f : files_) {
      if (f.committed) continue;
      if (std::rename(f.tmp.c_str(), f.path.c_str()) != 0)
        throw DataError(f.path + ": cannot rename " + f.tmp + " to it: " + std::strerror(errno));
      f.committed = true;
    }
    for (const File& f : files_) {  // best effort: the files are in place either way
      const std::string dir = std::filesystem::path(f.path).parent_path().string();
      const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (fd >= 0) ::fsync(fd), ::close(fd);
    }
  }

 private:
  struct File {
    std::string path, tmp;
    bool committed = false;
  };
  std::vector<File> files_;
};

// Documents of one input: the whole file, or the pieces between lines equal to split_line.
std::vector<std::string> documents(const std::string& text, const std::string& split_line) {
  std::vector<std::string> docs;
  if (split_line.empty()) {
    docs.push_back(text);
    return docs;
  }
  std::string cur;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    const size_t end = nl == std::string::npos ? text.size() : nl + 1;
    std::string_view line(text.data() + pos, (nl == std::string::npos ? text.size() : nl) - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line == split_line) {
      docs.push_back(std::move(cur));
      cur.clear();
    } else {
      cur.append(text, pos, end - pos);
    }
    pos = end;
  }
  docs.push_back(std::move(cur));
  return docs;
}

// A data set being prepared: uint16 tokens, one sequence (= one document) each.
struct Split {
  std::vector<uint16_t> tokens;
  std::vector<int32_t> lengths;
};

void write_dataset(AtomicOutputs& out, const std::string& prefix, const Split& s) {
  out.write(prefix + ".bin", s.tokens.data(), s.tokens.size() * 2);
  const uint64_t n = s.lengths.size();
  std::string idx(kMagic, 9);
  idx.reserve(kHeaderBytes + n * 20 + 8);
  put(idx, kVersion);
  put(idx, kUint16);
  put(idx, n);      // sequences
  put(idx, n + 1);  // document_indices entries: one document per sequence, then the end
  idx.append(reinterpret_cast<const char*>(s.lengths.data()), n * 4);
  int64_t pointer = 0;
  for (int32_t len : s.lengths) put(idx, pointer), pointer += int64_t(len) * 2;
  for (int64_t d = 0; d <= int64_t(n); ++d) put(idx, d);
  out.write(prefix + ".idx", idx.data(), idx.size());
}

double uniform(uint64_t seed, uint64_t a, uint64_t b) {
  const Philox4x32 r = philox4x32_10(uint32_t(a), uint32_t(a >> 32), uint32_t(b), uint32_t(b >> 32), uint32_t(seed),
                                     uint32_t(seed >> 32));
  return (double(r.v[0]) + double(uint64_t(r.v[1]) << 32)) * 0x1p-64;
}

}  // namespace

PrepareReport prepare_data(const std::vector<std::string>& inputs, const std::string& prefix, double val_fraction,
                           const std::string& split_line, uint64_t seed) {
  if (inputs.empty()) throw DataError("prepare-data: no input files");
  if (!(val_fraction >= 0.0 && val_fraction < 1.0))
    throw DataError("prepare-data: --val-fraction " + std::to_string(val_fraction) + ": expected a number in [0, 1)");
  Split train, val;
  PrepareReport rep;
  uint64_t doc_number = 0;
  for (const std::string& path : inputs) {
    for (const std::string& doc : documents(read_whole_file<DataError>(path, "input"), split_line)) {
      Split& s = uniform(seed ^ 0x76616c69646174ull, doc_number++, 0) < val_fraction ? val : train;
      const size_t before = s.tokens.size();
      for (unsigned char c : doc)
        if (c != 0) s.tokens.push_back(c);  // token 0 is reserved for the document end
      s.tokens.push_back(0);
      if (s.tokens.size() - before > size_t(INT32_MAX))
        throw DataError(path + ": a document of " + std::to_string(s.tokens.size() - before) +
                        " bytes; the index stores lengths as int32");
      s.lengths.push_back(int32_t(s.tokens.size() - before));
      (&s == &val ? rep.val_docs : rep.train_docs) += 1;
    }
  }
  rep.train_tokens = int64_t(train.tokens.size()), rep.val_tokens = int64_t(val.tokens.size());
  std::string names;
  for (const std::string& p : inputs) names += (names.empty() ? "" : ", ") + p;
  if (rep.train_tokens + rep.val_tokens - rep.train_docs - rep.val_docs <= 0)
    throw DataError("prepare-data: " + names + ": the input holds no text");
  if (rep.train_tokens - rep.train_docs <= 0)
    throw DataError("prepare-data: " + names + ": every document went to validation (--val-fraction " +
                    std::to_string(val_fraction) + "); nothing to train on");
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::path(prefix).parent_path();
  if (!dir.empty() && !std::filesystem::create_directories(dir, ec) && ec)
    throw DataError(dir.string() + ": cannot create the output directory: " + ec.message());
  AtomicOutputs out;  // all four complete before any is renamed into place
  write_dataset(out, prefix + ".train", train);
  write_dataset(out, prefix + ".val", val);
  out.commit();
  return rep;
}

// ---------------------------------------------------------------------------------------------
// IndexedDataset
// ---------------------------------------------------------------------------------------------

namespace {

constexpr const char* kIdxWhat = "index (Megatron .idx)";
constexpr const char* kBinWhat = "token file (Megatron .bin)";

const char* file_kind(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a file";
}

// Maps `path` read-only (an empty file maps to nothing). DataError naming the file otherwise.
void* map_file(const std::string& path, const char* what, size_t* bytes) {
  // NOTE: O_NONBLOCK: opening a FIFO for reading waits for a writer without it; it is refused below
  // (for a regular file the flag changes nothing).
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw DataError(path + ": cannot open the " + std::string(what) + ": " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const std::string kind = file_kind(st.st_mode);
    ::close(fd);
    throw DataError(path + ": the " + std::string(what) + " is not a regular file (" + kind + ")");
  }
  *bytes = size_t(st.st_size);
  if (*bytes == 0) {
    ::close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, *bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw DataError(path + ": cannot map the " + std::string(what) + ": " + std::strerror(errno));
  return p;
}

std::string num(uint64_t v) { return std::to_string(v); }
std::string num(int64_t v) { return std::to_string(v); }

}  // namespace

IndexedDataset::IndexedDataset(const std::string& prefix, TokenCheck check) : prefix_(prefix) {
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  // A throw below leaves nothing mapped: idx_ and bin_ unmap themselves.
  idx_.addr = map_file(idx_path, kIdxWhat, &idx_.bytes);
  bin_.addr = map_file(bin_path, kBinWhat, &bin_.bytes);
  const char* p = static_cast<const char*>(idx_.addr);
  auto bad = [&](const std::string& field, const std::string& why) { throw DataError(idx_path + ": " + field + ": " + why); };
  if (idx_.bytes < kHeaderBytes)
    bad("header", num(uint64_t(idx_.bytes)) + " bytes, shorter than the " + num(uint64_t(kHeaderBytes)) +
                      "-byte header (truncated?)");
  if (std::memcmp(p, kMagic, 9) != 0)
    bad("magic", "not MMIDIDX: not a Megatron indexed data set (make one with `fp8moe prepare-data` or "
                 "scripts/tokenize-data.py)");
  const auto version = load<uint64_t>(p + 9);
  if (version != kVersion) bad("version", num(version) + ", this build reads version " + num(kVersion));
  dtype_ = static_cast<unsigned char>(p[17]);
  const DtypeInfo* info = dtype_info(dtype_);
  if (!info)
    bad("dtype", "code " + std::to_string(dtype_) +
                     (dtype_ == 6 || dtype_ == 7 ? " (a floating-point type) holds no token ids"
                                                 : " is not one of Megatron's") +
                     "; expected 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64 or 8 uint16");
  item_ = info->bytes;
  const auto seqs = load<uint64_t>(p + 18), docs = load<uint64_t>(p + 26);
  // Each count is bounded by the file size first, so the product below cannot overflow.
  if (seqs > idx_.bytes || docs > idx_.bytes || docs < 1)
    bad("sequence/document count", num(seqs) + " sequences, " + num(docs) + " document entries: impossible in " +
                                       num(uint64_t(idx_.bytes)) + " bytes");
  const uint64_t want = kHeaderBytes + seqs * (4 + 8) + docs * 8;
  if (want != idx_.bytes)
    bad("size", num(uint64_t(idx_.bytes)) + " bytes, but the header's " + num(seqs) + " sequences and " + num(docs) +
                    " document entries need " + num(want) +
                    (want + seqs == idx_.bytes ? " (a multimodal index with sequence modes: not supported)"
                                               : " (truncated or corrupt?)"));
  sequences_ = int64_t(seqs), documents_ = int64_t(docs) - 1;
  const char* lengths = p + kHeaderBytes;
  const char* pointers = lengths + seqs * 4;
  const char* doc_index = pointers + seqs * 8;
  // Sequences back to back from byte 0, as Megatron writes them, so that the token stream is the
  // whole .bin; each pointer is checked against the .bin's size as it goes.
  uint64_t offset = 0;
  for (uint64_t s = 0; s < seqs; ++s) {
    const auto len = load<int32_t>(lengths + s * 4);
    const auto ptr = load<int64_t>(pointers + s * 8);
    auto at = [s](const char* field) { return std::string(field) + "[" + num(s) + "]"; };  // on the error path only
    if (len < 0) bad(at("sequence_lengths"), num(int64_t(len)) + ", negative");
    if (ptr < 0 || uint64_t(ptr) + uint64_t(len) * item_ > bin_.bytes)
      bad(at("sequence_pointers"), num(ptr) + " (+ " + num(int64_t(len)) + " tokens of " + info->name +
                                       "): past the end of " + bin_path + " (" + num(uint64_t(bin_.bytes)) + " bytes)");
    if (uint64_t(ptr) != offset)
      bad(at("sequence_pointers"), num(ptr) + ", expected " + num(offset) +
                                       " (the end of the sequence before it): sequences must be back to back");
    offset += uint64_t(len) * item_;
  }
  if (offset != bin_.bytes)
    throw DataError(bin_path + ": size: " + num(uint64_t(bin_.bytes)) + " bytes, but " + idx_path +
                    "'s sequences end at byte " + num(offset) + (offset < bin_.bytes ? " (the index is stale?)" : ""));
  int64_t prev = 0;
  for (uint64_t d = 0; d < docs; ++d) {
    const auto first = load<int64_t>(doc_index + d * 8);
    auto at = [d] { return "document_indices[" + num(d) + "]"; };  // on the error path only
    if (d == 0 && first != 0) bad(at(), num(first) + ", expected 0");
    if (first < prev || first > int64_t(seqs))
      bad(at(), num(first) + ": not in [" + num(prev) + ", " + num(seqs) + "] (document starts must rise to the sequence count)");
    if (d + 1 == docs && first != int64_t(seqs)) bad(at(), num(first) + ", the last entry must be the sequence count " + num(seqs));
    prev = first;
  }
  count_ = int64_t(bin_.bytes / item_);
  tokens_ = static_cast<const char*>(bin_.addr);
  // Token ids, in this opener's part of the stream: within the vocabulary, or at least within
  // int32 (what sample() hands the model).
  if (check.parts < 1 || check.part < 0 || check.part >= check.parts)
    throw DataError(prefix + ": token check part " + std::to_string(check.part) + " of " + std::to_string(check.parts));
  const int64_t limit = check.vocab_size > 0 ? check.vocab_size : int64_t(INT32_MAX) + 1;
  const int64_t begin = count_ * check.part / check.parts, end = count_ * (check.part + 1) / check.parts;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t t = token(i);
    if (t < 0 || t >= limit)
      throw DataError(bin_path + ": token id " + num(t) + " at token " + num(i) + " is outside " +
                      (check.vocab_size > 0 ? "the vocabulary [0, " + num(limit) +
                                                  ") of model.vocab_size (a tokenizer larger than the model's?)"
                                            : "[0, 2^31)"));
  }
}

IndexedDataset::Map::~Map() {
  if (addr) munmap(addr, bytes);
}

const char* IndexedDataset::dtype_name() const { return dtype_info(dtype_)->name; }

int64_t IndexedDataset::token(int64_t i) const {
  const char* p = tokens_ + i * item_;
  switch (dtype_) {
    case 1: return load<uint8_t>(p);
    case 2: return load<int8_t>(p);
    case 3: return load<int16_t>(p);
    case 4: return load<int32_t>(p);
    case 5: return load<int64_t>(p);
    default: return load<uint16_t>(p);
  }
}

namespace {
// A seeded bijection of [0, n): a 4-round Feistel network on the next even number of bits, with
// cycle walking back into [0, n).
uint64_t permute_index(uint64_t i, uint64_t n, uint64_t seed, uint64_t epoch) {
  if (n <= 1) return 0;
  int bits = 64 - __builtin_clzll(n - 1);
  bits += bits & 1;
  const int half = bits / 2;
  const uint64_t mask = (uint64_t(1) << half) - 1;
  uint64_t x = i;
  do {
    uint64_t l = x >> half, r = x & mask;
    for (uint32_t round = 0; round < 4; ++round) {
      const Philox4x32 f = philox4x32_10(uint32_t(r), uint32_t(r >> 32), round, uint32_t(epoch), uint32_t(seed),
                                         uint32_t(seed >> 32) ^ uint32_t(epoch >> 32));
      const uint64_t nl = r;
      r = l ^ ((uint64_t(f.v[0]) | uint64_t(f.v[1]) << 32) & mask);
      l = nl;
    }
    x = (l << half) | r;
  } while (x >= n);
  return x;
}
}  // namespace

void IndexedDataset::sample(uint64_t seed, int64_t index, int64_t T, int32_t* tokens, int32_t* targets) const {
  if (count_ < T + 1)
    throw DataError(prefix_ + ": " + std::to_string(count_) + " tokens, fewer than one sequence of " + std::to_string(T + 1));
  const uint64_t W = uint64_t(windows(T));
  const uint64_t window = permute_index(uint64_t(index) % W, W, seed, uint64_t(index) / W);
  const int64_t start = int64_t(window) * T;
  for (int64_t t = 0; t < T; ++t) {
    tokens[t] = int32_t(token(start + t));
    targets[t] = int32_t(token(start + t + 1));
  }
}

// ---------------------------------------------------------------------------------------------
// DataBlend
// ---------------------------------------------------------------------------------------------

namespace {

// A data set's pair of files by device and inode: two prefixes naming the same files (another
// spelling of the path, a symbolic link) are one data set. stat() does not open, so a FIFO does
// not block here; a file that cannot be found is refused as its opening would refuse it.
using FileId = std::array<uint64_t, 4>;
FileId file_id(const std::string& prefix) {
  FileId id{};
  const std::pair<const char*, const char*> files[] = {{".idx", kIdxWhat}, {".bin", kBinWhat}};
  for (int f = 0; f < 2; ++f) {
    const std::string path = prefix + files[f].first;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0)
      throw DataError(path + ": cannot open the " + std::string(files[f].second) + ": " + std::strerror(errno));
    id[size_t(2 * f)] = uint64_t(st.st_dev), id[size_t(2 * f + 1)] = uint64_t(st.st_ino);
  }
  return id;
}

// vm.max_map_count, and the maps this process has (the lines of /proc/self/maps); -1 where unknown.
int64_t read_max_map_count() {
  std::ifstream in("/proc/sys/vm/max_map_count");
  int64_t n = -1;
  return in >> n ? n : -1;
}
int64_t maps_in_use() {
  std::ifstream in("/proc/self/maps");
  if (!in) return -1;
  int64_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

}  // namespace

void check_map_budget(int64_t data_sets, int64_t max_map_count, int64_t maps_in_use) {
  const int64_t need = data_sets * kMapsPerDataSet, left = max_map_count - maps_in_use;
  if (need > left / 2)
    throw DataError(num(data_sets) + " distinct data sets need " + num(need) + " memory maps (" +
                    num(int64_t(kMapsPerDataSet)) + " each), more than half of the " + num(left) +
                    " this process has left (vm.max_map_count " + num(max_map_count) + ", " + num(maps_in_use) +
                    " in use): merge data sets, or raise vm.max_map_count (sysctl -w vm.max_map_count=N)");
}

DataBlend::DataBlend(const std::vector<DataSource>& sources, TokenCheck check) {
  if (sources.empty()) throw DataError("no data set");
  if (int64_t(sources.size()) > kMaxBlendEntries)
    throw DataError("a blend of " + num(uint64_t(sources.size())) + " entries, more than the " + num(kMaxBlendEntries) +
                    " a blend may have (each sample looks at every entry; Megatron's blends have tens to a few "
                    "hundred): name each data set once, with the sum of its weights");
  double total = 0;
  for (const DataSource& s : sources) {
    if (!(s.weight > 0 && std::isfinite(s.weight)))
      throw DataError(s.prefix + ": weight " + std::to_string(s.weight) + ", expected a finite number > 0");
    total += s.weight;
  }
  std::map<FileId, int> distinct;  // files -> their index in `first`
  std::vector<const std::string*> first;  // the first prefix naming each distinct data set
  entry_set_.reserve(sources.size());
  for (const DataSource& s : sources) {
    const auto [it, fresh] = distinct.emplace(file_id(s.prefix), int(first.size()));
    if (fresh) first.push_back(&s.prefix);
    entry_set_.push_back(it->second);
    weights_.push_back(s.weight / total);
  }
  if (const int64_t max_maps = read_max_map_count(); max_maps > 0)
    check_map_budget(int64_t(first.size()), max_maps, maps_in_use());
  for (const std::string* prefix : first) sets_.push_back(std::make_unique<IndexedDataset>(*prefix, check));
  taken_.assign(entry_set_.size(), 0);
}

std::pair<int, int64_t> DataBlend::locate(int64_t index) {
  if (index < cursor_) cursor_ = 0, taken_.assign(entry_set_.size(), 0);
  for (;; ++cursor_) {
    int best = 0;
    double deficit = -INFINITY;
    for (size_t k = 0; k < entry_set_.size(); ++k) {
      const double d = weights_[k] * double(cursor_ + 1) - double(taken_[k]);
      if (d > deficit) deficit = d, best = int(k);
    }
    if (cursor_ == index) return {best, taken_[best]};  // the cursor stays: asking again is free
    ++taken_[best];
  }
}

void DataBlend::sample(uint64_t seed, int64_t index, int64_t T, int32_t* tokens, int32_t* targets) {
  const auto [k, local] = locate(index);
  // Entry 0 keeps the plain seed (one data set samples as it always has); the others get their own
  // window orders, also where they share their files with another entry.
  const uint64_t entry_seed = k == 0 ? seed : seed ^ (0x9E3779B97F4A7C15ull * uint64_t(k));
  sets_[size_t(entry_set_[size_t(k)])]->sample(entry_seed, local, T, tokens, targets);
}

int64_t DataBlend::min_size() const {
  int64_t m = INT64_MAX;
  for (const auto& s : sets_) m = std::min(m, s->size());
  return m;
}

}  // namespace fp8moe
