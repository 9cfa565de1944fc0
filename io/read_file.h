// Reading a whole input file (a config, a text to tokenise) with one error per failure.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

namespace fp8moe {

// The contents of the regular file `path`. Throws Error("PATH: cannot read the WHAT: REASON")
// when it does not exist, is not a regular file, is larger than max_bytes, or cannot be read.
template <class Error>
std::string read_whole_file(const std::string& path, const std::string& what, uintmax_t max_bytes = UINTMAX_MAX) {
  const std::string prefix = path + ": cannot read the " + what + ": ";
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) throw Error(prefix + "it does not exist");
  if (!std::filesystem::is_regular_file(status)) throw Error(prefix + "it is not a regular file");
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) throw Error(prefix + ec.message());
  if (size > max_bytes) throw Error(prefix + "larger than " + std::to_string(max_bytes) + " bytes");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(prefix + std::strerror(errno));
  std::string text(size, '\0');
  if (size > 0 && !in.read(text.data(), std::streamsize(size)))
    throw Error(prefix + "read error after " + std::to_string(in.gcount()) + " of " + std::to_string(size) + " bytes");
  return text;
}

}  // namespace fp8moe
