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

// Whether MPI was started with MPI_THREAD_MULTIPLE (MpiSession asks for it): a second thread may
// then make MPI calls, on a communicator of its own (the asynchronous checkpoint writer).
bool threads_multiple();
// Whether threads may make MPI calls one at a time (MPI_THREAD_SERIALIZED or more: a pair of
// passes, parallel/pass_pair.h). True without an MPI session (nothing to ask).
bool threads_serialized();

// Broadcasts `text` from `root` to every rank of `comm` (collective).
void broadcast_string(MPI_Comm comm, std::string& text, int root);

// True on every rank when `flag` is true on any rank of `comm` (collective).
bool any_rank(MPI_Comm comm, bool flag);

// The `error` of the lowest rank of `comm` whose error is not empty, on every rank; empty when no
// rank has one (collective). For checks that may fail on some ranks only (files differ between
// nodes, or each rank checks its own part). `kind`, when given, is set to that rank's *kind (the
// type of its error, for the caller to rethrow).
std::string first_error(MPI_Comm comm, const std::string& error, int* kind = nullptr);

// This rank's place among the ranks of `comm` on its node (MPI_Comm_split_type shared). Collective.
struct NodePlace {
  int local_rank = 0, local_size = 1;
};
NodePlace node_place(MPI_Comm comm);
// The index of this rank's node: ranks_per_node > 0: rank / ranks_per_node (declared); 0: the
// lowest rank of `comm` on this rank's node (MPI's shared-memory split). Collective when 0.
int node_index(MPI_Comm comm, int ranks_per_node);

// True on every rank when, on every node, the ranks that each take CUDA device `ordinal` of those
// they see use distinct GPUs (compared by PCI bus id, so per-rank CUDA_VISIBLE_DEVICES counts
// right); false when any rank has none or two share one (NCCL refuses that). Collective.
bool distinct_gpus_per_node(MPI_Comm comm, int ordinal);

// "Open MPI v4.1.4, ..." (first line of MPI_Get_library_version); callable before MPI_Init.
std::string mpi_library_version();

// "2.28.3" when built with CUDA, else "not built".
std::string nccl_version();

}  // namespace fp8moe
