#include "parallel/mpi_session.h"

#include <cstring>
#include <set>
#include <vector>
#include <exception>

#include "kernels/check.h"
#include "kernels/backend_info.h"
#include "parallel/watchdog.h"

#ifdef FP8MOE_HAVE_CUDA
#include <nccl.h>
#endif

namespace fp8moe {
namespace {

int& thread_level() {  // as MPI_Init_thread provided it
  static int level = MPI_THREAD_SINGLE;
  return level;
}

}  // namespace

MpiSession::MpiSession(int* argc, char*** argv) {
  int provided = 0;
  // NOTE: MULTIPLE for the asynchronous checkpoint save, whose writer thread runs MPI-IO and its
  // agreements on a communicator of its own while the main thread trains (io/checkpoint.h). Where
  // the library gives less, saves are synchronous (threads_multiple()); the rest needs FUNNELED.
  if (MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
    fatal_error(__FILE__, __LINE__, "MPI_Init_thread failed");
  thread_level() = provided;
  MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
  set_fatal_context(rank_, [](int code) { MPI_Abort(MPI_COMM_WORLD, code); });
  FP8MOE_ASSERT(provided >= MPI_THREAD_FUNNELED, "MPI provides thread level ", provided, " < FUNNELED");
}

MpiSession::~MpiSession() {
  // NOTE: leaving by an exception means this rank may not reach the collectives the others are
  // in; MPI_Finalize would then wait for them forever. End the whole job instead.
  if (std::uncaught_exceptions() > 0) fatal_error(__FILE__, __LINE__, "exception unwinding through MPI shutdown");
  set_fatal_context(rank_, nullptr);
  MPI_Finalize();
}

bool threads_multiple() { return thread_level() >= MPI_THREAD_MULTIPLE; }
bool threads_serialized() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  return !initialized || thread_level() >= MPI_THREAD_SERIALIZED;
}

void broadcast_string(MPI_Comm comm, std::string& text, int root) {
  const WatchScope watch("broadcast");
  long long n = static_cast<long long>(text.size());
  MPI_CHECK(MPI_Bcast(&n, 1, MPI_LONG_LONG, root, comm));
  text.resize(static_cast<size_t>(n));
  FP8MOE_ASSERT(n <= (1LL << 30), "broadcast_string of ", n, " bytes: larger than this helper supports");
  if (n > 0) MPI_CHECK(MPI_Bcast(text.data(), static_cast<int>(n), MPI_CHAR, root, comm));
}

bool any_rank(MPI_Comm comm, bool flag) {
  const WatchScope watch("agreement (any rank)");
  int local = flag ? 1 : 0, global = 0;
  MPI_CHECK(MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MAX, comm));
  return global != 0;
}

std::string first_error(MPI_Comm comm, const std::string& error, int* kind) {
  const WatchScope watch("agreement (first error)");
  int rank = 0, size = 1;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_size(comm, &size));
  int local = error.empty() ? size : rank, first = size;
  MPI_CHECK(MPI_Allreduce(&local, &first, 1, MPI_INT, MPI_MIN, comm));
  std::string text = first == rank ? error : std::string();
  if (first < size) {
    broadcast_string(comm, text, first);
    if (kind) MPI_CHECK(MPI_Bcast(kind, 1, MPI_INT, first, comm));
  }
  return text;
}

NodePlace node_place(MPI_Comm comm) {
  MPI_Comm node;
  NodePlace p;
  MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  MPI_CHECK(MPI_Comm_rank(node, &p.local_rank));
  MPI_CHECK(MPI_Comm_size(node, &p.local_size));
  MPI_CHECK(MPI_Comm_free(&node));
  return p;
}

int node_index(MPI_Comm comm, int ranks_per_node) {
  int rank = 0;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  if (ranks_per_node > 0) return rank / ranks_per_node;
  MPI_Comm node;
  MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int lowest = rank;
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &lowest, 1, MPI_INT, MPI_MIN, node));
  MPI_CHECK(MPI_Comm_free(&node));
  return lowest;
}

bool distinct_gpus_per_node(MPI_Comm comm, int ordinal) {
  constexpr int kIdLen = 32;  // "0000:8a:00.0"
  char mine[kIdLen] = {};
  const std::string id = ordinal >= 0 ? cuda_device_pci_id(ordinal) : "";
  std::strncpy(mine, id.c_str(), kIdLen - 1);
  MPI_Comm node;
  int size = 1;
  MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  MPI_CHECK(MPI_Comm_size(node, &size));
  std::vector<char> all(static_cast<size_t>(size) * kIdLen);
  MPI_CHECK(MPI_Allgather(mine, kIdLen, MPI_CHAR, all.data(), kIdLen, MPI_CHAR, node));
  MPI_CHECK(MPI_Comm_free(&node));
  std::set<std::string> seen;
  bool ok = !id.empty();
  for (int r = 0; r < size; ++r) ok = seen.insert(std::string(&all[size_t(r) * kIdLen])).second && ok;
  return !any_rank(comm, !ok);
}

std::string mpi_library_version() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(buf, &len);
  std::string s(buf, static_cast<size_t>(len));
  s.resize(std::strlen(s.c_str()));  // Open MPI counts the terminating NUL in len
  if (auto nl = s.find_first_of("\r\n"); nl != std::string::npos) s.resize(nl);
  return s;
}

std::string nccl_version() {
#ifdef FP8MOE_HAVE_CUDA
  int v = 0;
  NCCL_CHECK(ncclGetVersion(&v));
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
#else
  return "not built";
#endif
}

}  // namespace fp8moe
