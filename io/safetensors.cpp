#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <climits>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

namespace fp8moe {
namespace {

using Json = nlohmann::ordered_json;

std::string errno_text() { return std::strerror(errno); }

// The spec's limit on the header (100 MB), as the reference implementation enforces it.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

void pread_all(int fd, void* buf, size_t n, uint64_t at, const std::string& path) {
  auto* p = static_cast<unsigned char*>(buf);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, off_t(at));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw HfFormatError(path + ": " + (r < 0 ? "read failed: " + errno_text() : "the file is truncated"));
    p += r, n -= size_t(r), at += uint64_t(r);
  }
}

void write_all(int fd, const void* buf, size_t n, const std::string& path) {
  const auto* p = static_cast<const unsigned char*>(buf);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) throw HfFormatError(path + ": write failed: " + errno_text());
    p += w, n -= size_t(w);
  }
}

// The header text for `tensors` (offsets assigned in order), padded with spaces to a multiple of
// 8 bytes so that the data starts aligned.
std::string header_text(std::vector<SafeTensor>& tensors, const std::map<std::string, std::string>& metadata,
                        uint64_t* data_bytes) {
  Json h = Json::object();
  if (!metadata.empty()) {
    Json m = Json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    h["__metadata__"] = m;
  }
  uint64_t off = 0;
  for (SafeTensor& t : tensors) {
    const size_t es = safetensors_dtype_size(t.dtype);
    if (es == 0) throw HfFormatError("safetensors: unknown dtype " + t.dtype + " of " + t.name);
    if (h.contains(t.name)) throw HfFormatError("safetensors: two tensors named " + t.name);
    t.begin = off;
    t.end = off + uint64_t(t.numel()) * es;
    off = t.end;
    h[t.name] = Json{{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  }
  *data_bytes = off;
  std::string s = h.dump();
  s.append((8 - (8 + s.size()) % 8) % 8, ' ');
  return s;
}

}  // namespace

int64_t SafeTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t safetensors_dtype_size(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "F8_E4M3" || d == "F8_E5M2" || d == "I8" || d == "U8" || d == "BOOL") return 1;
  return 0;
}

