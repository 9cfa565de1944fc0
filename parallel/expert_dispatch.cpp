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
  node_.assign(size_t(rows.size()), 0);
}

void ExpertDispatcher::set_nodes(std::vector<int64_t> node) {
  FP8MOE_ASSERT(int(node.size()) == rows_.size(), node.size(), " node indices for an expert group of ", rows_.size());
  node_ = std::move(node);
}

bool ExpertDispatcher::spans_nodes() const {
  return std::any_of(node_.begin(), node_.end(), [&](int64_t n) { return n != node_.front(); });
}

void ExpertDispatcher::count(const std::vector<int64_t>& send_words) {
  for (int j = 0; j < int(send_words.size()); ++j)
    if (j != rows_.rank()) (same_node(j) ? node_bytes_.in_node : node_bytes_.across) += send_words[size_t(j)] * 4;
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

// The communicator moves FP32 values; every format's rows are whole 32-bit words of bytes, which
// it moves unchanged (an all-to-all does no arithmetic).
void ExpertDispatcher::dispatch_bytes(const DispatchPlan& p, const void* rows, int64_t row_bytes, void* out) {
  FP8MOE_ASSERT(row_bytes % 4 == 0, "expert dispatch: rows of ", row_bytes, " bytes are not whole 32-bit words");
  const int P = p.ranks, L = p.local_experts;
  const int64_t words = row_bytes / 4;
  std::vector<int64_t> sc(static_cast<size_t>(P)), rc(static_cast<size_t>(P), 0);
  for (int j = 0; j < P; ++j) {
    sc[size_t(j)] = p.send_rows[size_t(j)] * words;
    for (int l = 0; l < L; ++l) rc[size_t(j)] += p.recv_counts[size_t(j * L + l)] * words;
  }
  Tensor buf(be_, DType::f32, {p.received * words});
  count(sc);
  rows_.alltoallv(static_cast<const float*>(rows), sc.data(), buf.f32(), rc.data());
  // Source-major -> expert-major: P x L contiguous blocks moved on the device.
  std::vector<int64_t> src_off, dst_off;
  block_offsets(p, &src_off, &dst_off);
  auto* o = static_cast<char*>(out);
  const auto* b = static_cast<const char*>(buf.raw());
  for (int i = 0; i < P * L; ++i)
    if (p.recv_counts[size_t(i)] > 0)
      be_.copy(o + dst_off[size_t(i)] * row_bytes, b + src_off[size_t(i)] * row_bytes,
               size_t(p.recv_counts[size_t(i)] * row_bytes));
}

void ExpertDispatcher::combine_bytes(const DispatchPlan& p, const void* rows, int64_t row_bytes, void* out) {
  FP8MOE_ASSERT(row_bytes % 4 == 0, "expert combine: rows of ", row_bytes, " bytes are not whole 32-bit words");
  const int P = p.ranks, L = p.local_experts;
  const int64_t words = row_bytes / 4;
  // Expert-major -> source-major, then back to the senders.
  Tensor buf(be_, DType::f32, {p.received * words});
  std::vector<int64_t> src_off, dst_off;
  block_offsets(p, &dst_off, &src_off);
  auto* b = static_cast<char*>(buf.raw());
  const auto* r = static_cast<const char*>(rows);
  for (int i = 0; i < P * L; ++i)
    if (p.recv_counts[size_t(i)] > 0)
      be_.copy(b + dst_off[size_t(i)] * row_bytes, r + src_off[size_t(i)] * row_bytes,
               size_t(p.recv_counts[size_t(i)] * row_bytes));
  std::vector<int64_t> sc(static_cast<size_t>(P), 0), rc(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) {
    for (int l = 0; l < L; ++l) sc[size_t(j)] += p.recv_counts[size_t(j * L + l)] * words;
    rc[size_t(j)] = p.send_rows[size_t(j)] * words;
  }
  count(sc);
  rows_.alltoallv(buf.f32(), sc.data(), static_cast<float*>(out), rc.data());
}

void ExpertDispatcher::dispatch(const DispatchPlan& p, const float* rows, int64_t D, Tensor* out) {
  *out = Tensor(be_, DType::f32, {p.received, D});
  dispatch_bytes(p, rows, D * int64_t(sizeof(float)), out->raw());
}

void ExpertDispatcher::combine(const DispatchPlan& p, const float* rows, int64_t D, float* out) {
  combine_bytes(p, rows, D * int64_t(sizeof(float)), out);
}

void ExpertDispatcher::dispatch(const DispatchPlan& p, const uint16_t* rows, int64_t D, Tensor* out) {
  *out = Tensor(be_, DType::bf16, {p.received, D});
  dispatch_bytes(p, rows, D * int64_t(sizeof(uint16_t)), out->raw());
}

void ExpertDispatcher::combine(const DispatchPlan& p, const uint16_t* rows, int64_t D, uint16_t* out) {
  combine_bytes(p, rows, D * int64_t(sizeof(uint16_t)), out);
}

void ExpertDispatcher::combine(const DispatchPlan& p, const double* rows, int64_t D, double* out) {
  combine_bytes(p, rows, D * int64_t(sizeof(double)), out);
}

void ExpertDispatcher::dispatch(const DispatchPlan& p, const QTensor& rows, QTensor* out) {
  FP8MOE_ASSERT(rows.tiling == Tiling::rows_1xT || rows.tiling == Tiling::per_tensor,
                "FP8 expert dispatch takes rows in 1 x T tiles or with one scale");
  const int64_t D = rows.cols, S = tiling_scale_cols(rows.tiling, rows.tile, D);
  *out = QTensor(be_, p.received, D, rows.dtype, rows.tiling, rows.tile);
  dispatch_bytes(p, rows.data.raw(), D, out->data.raw());
  if (rows.tiling == Tiling::per_tensor) {  // the group's one scale, which every rank holds
    be_.copy(out->scale_inv.raw(), rows.scale_inv.raw(), sizeof(float));
    return;
  }
  dispatch_bytes(p, rows.scale_inv.raw(), S * int64_t(sizeof(float)), out->scale_inv.raw());
}

}  // namespace fp8moe
