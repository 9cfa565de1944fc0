#include "parallel/expert_dispatch.h"

#include <algorithm>
#include <numeric>

#include "kernels/backend.h"
#include "kernels/check.h"

namespace fp8moe {

ExpertDispatcher::ExpertDispatcher(Backend& be, Communicator& rows, Communicator& counts, int n_experts)
    : be_(be), rows_(rows), counts_(counts), experts_(n_experts) {
  FP8MOE_ASSERT(rows.size() == counts.size(), "the expert group's two communicators differ in size");
  FP8MOE_ASSERT(n_experts % rows.size() == 0, n_experts, " experts over ", rows.size(), " expert-parallel ranks");
  local_ = ExpertOwnership{n_experts, rows.size()}.per_rank();
}

DispatchPlan ExpertDispatcher::plan(const int64_t* counts) {
  const int P = counts_.size(), L = local_;
  DispatchPlan p;
  p.ranks = P, p.local_experts = L;
  p.send_rows.assign(size_t(P), 0);
  for (int j = 0; j < P; ++j)
    for (int l = 0; l < L; ++l) p.send_rows[size_t(j)] += counts[j * L + l];
  p.recv_counts.resize(size_t(P * L));
  counts_.alltoall(counts, p.recv_counts.data(), L);  // block j of counts: the experts of rank j
  p.local_rows.assign(size_t(L), 0);
  for (int j = 0; j < P; ++j)
    for (int l = 0; l < L; ++l) p.local_rows[size_t(l)] += p.recv_counts[size_t(j * L + l)];
  p.received = std::accumulate(p.local_rows.begin(), p.local_rows.end(), int64_t(0));
  return p;
}

namespace {
// Row offsets of the (source rank j, local expert l) blocks in the source-major layout the
// all-to-all delivers ([rank j: expert 0, expert 1, ...]) and in the expert-major one the experts
// read ([expert l: rank 0, rank 1, ...]).
void block_offsets(const DispatchPlan& p, std::vector<int64_t>* source_major, std::vector<int64_t>* expert_major) {
  const int P = p.ranks, L = p.local_experts;
  source_major->resize(size_t(P * L)), expert_major->resize(size_t(P * L));
  int64_t o = 0;
  for (int j = 0; j < P; ++j)
    for (int l = 0; l < L; ++l) (*source_major)[size_t(j * L + l)] = o, o += p.recv_counts[size_t(j * L + l)];
  o = 0;
  for (int l = 0; l < L; ++l)
    for (int j = 0; j < P; ++j) (*expert_major)[size_t(j * L + l)] = o, o += p.recv_counts[size_t(j * L + l)];
}
}  // namespace

void ExpertDispatcher::dispatch(const DispatchPlan& p, const float* rows, int64_t D, Tensor* out) {
  const int P = p.ranks, L = p.local_experts;
  std::vector<int64_t> sc(static_cast<size_t>(P)), rc(static_cast<size_t>(P), 0);
  for (int j = 0; j < P; ++j) {
    sc[size_t(j)] = p.send_rows[size_t(j)] * D;
    for (int l = 0; l < L; ++l) rc[size_t(j)] += p.recv_counts[size_t(j * L + l)] * D;
  }
  Tensor buf(be_, DType::f32, {p.received, D});
  rows_.alltoallv(rows, sc.data(), buf.f32(), rc.data());
  // Source-major -> expert-major: P x L contiguous blocks moved on the device.
  *out = Tensor(be_, DType::f32, {p.received, D});
  std::vector<int64_t> src_off, dst_off;
  block_offsets(p, &src_off, &dst_off);
  for (int i = 0; i < P * L; ++i)
    if (p.recv_counts[size_t(i)] > 0)
      be_.copy(out->f32() + dst_off[size_t(i)] * D, buf.f32() + src_off[size_t(i)] * D,
               size_t(p.recv_counts[size_t(i)] * D) * sizeof(float));
}

void ExpertDispatcher::combine(const DispatchPlan& p, const float* rows, int64_t D, float* out) {
  const int P = p.ranks, L = p.local_experts;
  // Expert-major -> source-major, then back to the senders.
  Tensor buf(be_, DType::f32, {p.received, D});
  std::vector<int64_t> src_off, dst_off;
  block_offsets(p, &dst_off, &src_off);
  for (int i = 0; i < P * L; ++i)
    if (p.recv_counts[size_t(i)] > 0)
      be_.copy(buf.f32() + dst_off[size_t(i)] * D, rows + src_off[size_t(i)] * D,
               size_t(p.recv_counts[size_t(i)] * D) * sizeof(float));
  std::vector<int64_t> sc(static_cast<size_t>(P), 0), rc(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) {
    for (int l = 0; l < L; ++l) sc[size_t(j)] += p.recv_counts[size_t(j * L + l)] * D;
    rc[size_t(j)] = p.send_rows[size_t(j)] * D;
  }
  rows_.alltoallv(buf.f32(), sc.data(), out, rc.data());
}

}  // namespace fp8moe
