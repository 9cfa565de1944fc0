// The fault points of a checkpoint save (io/checkpoint_faults.h): without FP8MOE_TEST_FAULTS (the
// product) they do nothing and read nothing; with it (`fp8moe-faults`, for the tests) they read
// FP8MOE_CKPT_KILL, FP8MOE_CKPT_STOP and FP8MOE_CKPT_FILL, an export's FP8MOE_EXPORT_KILL,
// FP8MOE_EXPORT_STOP and FP8MOE_EXPORT_NO_EXCHANGE, and an overlapped collective's FP8MOE_WAIT_STOP.
#include "io/checkpoint_faults.h"

#include <utility>

#ifdef FP8MOE_TEST_FAULTS
#include <fcntl.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <mpi.h>

#include "parallel/watchdog.h"
#endif

namespace fp8moe::ckpt {

#ifndef FP8MOE_TEST_FAULTS

FaultPoint::FaultPoint(int, std::string dir) : dir_(std::move(dir)) {}
void FaultPoint::hit() {}
void FaultPoint::fill_at(const char*) {}

#else

FaultPoint::FaultPoint(int rank, std::string dir) : dir_(std::move(dir)) {
  int r = -1;
  long long k = -1;
  for (const auto& [name, sig] : {std::pair{"FP8MOE_CKPT_KILL", SIGKILL}, std::pair{"FP8MOE_CKPT_STOP", SIGSTOP}}) {
    const char* v = std::getenv(name);
    if (v && std::sscanf(v, "%d:%lld", &r, &k) == 2 && r == rank) k_ = k, signal_ = sig;
  }
  const char* v = std::getenv("FP8MOE_CKPT_FILL");
  char point[32] = {};
  if (v && std::sscanf(v, "%d:%31s", &r, point) == 2 && r == rank) fill_point_ = point;
}

void FaultPoint::fill_at(const char* point) {
  if (fill_point_ != point) return;
  struct statfs fs {};
  if (::statfs(dir_.c_str(), &fs) != 0 || fs.f_type != TMPFS_MAGIC) {
    std::fprintf(stderr, "fp8moe: warning: FP8MOE_CKPT_FILL: %s is not on a tmpfs: not filled\n", dir_.c_str());
    return;
  }
  const std::string path = dir_ + "/fill.bin";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return;
  std::vector<char> zeros(1 << 16, 0);
  for (size_t chunk = zeros.size(); chunk > 0;)  // until not even one byte fits
    if (::write(fd, zeros.data(), chunk) <= 0) chunk /= 2;
  ::close(fd);
}

void FaultPoint::hit() {
  if (k_ > 0 && ++count_ == k_) {
    std::fflush(nullptr);
    ::raise(signal_);
  }
}

#endif

}  // namespace fp8moe::ckpt

namespace fp8moe {

#ifndef FP8MOE_TEST_FAULTS

void export_fault_point(const char*) {}
bool export_without_exchange() { return false; }

#else

void export_fault_point(const char* point) {
  for (const auto& [var, sig] : {std::pair{"FP8MOE_EXPORT_KILL", SIGKILL}, std::pair{"FP8MOE_EXPORT_STOP", SIGSTOP}})
    if (const char* v = std::getenv(var); v && std::strcmp(v, point) == 0) {
      std::fflush(nullptr);
      ::raise(sig);
    }
}

bool export_without_exchange() { return std::getenv("FP8MOE_EXPORT_NO_EXCHANGE") != nullptr; }

namespace {
// FP8MOE_WAIT_STOP=RANK:K: the process of rank RANK (MPI_COMM_WORLD's) sends itself SIGSTOP
// before its K-th wait for an overlapped collective (parallel/watchdog.h wait_fault_point).
void wait_stop() {
  static long long count = 0;
  static const long long k = [] {
    int r = -1, me = -1;
    long long at = -1;
    const char* v = std::getenv("FP8MOE_WAIT_STOP");
    if (!v || std::sscanf(v, "%d:%lld", &r, &at) != 2) return -1LL;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    return r == me ? at : -1LL;
  }();
  if (k > 0 && ++count == k) {
    std::fflush(nullptr);
    ::raise(SIGSTOP);
  }
}
const bool wait_stop_installed = (set_wait_fault_point(&wait_stop), true);
}  // namespace

#endif

}  // namespace fp8moe
