// The commit protocol of a checkpoint save (docs/ARCHITECTURE.md "Checkpoints"): the step_N
// directories, `latest`, the fsync / rename / replace / prune sequence that makes a written
// step_N.tmp/ the newest checkpoint. The fault points the tests kill a save at are
// io/checkpoint_faults.h.
// Internal to io/checkpoint*.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "io/checkpoint_faults.h"

namespace fp8moe::ckpt {

// Fails (CheckpointError naming the directory, the bytes needed and free) unless `bytes` can be
// allocated in the file system of `dir` now: a scratch file is allocated (fallocate) and deleted;
// where the file system cannot preallocate, its free space (statvfs) is compared instead.
void check_space(const std::string& dir, int64_t bytes);

// Bytes an unprivileged writer can still put in the file system of `dir` (statvfs); -1 if unknown.
int64_t free_bytes(const std::string& dir);

// Committed checkpoints of a directory, newest (highest step) first.
std::vector<std::pair<int64_t, std::string>> committed_checkpoints(const std::string& dir);

// What <dir>/latest names ("" when missing), and a complaint when it is not a checkpoint.
std::string read_latest(const std::string& dir, std::string* problem);

// Rank 0's part of a save once every rank has written and closed <dir>/<name>.tmp/checkpoint.h5:
// fsync the file and <name>.tmp/, rename that to <dir>/<name> (swapping with an existing one),
// fsync <dir>, replace <dir>/latest atomically, then delete committed checkpoints beyond keep_last
// (never <name>) and leftover step_*.tmp directories. Fault points: on entry (the agreement), then
// after the fsync, the rename, the directory fsync, latest.tmp written, latest renamed and each
// deletion. Throws CheckpointError.
void commit_checkpoint(const std::string& dir, const std::string& name, int keep_last, FaultPoint& fault);

}  // namespace fp8moe::ckpt
