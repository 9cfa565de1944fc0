// The safetensors file format (Hugging Face's, https://github.com/huggingface/safetensors): an
// 8-byte little-endian header length N, N bytes of JSON, then the tensors' bytes. The JSON maps
// each tensor name to {"dtype", "shape", "data_offsets": [begin, end)} (offsets into the data
// that follows the header; the tensors cover it without gaps or overlaps) and may hold a
// "__metadata__" object of strings. Tensors are row-major and little-endian.
//
// The writer streams: the header is made from the names, dtypes and shapes before any data, then
// each tensor's bytes are appended in the order given, so that a model of any size is written one
// tensor at a time. The reader checks the header against the file (every offset inside it, every
// size the product of its shape and element size, the data covered exactly) and reads one tensor,
// or some of its rows, with pread.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace fp8moe {

// A file or directory that is not what it should be; the message names the file.
struct HfFormatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct SafeTensor {
  std::string name;
  std::string dtype;  // "F32", "BF16", "F16", "F8_E4M3", "F8_E5M2", "I64", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // data offsets (the reader fills them; the writer computes them)
  int64_t numel() const;
};

// Bytes per element of a safetensors dtype name; 0 for one this reader does not know.
size_t safetensors_dtype_size(const std::string& dtype);

class SafetensorsWriter {
 public:
  // Creates `path` (replacing it) and writes the header for `tensors`, in this order.
  SafetensorsWriter(const std::string& path, std::vector<SafeTensor> tensors,
                    const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  // Appends bytes of the current tensor (the first not yet complete); a tensor may be written in
  // several calls. Throws when more bytes come than the tensors hold.
  void write(const void* data, size_t bytes);
  // Checks that every tensor is complete, flushes and closes; throws on an I/O error.
  void close();

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t data_bytes_ = 0, written_ = 0;
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // reads and checks the header
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& o) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  const std::string& path() const { return path_; }
  const std::vector<SafeTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafeTensor* find(const std::string& name) const;  // nullptr when absent
  // Rows [r0, r0 + n) of tensor t (its first dimension; a 1-D tensor is one row), as stored.
  std::vector<unsigned char> read_rows(const SafeTensor& t, int64_t r0, int64_t n) const;
  std::vector<unsigned char> read(const SafeTensor& t) const;

 private:
  void parse_header();  // fills the rest from the file; throws HfFormatError
  std::string path_;
  int fd_ = -1;
  uint64_t data_start_ = 0;
  std::vector<SafeTensor> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace fp8moe
