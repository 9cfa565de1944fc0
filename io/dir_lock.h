// One writer per directory: an advisory lock (flock(2), exclusive, never waited for) on a lock file,
// held for as long as the DirLock lives. `fp8moe train` holds checkpoint.dir's (rank 0, for the whole
// run, DIR/.fp8moe.lock), `fp8moe import` that of the checkpoint directory it writes (the same file),
// and `fp8moe export` that of its output directory (beside it, as the export replaces the directory
// whole: app/hf_output.h), so that a second writer is refused at once, naming the holder.
//
// The kernel releases a flock when its holder's descriptor closes, however the process ends (exit,
// SIGKILL, a node's OOM killer), so a lock file left behind by a dead run is no lock: the next one
// simply takes it. The file holds the holder's description ("fp8moe train, host H, pid P, started
// T"), rewritten by each holder, for the refusal's message; it stays in the directory.
//
// flock is honoured by local file systems, NFSv4 (as a byte-range lock) and GPFS; Lustre only when
// mounted with -o flock (with -o localflock, only between processes of one node). Where the file
// system refuses it (ENOLCK, EOPNOTSUPP, ENOSYS) the DirLock warns once on stderr that one run per
// directory is not enforced there and goes on unlocked: a missing lock must not stop a run.
#pragma once

#include <stdexcept>
#include <string>

namespace fp8moe {

// Another live process holds the lock: its description as it wrote it ("" when it had not yet).
struct DirLockBusy : std::runtime_error {
  DirLockBusy(const std::string& path, const std::string& holder_text)
      : std::runtime_error(path + " is held by " + (holder_text.empty() ? "another process" : holder_text)),
        holder(holder_text) {}
  std::string holder;
};
// The lock file cannot be created or opened (a missing or read-only directory, permissions).
struct DirLockError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class DirLock {
 public:
  // The lock file of a checkpoint directory.
  static std::string of_checkpoint_dir(const std::string& dir) { return dir + "/.fp8moe.lock"; }

  // Takes the lock file `path` (created; its directory must exist) for `holder` ("fp8moe train"),
  // or throws DirLockBusy / DirLockError.
  DirLock(const std::string& path, const std::string& holder);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

  bool held() const { return fd_ >= 0; }  // false where the file system has no locks (warned)

 private:
  int fd_ = -1;
};

}  // namespace fp8moe