// ---------------------------------------------------------------- writer

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<SafeTensor> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path) {
  const std::string header = header_text(tensors, metadata, &data_bytes_);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw HfFormatError(path + ": cannot create: " + errno_text());
  fd_ = fd;
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(uint64_t(header.size()) >> (8 * i));
  written_ = 0;
  try {
    write_all(fd_, len, 8, path_);
    write_all(fd_, header.data(), header.size(), path_);
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsWriter::write(const void* data, size_t bytes) {
  if (fd_ < 0) throw HfFormatError(path_ + ": written after close");
  if (written_ + bytes > data_bytes_)
    throw HfFormatError(path_ + ": more data than the header's tensors hold (" + std::to_string(data_bytes_) + " bytes)");
  write_all(fd_, data, bytes, path_);
  written_ += bytes;
}

void SafetensorsWriter::close() {
  if (fd_ < 0) return;
  if (written_ != data_bytes_)
    throw HfFormatError(path_ + ": " + std::to_string(written_) + " of " + std::to_string(data_bytes_) +
                        " data bytes written");
  const int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0 || ::close(fd) != 0) throw HfFormatError(path_ + ": cannot flush: " + errno_text());
}

// ---------------------------------------------------------------- reader

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  // O_NONBLOCK: a FIFO under a .safetensors name is refused below, not waited on.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) throw HfFormatError(path + ": cannot open: " + errno_text());
  try {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) throw HfFormatError(path + ": cannot open: " + errno_text());
    if (!S_ISREG(st.st_mode)) throw HfFormatError(path + ": not a regular file (a FIFO, a device or a directory)");
    parse_header();
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

void SafetensorsFile::parse_header() {
  const std::string& path = path_;
  const off_t size = ::lseek(fd_, 0, SEEK_END);
  if (size < 8) throw HfFormatError(path + ": not a safetensors file (" + std::to_string(size) + " bytes)");
  unsigned char len[8];
  pread_all(fd_, len, 8, 0, path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(len[i]) << (8 * i);
  if (n > kMaxHeaderBytes)
    throw HfFormatError(path + ": its header of " + std::to_string(n) + " bytes is over fp8moe's limit of " +
                        std::to_string(kMaxHeaderBytes) + " bytes (the safetensors format's limit, which its "
                        "reference implementation enforces)");
  if (8 + n > uint64_t(size))
    throw HfFormatError(path + ": not a safetensors file (a header of " + std::to_string(n) + " bytes in a file of " +
                        std::to_string(size) + ")");
  std::string text(size_t(n), '\0');
  pread_all(fd_, text.data(), size_t(n), 8, path);
  data_start_ = 8 + n;
  const uint64_t data_bytes = uint64_t(size) - data_start_;
  // Parsed with a check for repeated names at the top level, which JSON allows and the format
  // does not (the last would silently win).
  Json h;
  std::set<std::string> names;
  const Json::parser_callback_t no_repeats = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (depth == 1 && event == Json::parse_event_t::key && !names.insert(parsed.get<std::string>()).second)
      throw HfFormatError(path + ": the header names " + parsed.get<std::string>() + " twice");
    return true;
  };
  try {
    h = Json::parse(text, no_repeats);
  } catch (const Json::exception& e) {
    throw HfFormatError(path + ": the header is not JSON: " + e.what());
  }
  if (!h.is_object()) throw HfFormatError(path + ": the header is not a JSON object");
  uint64_t covered = 0;
  for (const auto& [name, v] : h.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) throw HfFormatError(path + ": __metadata__ is not an object");
      for (const auto& [k, s] : v.items())
        if (s.is_string()) metadata_[k] = s.get<std::string>();
      continue;
    }
    const std::string at = path + ": tensor " + name;
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      throw HfFormatError(at + ": expected dtype, shape and data_offsets");
    SafeTensor t;
    t.name = name;
    if (!v["dtype"].is_string()) throw HfFormatError(at + ": dtype is not a string");
    t.dtype = v["dtype"].get<std::string>();
    const size_t es = safetensors_dtype_size(t.dtype);
    if (es == 0) throw HfFormatError(at + ": unknown dtype " + t.dtype);
    if (!v["shape"].is_array()) throw HfFormatError(at + ": shape is not a list");
    // The bytes the shape needs, without overflow: at most the data after the header.
    uint64_t need = es;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) throw HfFormatError(at + ": shape holds " + d.dump() + ", not a dimension");
      const uint64_t x = d.get<uint64_t>();
      if (x > uint64_t(INT64_MAX) || __builtin_mul_overflow(need, x, &need))
        throw HfFormatError(at + ": shape " + v["shape"].dump() + " is larger than any file");
      t.shape.push_back(int64_t(x));
    }
    const auto& o = v["data_offsets"];
    if (!o.is_array() || o.size() != 2 || !o[0].is_number_unsigned() || !o[1].is_number_unsigned())
      throw HfFormatError(at + ": data_offsets is not [begin, end] of byte offsets");
    t.begin = o[0].get<uint64_t>(), t.end = o[1].get<uint64_t>();
    if (t.end < t.begin || t.end > data_bytes)
      throw HfFormatError(at + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                          ") outside the " + std::to_string(data_bytes) + " data bytes");
    if (t.end - t.begin != need)
      throw HfFormatError(at + ": " + std::to_string(t.end - t.begin) + " bytes for a " + t.dtype + " tensor of shape " +
                          v["shape"].dump() + " (" + std::to_string(need) + " bytes)");
    covered += t.end - t.begin;
    index_[t.name] = tensors_.size();
    tensors_.push_back(std::move(t));
  }
  // The tensors cover the data exactly once: sizes sum to it and no two overlap.
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const SafeTensor& t : tensors_) spans.emplace_back(t.begin, t.end);
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second) throw HfFormatError(path + ": two tensors' data overlap");
  if (covered != data_bytes)
    throw HfFormatError(path + ": the tensors hold " + std::to_string(covered) + " bytes, the file " +
                        std::to_string(data_bytes) + " after its header");
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept
    : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)), data_start_(o.data_start_),
      tensors_(std::move(o.tensors_)), index_(std::move(o.index_)), metadata_(std::move(o.metadata_)) {}

const SafeTensor* SafetensorsFile::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::vector<unsigned char> SafetensorsFile::read_rows(const SafeTensor& t, int64_t r0, int64_t n) const {
  const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
  if (r0 < 0 || n < 0 || r0 + n > rows)
    throw HfFormatError(path_ + ": tensor " + t.name + ": rows [" + std::to_string(r0) + ", " + std::to_string(r0 + n) +
                        ") of " + std::to_string(rows));
  const uint64_t row_bytes = rows > 0 ? (t.end - t.begin) / uint64_t(rows) : 0;
  std::vector<unsigned char> out(size_t(row_bytes * uint64_t(n)));
  pread_all(fd_, out.data(), out.size(), data_start_ + t.begin + uint64_t(r0) * row_bytes, path_);
  return out;
}

std::vector<unsigned char> SafetensorsFile::read(const SafeTensor& t) const {
  return read_rows(t, 0, t.shape.empty() ? 1 : t.shape[0]);
}

}  // namespace fp8moe
