#include "io/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>

#include "io/read_file.h"

namespace fp8moe {
namespace {

// "host H, pid P, started YYYY-MM-DD HH:MM:SS UTC" of this process, now.
std::string this_process() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::snprintf(host, sizeof host, "?");
  const std::time_t t = std::time(nullptr);
  std::tm utc{};
  ::gmtime_r(&t, &utc);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &utc);
  return std::string("host ") + host + ", pid " + std::to_string(::getpid()) + ", started " + when;
}

bool no_locks_here(int err) { return err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS; }

}  // namespace

DirLock::DirLock(const std::string& path, const std::string& holder) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) throw DirLockError(path + ": cannot open the lock file: " + std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) {
      std::string who;
      try {
        who = read_whole_file<DirLockError>(path, "lock file", 4096);
      } catch (const DirLockError&) {  // unreadable: the refusal says "another process"
      }
      while (!who.empty() && (who.back() == '\n' || who.back() == '\0')) who.pop_back();
      throw DirLockBusy(path, who);
    }
    if (no_locks_here(err)) {
      std::fprintf(stderr, "fp8moe: warning: %s: the file system takes no locks (%s): one run per directory is not "
                   "enforced here\n", path.c_str(), std::strerror(err));
      return;
    }
    throw DirLockError(path + ": cannot lock: " + std::strerror(err));
  }
  fd_ = fd;
  const std::string text = holder + ", " + this_process() + "\n";
  // Best effort: the description only serves a refusal's message.
  [[maybe_unused]] const bool described =
      ::ftruncate(fd_, 0) == 0 && ::pwrite(fd_, text.data(), text.size(), 0) == ssize_t(text.size());
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

}  // namespace fp8moe
