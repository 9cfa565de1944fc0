#include "app/hf_output.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <vector>

namespace fp8moe {
namespace fs = std::filesystem;

std::string unwritable_reason(const std::string& path) {
  std::error_code ec;
  const fs::path target = fs::absolute(path, ec).lexically_normal();
  if (ec) return path + ": " + ec.message();
  // The nearest ancestor that exists (a path under a regular file reports ENOTDIR: go up too).
  fs::path at = target;
  fs::file_status st = fs::status(at, ec);
  while (!fs::exists(st)) {
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
      return "cannot write " + path + ": " + at.string() + ": " + ec.message();
    if (at == at.root_path()) return "cannot write " + path + ": no directory of it exists";
    at = at.parent_path();
    st = fs::status(at, ec);
  }
  if (!fs::is_directory(st))
    return at == target ? path + " is not a directory" : "cannot create " + path + ": " + at.string() + " is not a directory";
  // NOTE: access() also reports a read-only file system (EROFS) to root, whom permissions let by.
  if (::access(at.c_str(), W_OK | X_OK) != 0)
    return "cannot write " + path + ": " + (at == target ? std::string() : at.string() + ": ") + std::strerror(errno);
  return "";
}

std::string import_destination_refusal(const std::string& dir) {
  if (std::string why = unwritable_reason(dir); !why.empty()) return why;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return "";  // to be created
  std::vector<std::string> found;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("step_", 0) == 0 || name.rfind("latest", 0) == 0) found.push_back(name);
  }
  if (ec) return "cannot list " + dir + ": " + ec.message();
  if (found.empty()) return "";
  std::sort(found.begin(), found.end());
  std::string list;
  for (size_t i = 0; i < found.size() && i < 8; ++i) list += (i ? ", " : "") + found[i];
  if (found.size() > 8) list += ", ... (" + std::to_string(found.size()) + " in all)";
  return dir + " already holds checkpoints (" + list +
         "): import into a directory without checkpoints (a new or an empty one); nothing was written";
}

}  // namespace fp8moe
