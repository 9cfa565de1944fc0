// The commit protocol of a checkpoint save (docs/ARCHITECTURE.md "Checkpoints"): the step_N
// directories, `latest`, the fsync / rename / replace / prune sequence that makes a written
// step_N.tmp/ the newest checkpoint, and the fault points the tests kill a save at.
// Internal to io/checkpoint*.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fp8moe::ckpt {

// FP8MOE_CKPT_KILL=RANK:K (io/checkpoint.h): on rank RANK, the K-th hit() sends SIGKILL to this
// process.
class FaultPoint {
 public:
  explicit FaultPoint(int rank);
  void hit();

 private:
  long long k_ = -1, count_ = 0;
};

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
