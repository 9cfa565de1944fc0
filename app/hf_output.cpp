#include "app/hf_output.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <system_error>
#include <vector>

#include "io/safetensors.h"

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

// ---------------------------------------------------------------- the export's directory

namespace {

std::string errno_text() { return std::strerror(errno); }

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const std::string why = errno_text();
    if (fd >= 0) ::close(fd);
    throw HfFormatError(dir + ": cannot sync the directory: " + why);
  }
  ::close(fd);
}

// Whether `entry` (a file name beside the target) is `.<name>.<kind>-<digits>`.
bool leftover(const std::string& entry, const std::string& name, const std::string& kind) {
  const std::string prefix = "." + name + "." + kind + "-";
  if (entry.size() <= prefix.size() || entry.compare(0, prefix.size(), prefix) != 0) return false;
  return std::all_of(entry.begin() + long(prefix.size()), entry.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// `src` (an entry of the old directory) as `dst` in the new one: directories made anew, files hard
// links (copies where a link cannot be made), symbolic links copied as links.
void carry_over(const fs::path& src, const fs::path& dst) {
  const fs::file_status st = fs::symlink_status(src);
  if (fs::is_symlink(st)) {
    fs::copy_symlink(src, dst);
  } else if (fs::is_directory(st)) {
    fs::create_directory(dst, src);
    for (const fs::directory_entry& e : fs::directory_iterator(src)) carry_over(e.path(), dst / e.path().filename());
  } else if (fs::is_regular_file(st)) {
    std::error_code ec;
    fs::create_hard_link(src, dst, ec);
    if (ec) fs::copy_file(src, dst);
  } else {
    throw OutputRefused(src.string() + " is neither a file, a directory nor a link: the export cannot carry it over "
                        "into the new directory; move it away and export again");
  }
}

}  // namespace

ExportTarget::ExportTarget(const std::string& out_dir) : out_(out_dir) {
  std::error_code ec;
  fs::path t = fs::absolute(out_dir, ec).lexically_normal();
  if (!t.has_filename()) t = t.parent_path();  // "hf/keep/"
  // A link to a directory: the directory it names is replaced, the link stays.
  if (fs::is_symlink(fs::symlink_status(t, ec))) {
    t = fs::canonical(t, ec);
    if (ec) throw OutputRefused(out_ + " is a symbolic link to nothing: " + ec.message());
  }
  if (t == t.root_path()) throw OutputRefused(out_ + " is the root directory: the export replaces its directory whole");
  target_ = t.string(), parent_ = t.parent_path().string(), name_ = t.filename().string();
  for (const std::string& p : {target_, parent_})
    if (std::string why = unwritable_reason(p); !why.empty()) throw OutputRefused(why);
  fs::create_directories(parent_, ec);
  if (ec) throw OutputRefused("cannot create " + parent_ + ": " + ec.message());
  struct stat a {}, b {};
  if (::stat(target_.c_str(), &a) == 0 && ::stat(parent_.c_str(), &b) == 0 && a.st_dev != b.st_dev)
    throw OutputRefused(out_ + " is a mount point: the export replaces its directory whole, which cannot be done to "
                        "a mount point; export into a directory inside it");
  lock_path_ = parent_ + "/." + name_ + ".lock";
  lock();
  clean_leftovers();
  staging_ = parent_ + "/." + name_ + ".tmp-" + std::to_string(::getpid());
  if (!fs::create_directory(staging_, ec) || ec)
    throw HfFormatError(staging_ + ": cannot create: " + (ec ? ec.message() : "it exists"));
  export_fault_point("locked");
}

void ExportTarget::lock() {
  try {
    lock_ = std::make_unique<DirLock>(lock_path_, "fp8moe export");
  } catch (const DirLockBusy& e) {
    throw OutputRefused(out_ + " is being written by another export (" +
                        (e.holder.empty() ? "it has not named itself yet" : e.holder) + "; lock file " + lock_path_ +
                        "): wait for it to end, or stop it (a dead export's lock is free)");
  } catch (const DirLockError& e) {
    throw OutputRefused(std::string("cannot write ") + out_ + ": " + e.what());
  }
}

void ExportTarget::clean_leftovers() {
  std::vector<fs::path> tmp, old;
  for (const fs::directory_entry& e : fs::directory_iterator(parent_)) {
    const std::string f = e.path().filename().string();
    if (leftover(f, name_, "tmp")) tmp.push_back(e.path());
    if (leftover(f, name_, "old")) old.push_back(e.path());
  }
  std::sort(old.begin(), old.end());
  for (const fs::path& p : old) {
    if (!fs::exists(target_)) {
      fs::rename(p, target_);
      std::printf("export: note: %s put back: an export that died while replacing it had set it aside as %s\n",
                  out_.c_str(), p.c_str());
    } else {
      tmp.push_back(p);
    }
  }
  for (const fs::path& p : tmp) {
    fs::remove_all(p);
    std::printf("export: note: removed %s, left by an export that did not finish\n", p.c_str());
  }
}

ExportTarget::~ExportTarget() {
  std::error_code ec;
  if (!committed_ && !staging_.empty()) fs::remove_all(staging_, ec);
  lock_.reset();  // releases the lock
}

void ExportTarget::commit(const std::function<bool(const std::string&)>& written) {
  std::error_code ec;
  const bool replacing = fs::is_directory(target_, ec);
  if (replacing) {
    for (const fs::directory_entry& e : fs::directory_iterator(target_))
      if (!written(e.path().filename().string())) carry_over(e.path(), fs::path(staging_) / e.path().filename());
    // The directory keeps its mode and, where this process may give it (root: EPERM otherwise, and
    // the new directory is this user's, as the files the export writes are), its owner.
    fs::permissions(staging_, fs::status(target_).permissions());
    struct stat st {};
    if (::stat(target_.c_str(), &st) == 0 && ::chown(staging_.c_str(), st.st_uid, st.st_gid) != 0 && errno != EPERM)
      throw HfFormatError(staging_ + ": cannot give it the owner of " + target_ + ": " + errno_text());
  }
  fsync_dir(staging_);
  export_fault_point("written");
  std::string old;  // where the old directory is once the new one is in
  if (!replacing) {
    if (::rename(staging_.c_str(), target_.c_str()) != 0)
      throw HfFormatError("cannot move " + staging_ + " to " + target_ + ": " + errno_text());
  } else if (!export_without_exchange() &&
             ::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, target_.c_str(), RENAME_EXCHANGE) == 0) {
    old = staging_;  // the two directories exchanged at once
  } else if (export_without_exchange() || errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) {
    // No atomic exchange on this file system: the old directory aside, then the new one in
    // (a crash between the two leaves .<name>.old-<pid>, which the next export puts back).
    old = parent_ + "/." + name_ + ".old-" + std::to_string(::getpid());
    if (::rename(target_.c_str(), old.c_str()) != 0)
      throw HfFormatError("cannot move " + target_ + " aside: " + errno_text());
    export_fault_point("aside");
    if (::rename(staging_.c_str(), target_.c_str()) != 0) {
      const std::string why = errno_text();
      ::rename(old.c_str(), target_.c_str());
      throw HfFormatError("cannot move " + staging_ + " to " + target_ + ": " + why);
    }
  } else {
    throw HfFormatError("cannot exchange " + staging_ + " and " + target_ + ": " + errno_text());
  }
  committed_ = true;
  try {
    fsync_dir(parent_);
  } catch (const HfFormatError& e) {  // the export is in place: say so, do not fail it
    std::printf("export: note: %s\n", e.what());
  }
  export_fault_point("swapped");
  if (!old.empty() && (fs::remove_all(old, ec), ec))
    std::printf("export: note: could not remove the old export %s (%s); the next export will\n", old.c_str(),
                ec.message().c_str());
}

}  // namespace fp8moe
