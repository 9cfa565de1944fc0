#include "parallel/communicator.h"

#include <algorithm>
#include <climits>

#include "kernels/check.h"
#include "parallel/mpi_session.h"

namespace fp8moe {
namespace {

// MPI counts are int: long buffers go in pieces of at most 2^30 elements.
template <class T>
void allreduce_chunked(MPI_Comm comm, T* data, int64_t n, MPI_Datatype type, MPI_Op op) {
  constexpr int64_t kChunk = int64_t(1) << 30;
  for (int64_t off = 0; off < n; off += kChunk) {
    const int count = int(std::min(kChunk, n - off));
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data + off, count, type, op, comm));
  }
}

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm) : comm_(comm) {
  MPI_CHECK(MPI_Comm_rank(comm, &rank_));
  MPI_CHECK(MPI_Comm_size(comm, &size_));
}

void MpiCommunicator::allreduce_sum(float* d, int64_t n) { allreduce_chunked(comm_, d, n, MPI_FLOAT, MPI_SUM); }
void MpiCommunicator::allreduce_sum(double* d, int64_t n) { allreduce_chunked(comm_, d, n, MPI_DOUBLE, MPI_SUM); }
void MpiCommunicator::allreduce_sum(int64_t* d, int64_t n) { allreduce_chunked(comm_, d, n, MPI_INT64_T, MPI_SUM); }
void MpiCommunicator::allreduce_sum(uint64_t* d, int64_t n) { allreduce_chunked(comm_, d, n, MPI_UINT64_T, MPI_SUM); }
void MpiCommunicator::allreduce_max(float* d, int64_t n) { allreduce_chunked(comm_, d, n, MPI_FLOAT, MPI_MAX); }
void MpiCommunicator::allreduce_max(double* d, int64_t n) { allreduce_chunked(comm_, d, n, MPI_DOUBLE, MPI_MAX); }
void MpiCommunicator::broadcast(std::string& text, int root) { broadcast_string(comm_, text, root); }
void MpiCommunicator::barrier() { MPI_CHECK(MPI_Barrier(comm_)); }

}  // namespace fp8moe
