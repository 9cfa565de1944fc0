#include "io/token_data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "io/read_file.h"
#include "model/param_table.h"  // philox4x32_10

namespace fp8moe {
namespace {

constexpr char kMagic[8] = {'F', 'P', '8', 'M', 'O', 'E', 'T', 'K'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 8 + 8;

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

struct Split {
  std::vector<uint16_t> tokens;
  std::vector<uint64_t> starts{0};
};

// Written to PATH.tmp and renamed: a reader that has PATH mapped keeps its (old) file.
void write_split(const std::string& path, const Split& s) {
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  if (!out) throw DataError(tmp + ": cannot write: " + std::strerror(errno));
  const uint32_t version = kVersion, width = 2;
  const uint64_t count = s.tokens.size(), docs = s.starts.size() - 1;
  out.write(kMagic, 8);
  out.write(reinterpret_cast<const char*>(&version), 4);
  out.write(reinterpret_cast<const char*>(&width), 4);
  out.write(reinterpret_cast<const char*>(&count), 8);
  out.write(reinterpret_cast<const char*>(&docs), 8);
  out.write(reinterpret_cast<const char*>(s.tokens.data()), std::streamsize(count * 2));
  out.write(reinterpret_cast<const char*>(s.starts.data()), std::streamsize(s.starts.size() * 8));
  out.close();
  if (!out) throw DataError(tmp + ": write failed: " + std::strerror(errno));
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw DataError(path + ": cannot rename " + tmp + ": " + std::strerror(errno));
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
      for (unsigned char c : doc)
        if (c != 0) s.tokens.push_back(c);  // token 0 is reserved for the document end
      s.tokens.push_back(0);
      s.starts.push_back(s.tokens.size());
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
  write_split(prefix + ".train.tok", train);
  write_split(prefix + ".val.tok", val);
  return rep;
}

TokenFile::TokenFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw DataError(path + ": cannot open the token file: " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size < off_t(kHeaderBytes)) {
    ::close(fd);
    throw DataError(path + ": not a token file: " + std::to_string(st.st_size) + " bytes, shorter than its header");
  }
  map_bytes_ = size_t(st.st_size);
  map_ = mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw DataError(path + ": cannot map the token file: " + std::strerror(errno));
  }
  const char* p = static_cast<const char*>(map_);
  uint32_t version = 0, width = 0;
  uint64_t count = 0, docs = 0;
  std::memcpy(&version, p + 8, 4);
  std::memcpy(&width, p + 12, 4);
  std::memcpy(&count, p + 16, 8);
  std::memcpy(&docs, p + 24, 8);
  auto fail = [&](const std::string& why) {
    munmap(map_, map_bytes_);
    map_ = nullptr;
    throw DataError(path + ": " + why);
  };
  if (std::memcmp(p, kMagic, 8) != 0) fail("not a token file (bad magic; make one with `fp8moe prepare-data`)");
  if (version != kVersion) fail("token file version " + std::to_string(version) + ", this build reads " + std::to_string(kVersion));
  if (width != 2) fail("tokens of " + std::to_string(width) + " bytes, expected 2");
  const uint64_t want = kHeaderBytes + count * 2 + (docs + 1) * 8;
  if (count > (uint64_t(1) << 40) || docs > count || want != map_bytes_)
    fail("size " + std::to_string(map_bytes_) + " bytes does not match its header (" + std::to_string(count) +
         " tokens, " + std::to_string(docs) + " documents: " + std::to_string(want) + " bytes); truncated or corrupt?");
  count_ = int64_t(count), docs_ = int64_t(docs);
  tokens_ = reinterpret_cast<const uint16_t*>(p + kHeaderBytes);
  doc_start_ = p + kHeaderBytes + count * 2;
  // One pass over the index and the tokens: documents in order, each ending with token 0, and
  // every token a byte (so no id reaches past a 256-entry embedding).
  if (doc_start(0) != 0 || doc_start(docs_) != count_) fail("document index does not cover the tokens; corrupt?");
  for (int64_t d = 0; d < docs_; ++d) {
    const int64_t a = doc_start(d), b = doc_start(d + 1);
    if (b <= a || b > count_ || tokens_[b - 1] != 0)
      fail("document " + std::to_string(d) + " spans [" + std::to_string(a) + ", " + std::to_string(b) +
           "), not a run of tokens ending with 0; corrupt?");
  }
  for (int64_t i = 0; i < count_; ++i)
    if (tokens_[i] > 255) fail("token " + std::to_string(tokens_[i]) + " at " + std::to_string(i) + " is not a byte; corrupt?");
}

int64_t TokenFile::doc_start(int64_t d) const {
  if (d < 0 || d > docs_) throw DataError(path_ + ": document " + std::to_string(d) + " of " + std::to_string(docs_));
  uint64_t v = 0;
  std::memcpy(&v, doc_start_ + d * 8, 8);
  return int64_t(v);
}

TokenFile::~TokenFile() {
  if (map_) munmap(map_, map_bytes_);
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

void TokenFile::sample(uint64_t seed, int64_t index, int64_t T, int32_t* tokens, int32_t* targets) const {
  if (count_ < T + 1)
    throw DataError(path_ + ": " + std::to_string(count_) + " tokens, fewer than one sequence of " + std::to_string(T + 1));
  const uint64_t W = uint64_t(windows(T));
  const uint64_t window = permute_index(uint64_t(index) % W, W, seed, uint64_t(index) / W);
  const uint64_t start = window * uint64_t(T);
  for (int64_t t = 0; t < T; ++t) {
    tokens[t] = tokens_[start + t];
    targets[t] = tokens_[start + t + 1];
  }
}

std::string printable_utf8(const std::string& s) {
  std::string out;
  auto hex = [&](unsigned char c) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "\\x%02X", c);
    out += buf;
  };
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    bool ok = len > 0 && i + len <= s.size();
    for (size_t j = 1; ok && j < len; ++j) ok = (static_cast<unsigned char>(s[i + j]) >> 6) == 0x2;
    if (ok && len == 2) ok = c >= 0xC2;  // no overlong forms
    if (ok && len == 3) {
      const auto c1 = static_cast<unsigned char>(s[i + 1]);
      ok = !(c == 0xE0 && c1 < 0xA0) && !(c == 0xED && c1 >= 0xA0);  // overlong, surrogates
    }
    if (ok && len == 4) {
      const auto c1 = static_cast<unsigned char>(s[i + 1]);
      ok = c <= 0xF4 && !(c == 0xF0 && c1 < 0x90) && !(c == 0xF4 && c1 >= 0x90);
    }
    if (!ok || (len == 1 && c < 0x20 && c != '\n' && c != '\t') || c == 0x7F) {
      hex(c);
      ++i;
      continue;
    }
    out.append(s, i, len);
    i += len;
  }
  return out;
}

}  // namespace fp8moe
