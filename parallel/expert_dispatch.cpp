#include "parallel/expert_dispatch.h"

#include <algorithm>
#include <numeric>

#include "kernels/check.h"

namespace fp8moe {

ExpertDispatcher::ExpertDispatcher(Communicator& group, int n_experts) : group_(group), experts_(n_experts) {
  FP8MOE_ASSERT(n_experts % group.size() == 0, n_experts, " experts over ", group.size(), " expert-parallel ranks");
  local_ = ExpertOwnership{n_experts, group.size()}.per_rank();
}

DispatchPlan ExpertDispatcher::plan(const int64_t* counts) {
  const int P = group_.size(), L = local_;
  DispatchPlan p;
  p.ranks = P, p.local_experts = L;
  p.send_rows.assign(size_t(P), 0);
  for (int j = 0; j < P; ++j)
    for (int l = 0; l < L; ++l) p.send_rows[size_t(j)] += counts[j * L + l];
  p.recv_counts.resize(size_t(P * L));
  group_.alltoall(counts, p.recv_counts.data(), L);  // block j of counts: the experts of rank j
  p.local_rows.assign(size_t(L), 0);
  for (int j = 0; j < P; ++j)
    for (int l = 0; l < L; ++l) p.local_rows[size_t(l)] += p.recv_counts[size_t(j * L + l)];
  p.received = std::accumulate(p.local_rows.begin(), p.local_rows.end(), int64_t(0));
  return p;
}

void ExpertDispatcher::dispatch(const DispatchPlan& p, const float* rows, int64_t D, std::vector<float>* out) {
  const int P = p.ranks, L = p.local_experts;
  std::vector<int64_t> sc(static_cast<size_t>(P)), rc(static_cast<size_t>(P), 0);
  for (int j = 0; j < P; ++j) {
    sc[size_t(j)] = p.send_rows[size_t(j)] * D;
    for (int l = 0; l < L; ++l) rc[size_t(j)] += p.recv_counts[size_t(j * L + l)] * D;
  }
  buf_.resize(size_t(p.received * D) + 1);
  group_.alltoallv(rows, sc.data(), buf_.data(), rc.data());
  // Source-major [rank j: expert 0 rows, expert 1 rows, ...] -> expert-major.
  out->resize(size_t(p.received * D));
  std::vector<int64_t> src_off(static_cast<size_t>(P * L)), dst_off(static_cast<size_t>(P * L));
  int64_t o = 0;
  for (int j = 0; j < P; ++j)
    for (int l = 0; l < L; ++l) src_off[size_t(j * L + l)] = o, o += p.recv_counts[size_t(j * L + l)];
  o = 0;
  for (int l = 0; l < L; ++l)
    for (int j = 0; j < P; ++j) dst_off[size_t(j * L + l)] = o, o += p.recv_counts[size_t(j * L + l)];
  for (int i = 0; i < P * L; ++i)
    std::copy_n(buf_.data() + src_off[size_t(i)] * D, p.recv_counts[size_t(i)] * D, out->data() + dst_off[size_t(i)] * D);
}

void ExpertDispatcher::combine(const DispatchPlan& p, const float* rows, int64_t D, float* out) {
  const int P = p.ranks, L = p.local_experts;
  // Expert-major -> source-major, then back to the senders.
  buf_.resize(size_t(p.received * D) + 1);
  int64_t src = 0;
  std::vector<int64_t> dst_off(static_cast<size_t>(P * L));
  int64_t o = 0;
  for (int j = 0; j < P; ++j)
    for (int l = 0; l < L; ++l) dst_off[size_t(j * L + l)] = o, o += p.recv_counts[size_t(j * L + l)];
  for (int l = 0; l < L; ++l)
    for (int j = 0; j < P; ++j) {
      const int64_t n = p.recv_counts[size_t(j * L + l)];
      std::copy_n(rows + src * D, n * D, buf_.data() + dst_off[size_t(j * L + l)] * D);
      src += n;
    }
  std::vector<int64_t> sc(static_cast<size_t>(P), 0), rc(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) {
    for (int l = 0; l < L; ++l) sc[size_t(j)] += p.recv_counts[size_t(j * L + l)] * D;
    rc[size_t(j)] = p.send_rows[size_t(j)] * D;
  }
  group_.alltoallv(buf_.data(), sc.data(), out, rc.data());
}

}  // namespace fp8moe
