// The commit protocol of a checkpoint save (io/checkpoint_commit.h): fsync of files and
// directories, the step_N directory names and their listing, `latest`, the commit sequence with
// its pruning (its fault points: io/checkpoint_faults.h).
#include "io/checkpoint_commit.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "io/read_file.h"

namespace fp8moe::ckpt {
namespace fs = std::filesystem;

// ---------------------------------------------------------------- file system

namespace {

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw CheckpointError(path + ": cannot open for fsync: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw CheckpointError(path + ": fsync failed: " + std::strerror(err));
}

std::string megabytes(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", bytes / 1e6);
  return buf;
}

const std::regex& step_dir_pattern() {
  static const std::regex re("step_([0-9]{8})");
  return re;
}

}  // namespace

int64_t free_bytes(const std::string& dir) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return -1;
  return int64_t(st.f_bavail) * int64_t(st.f_frsize);
}

void check_space(const std::string& dir, int64_t bytes) {
  const std::string path = dir + "/space.check";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw CheckpointError(path + ": cannot create: " + std::strerror(errno));
  int err = ::fallocate(fd, 0, 0, off_t(bytes)) == 0 ? 0 : errno;
  ::close(fd);
  ::unlink(path.c_str());
  if (err == EOPNOTSUPP || err == ENOSYS) {  // no preallocation here: compare with the free space
    struct statvfs st {};
    if (::statvfs(dir.c_str(), &st) != 0) throw CheckpointError(dir + ": statvfs failed: " + std::strerror(errno));
    err = double(st.f_bavail) * double(st.f_frsize) < double(bytes) ? ENOSPC : 0;
  }
  if (err == ENOSPC || err == EDQUOT) {
    struct statvfs st {};
    const double free_bytes = ::statvfs(dir.c_str(), &st) == 0 ? double(st.f_bavail) * double(st.f_frsize) : 0;
    throw CheckpointError(dir + ": " + std::strerror(err) + ": the checkpoint needs about " + megabytes(double(bytes)) +
                          ", " + megabytes(free_bytes) + " are free");
  }
  if (err != 0) throw CheckpointError(path + ": cannot allocate " + megabytes(double(bytes)) + ": " + std::strerror(err));
}

std::vector<std::pair<int64_t, std::string>> committed_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) throw CheckpointUnreadable(dir + ": cannot list: " + ec.message());
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    std::smatch m;
    const std::string name = it->path().filename().string();
    std::error_code type_ec;
    if (it->is_directory(type_ec) && std::regex_match(name, m, step_dir_pattern())) out.emplace_back(std::stoll(m[1]), name);
    if (type_ec && std::regex_match(name, step_dir_pattern()))
      throw CheckpointUnreadable(dir + "/" + name + ": cannot read: " + type_ec.message());
  }
  if (ec) throw CheckpointUnreadable(dir + ": cannot list: " + ec.message());
  std::sort(out.rbegin(), out.rend());
  return out;
}

std::string read_latest(const std::string& dir, std::string* problem) {
  const std::string path = dir + "/latest";
  std::error_code ec;
  const bool exists = fs::exists(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) throw CheckpointUnreadable(path + ": cannot read: " + ec.message());
  if (!exists) return *problem = path + " does not exist", "";
  // One short line: a FIFO, a device or a file of more than a line's length is refused (exit 2), not
  // waited on or read without end.
  const std::string text = read_whole_file<CheckpointUnreadable>(path, "checkpoint pointer (latest)", 4096);
  const std::string name = text.substr(0, text.find('\n'));
  if (!std::regex_match(name, step_dir_pattern()) || !fs::is_directory(dir + "/" + name, ec)) {
    std::string shown = name.substr(0, 40);
    for (char& c : shown)
      if (c < 32 || c > 126) c = '?';
    return *problem = path + " does not name a checkpoint directory (it holds \"" + shown + "\")", "";
  }
  return name;
}

// ---------------------------------------------------------------- the commit

void commit_checkpoint(const std::string& dir, const std::string& name, int keep_last, FaultPoint& fault) {
  const std::string final_dir = dir + "/" + name, tmp_dir = final_dir + ".tmp";
  const std::string path = tmp_dir + "/" + kCheckpointFile;
  try {
    fault.hit();
    fsync_path(path);
    fsync_path(tmp_dir);
    fault.hit();
    std::error_code ec;
    if (fs::exists(final_dir, ec)) {
      // Re-saving a step that exists (a resumed run): swap atomically, then drop the old copy.
      if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0)
        throw CheckpointError(final_dir + ": cannot replace: " + std::strerror(errno));
      fs::remove_all(tmp_dir, ec);
    } else if (::rename(tmp_dir.c_str(), final_dir.c_str()) != 0) {
      throw CheckpointError(tmp_dir + ": cannot rename to " + final_dir + ": " + std::strerror(errno));
    }
    fault.hit();
    fsync_path(dir);
    fault.hit();
    fault.fill_at("before-latest");
    const std::string latest = dir + "/latest", latest_tmp = latest + ".tmp";
    {
      std::ofstream out(latest_tmp, std::ios::trunc);
      out << name << "\n";
      out.flush();
      if (!out) throw CheckpointError(latest_tmp + ": cannot write");
    }
    fsync_path(latest_tmp);
    fault.hit();
    if (::rename(latest_tmp.c_str(), latest.c_str()) != 0)
      throw CheckpointError(latest_tmp + ": cannot rename to " + latest + ": " + std::strerror(errno));
    fsync_path(dir);
    fault.hit();
    // Only now: checkpoints beyond keep_last (oldest first; never the one just committed), and
    // leftovers of crashed saves.
    auto all = committed_checkpoints(dir);
    for (size_t i = all.size(); i-- > size_t(keep_last);) {
      if (all[i].second == name) continue;
      fs::remove_all(dir + "/" + all[i].second, ec);
      fault.hit();
    }
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string f = e.path().filename().string();
      if (f.size() > 4 && f.compare(f.size() - 4, 4, ".tmp") == 0 && f.rfind("step_", 0) == 0) fs::remove_all(e.path(), ec);
    }
  } catch (const fs::filesystem_error& e) {
    throw CheckpointError(e.what());
  }
}

}  // namespace fp8moe::ckpt

namespace fp8moe {

// Declared in io/checkpoint.h.
std::string checkpoint_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", (long long)step);
  return buf;
}

}  // namespace fp8moe
