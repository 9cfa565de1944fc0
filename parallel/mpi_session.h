// MPI start-up and shutdown, and the few host-side MPI helpers app/ needs before the model exists.
#pragma once

#include <mpi.h>

#include <string>

namespace fp8moe {

// RAII for MPI_Init_thread / MPI_Finalize. On start it sets MPI_ERRORS_RETURN on MPI_COMM_WORLD
// (so MPI_CHECK can decode errors; derived communicators inherit it) and installs the fatal-error
// context of kernels/check.h: this rank's number and an MPI_Abort hook.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  int rank_ = 0;
  int size_ = 1;
};

// Broadcasts `text` from `root` to every rank of `comm` (collective).
void broadcast_string(MPI_Comm comm, std::string& text, int root);

// True on every rank when `flag` is true on any rank of `comm` (collective).
bool any_rank(MPI_Comm comm, bool flag);

// "Open MPI v4.1.4, ..." (first line of MPI_Get_library_version); callable before MPI_Init.
std::string mpi_library_version();

// "2.28.3" when built with CUDA, else "not built".
std::string nccl_version();

}  // namespace fp8moe
