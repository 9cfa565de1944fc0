// Where `fp8moe export` and `fp8moe import` write, checked before they write anything: a path that
// cannot be a directory of theirs is a usage error (exit 2) naming it, never a failure half-way.
//
// An export replaces its directory whole, under a lock (ExportTarget, below). In the directory's
// parent, beside hf/keep:
//   hf/.keep.lock        the lock (flock, held for the whole export; the kernel releases it when its
//                        holder dies), holding "host H, pid P, started T" of its holder; it stays
//   hf/.keep.tmp-<pid>   the new export while it is written; moved in whole once complete and
//                        verified, or removed when the export fails
//   hf/.keep.old-<pid>   the old directory set aside, only where the file system cannot exchange two
//                        directories atomically (renameat2 RENAME_EXCHANGE), for two renames' time
// The rule for leftovers: the export that takes the lock removes every .keep.tmp-* (an export that
// died before moving it in, or after moving the old one there), and puts a .keep.old-* back as
// hf/keep when hf/keep is missing (an export that died between the two renames), else removes it.
// A live export holds the lock, so whatever the lock's holder finds there is a dead one's.
#pragma once

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include "io/checkpoint_faults.h"  // export_fault_point
#include "io/dir_lock.h"

namespace fp8moe {

// A directory export or import cannot use: the message names it and why (exit 2).
struct OutputRefused : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Why directory `path` (existing or to be created) cannot be written: it is not a directory, its
// nearest existing ancestor is not one, or that ancestor is not writable (a read-only file system,
// permissions). "" when it can.
std::string unwritable_reason(const std::string& path);

// Why import may not write a checkpoint into `dir`: unwritable (above), or it already holds
// checkpoints (entries named step_* or latest*, which are listed). "" when it may: absent, empty, or
// holding other files only.
std::string import_destination_refusal(const std::string& dir);

// The directory an export writes, replaced whole (above). Only the lock's holder touches it.
class ExportTarget {
 public:
  // Takes the lock, deals with dead exports' leftovers (above) and makes the staging directory.
  // Throws OutputRefused when the path cannot be used or another export holds the lock (naming its
  // holder), HfFormatError when the file system fails.
  explicit ExportTarget(const std::string& out_dir);
  ~ExportTarget();  // not committed: the staging directory goes; the lock is released
  ExportTarget(const ExportTarget&) = delete;
  ExportTarget& operator=(const ExportTarget&) = delete;
  const std::string& staging() const { return staging_; }
  // Moves the staging directory in as the target, whole. What the old directory holds that the
  // export does not write (`written(name)` false: a tokenizer copied there by hand, ...) is carried
  // over first, as hard links (a copy where a link cannot be made). Throws HfFormatError or
  // OutputRefused; when it throws, the target is as it was.
  void commit(const std::function<bool(const std::string& name)>& written);

 private:
  std::string out_, target_, parent_, name_, staging_, lock_path_;
  std::unique_ptr<DirLock> lock_;
  bool committed_ = false;
  void lock();
  void clean_leftovers();
};

// Fault points of an export (io/checkpoint_faults.h: only in the tests' fp8moe-faults): locked (the
// lock taken, the staging directory made), shard (the first safetensors file written), written
// (every file written, verified and carried over, before the swap), aside (the old directory set
// aside, two-rename path), swapped (the new directory in place, the old one not yet removed).

}  // namespace fp8moe
