#include "model/data_parallel.h"

#include <algorithm>

#include "kernels/check.h"

namespace fp8moe {

DataParallel::DataParallel(const ParamStore& store, Segment segment, std::vector<size_t> members, Communicator& group,
                           bool zero, ReduceDtype reduce, int64_t round_values, bool overlap)
    : segment_(segment), group_(group), zero_(zero && group.size() > 1), reduce_(reduce), round_values_(round_values) {
  const int R = group.size();
  const ParamTable& t = store.table();
  // ZeRO chunks: replica r's begins at the row boundary at or before begin + size r / R (the row
  // containing that element starts it), so every chunk is whole rows of its parameters.
  std::vector<int64_t> cut(size_t(R + 1), segment.end);
  cut[0] = segment.begin;
  for (int r = 1; r < R; ++r) {
    const int64_t target = segment.begin + segment.size() * r / R;
    int64_t at = segment.end;
    for (size_t i : members) {
      const int64_t off = store.offset(i), n = store.shard(i).numel(), cols = store.shard(i).cols;
      if (target < off + n) {
        at = off + (std::max<int64_t>(target, off) - off) / cols * cols;
        break;
      }
    }
    cut[size_t(r)] = std::max(at, cut[size_t(r - 1)]);
  }
  cut_ = cut;
  counts_.resize(size_t(R));
  for (int r = 0; r < R; ++r) counts_[size_t(r)] = zero_ ? cut[size_t(r + 1)] - cut[size_t(r)] : segment.size();
  split_.resize(size_t(R));
  for (int r = 0; r < R; ++r) split_[size_t(r)] = segment.size() * (r + 1) / R - segment.size() * r / R;
  const int me = group.rank();
  for (size_t i : members) {
    const Shard& sh = store.shard(i);
    FP8MOE_ASSERT(t.params[i].trainable && sh.held(), "DataParallel of ", t.params[i].name);
    if (!zero_) {
      rows_[i] = {0, sh.rows};
      continue;
    }
    const int64_t off = store.offset(i), lo = std::clamp(cut[size_t(me)], off, off + sh.numel()),
                  hi = std::clamp(cut[size_t(me + 1)], off, off + sh.numel());
    rows_[i] = {(lo - off) / sh.cols, (hi - off) / sh.cols};
  }
  // (A transport that runs a post in line, the staged one, keeps the one reduction: per-layer
  // buckets would only add calls and host synchronisations there.)
  if (!overlap || reduce_ != ReduceDtype::fp32 || R == 1 || segment.size() == 0 || !group.overlaps()) return;
  // One bucket per run of members of one layer (in layout order the members of a layer are
  // adjacent; where they are not, the layer gets several buckets).
  for (size_t i : members) {
    const int layer = t.params[i].layer;
    const int64_t off = store.offset(i), end = off + store.shard(i).numel();
    if (!buckets_.empty() && buckets_.back().layer == layer && buckets_.back().end == off) {
      buckets_.back().end = end;
      continue;
    }
    Bucket b;
    b.layer = layer, b.begin = off, b.end = end;
    buckets_.push_back(std::move(b));
  }
  for (Bucket& b : buckets_) {
    if (!zero_) continue;
    b.counts.resize(size_t(R));
    for (int r = 0; r < R; ++r)
      b.counts[size_t(r)] =
          std::max<int64_t>(0, std::min(b.end, cut_[size_t(r + 1)]) - std::max(b.begin, cut_[size_t(r)]));
  }
}

RowRange DataParallel::owned(size_t i) const {
  const auto it = rows_.find(i);
  return it == rows_.end() ? RowRange{0, 0} : it->second;
}

void DataParallel::post(ParamStore& store, Bucket& b) {
  float* g = store.grads().f32() + b.begin;
  if (!zero_) {
    b.ticket = group_.iallreduce_sum(g, b.end - b.begin);
    return;
  }
  b.part = Tensor(store.backend(), DType::f32, {b.counts[size_t(group_.rank())]});
  b.ticket = group_.ireduce_scatterv_sum(g, b.part.f32(), b.counts.data());
}

void DataParallel::post_layer(ParamStore& store, int layer) {
  for (Bucket& b : buckets_)
    if (b.layer == layer && b.ticket < 0) post(store, b);
}

void DataParallel::post_rest(ParamStore& store) {
  for (Bucket& b : buckets_)
    if (b.ticket < 0) post(store, b);
}

void DataParallel::reduce_gradients(ParamStore& store) {
  if (overlapped()) {
    post_rest(store);  // (a caller that posted nothing: every bucket now, in layout order)
    const int me = group_.rank();
    for (Bucket& b : buckets_) {
      group_.wait(b.ticket);
      b.ticket = -1;
      if (!zero_ || b.part.empty()) continue;
      // This replica's part of the bucket: where its chunk and the bucket meet.
      store.backend().copy(store.grads().f32() + std::max(b.begin, cut_[size_t(me)]), b.part.f32(), b.part.bytes());
      b.part.reset();
    }
    return;
  }
  if (group_.size() == 1 || segment_.size() == 0) return;
  float* g = store.grads().f32() + segment_.begin;
  if (reduce_ == ReduceDtype::bf16) return reduce_bf16(store.backend(), g);
  if (!zero_) {
    group_.allreduce_sum(g, segment_.size());
    return;
  }
  int64_t mine = 0;
  for (int r = 0; r < group_.rank(); ++r) mine += counts_[size_t(r)];
  Tensor chunk(store.backend(), DType::f32, {counts_[size_t(group_.rank())]});
  group_.reduce_scatterv_sum(g, chunk.f32(), counts_.data());
  if (!chunk.empty()) store.backend().copy(g + mine, chunk.f32(), chunk.bytes());
}

void DataParallel::reduce_bf16(Backend& be, float* g) {
  const int R = group_.size(), me = group_.rank();
  const std::vector<int64_t>& blocks = zero_ ? counts_ : split_;
  std::vector<int64_t> start(size_t(R) + 1, 0);
  int64_t longest = 0;
  for (int r = 0; r < R; ++r)
    start[size_t(r + 1)] = start[size_t(r)] + blocks[size_t(r)], longest = std::max(longest, blocks[size_t(r)]);
  // Rounds of at most c values of every block: round k sends values [k c, (k + 1) c) of block r to
  // replica r, so that the buffers stay small (about 4 round_values_ bytes each way) and every
  // round involves every replica. A slice's BF16 values are packed in pairs into 32-bit words (the
  // communicators move floats), an odd slice padded with a zero value.
  const int64_t c = std::max<int64_t>(1, round_values_ / R);
  auto slice = [&](int r, int64_t k) { return std::clamp<int64_t>(blocks[size_t(r)] - k * c, 0, c); };
  const int64_t mine = start[size_t(me)];
  for (int64_t k = 0; k * c < longest; ++k) {
    std::vector<int64_t> words(size_t(R), 0), recv_words(size_t(R), (slice(me, k) + 1) / 2);
    int64_t total = 0;
    for (int r = 0; r < R; ++r) words[size_t(r)] = (slice(r, k) + 1) / 2, total += words[size_t(r)];
    Tensor send(be, DType::f32, {total}), recv(be, DType::f32, {R * recv_words[0]});
    int64_t word = 0;
    for (int r = 0; r < R; word += words[size_t(r)], ++r) {
      auto* bits = reinterpret_cast<uint16_t*>(send.f32() + word);
      const int64_t n = slice(r, k);
      be.to_bf16(g + start[size_t(r)] + k * c, bits, n);
      if (n % 2) be.zero(bits + n, sizeof(uint16_t));
    }
    group_.alltoallv(send.f32(), words.data(), recv.f32(), recv_words.data());
    // This replica's slice: the sum over the replicas, in rank order, in FP32, written over its own
    // values (already sent: later rounds read only later slices).
    const int64_t n = slice(me, k);
    if (n == 0) continue;
    float* out = g + mine + k * c;
    Tensor part(be, DType::f32, {n});
    for (int r = 0; r < R; ++r) {
      const auto* bits = reinterpret_cast<const uint16_t*>(recv.f32() + r * recv_words[0]);
      if (r == 0) {
        be.from_bf16(bits, out, n);
      } else {
        be.from_bf16(bits, part.f32(), n);
        be.add(out, part.f32(), out, n);
      }
    }
  }
  // Without ZeRO every replica takes every block's sums (this replica's block of g is its own part).
  if (!zero_) group_.allgatherv(g + mine, g, split_.data());
}

void DataParallel::gather_weights(ParamStore& store) {
  if (!zero_ || segment_.size() == 0) return;
  float* w = store.params().f32() + segment_.begin;
  int64_t mine = 0;
  for (int r = 0; r < group_.rank(); ++r) mine += counts_[size_t(r)];
  group_.allgatherv(w + mine, w, counts_.data());  // in place: this replica's chunk is its block of out
}

namespace {
ParamTable localise(ParamTable t, const ParamStore& s) {
  for (size_t i = 0; i < t.params.size(); ++i) t.params[i].rows = s.shard(i).rows, t.params[i].cols = s.shard(i).cols;
  return t;
}
}  // namespace

ReplicaSync::ReplicaSync(const ParamStore& store, Communicator& data, Communicator& expert_data, int tensor_rank,
                         bool zero, ReduceDtype reduce, bool overlap, std::vector<bool> copies)
    : table_(store.table()),
      local_(localise(store.table(), store)),
      tensor_rank_(tensor_rank),
      copies_(std::move(copies)),
      dense_(store, store.dense(), store.dense_members(), data, zero, reduce, DataParallel::kRoundValues, overlap),
      experts_(store, store.experts(), store.expert_members(), expert_data, zero, reduce, DataParallel::kRoundValues,
               overlap) {
  for (size_t i = 0; i < table_.params.size(); ++i) shards_.push_back(store.shard(i));
  copies_.resize(table_.params.size(), false);
}

std::vector<RowRange> ReplicaSync::owned() const {
  std::vector<RowRange> o;
  for (size_t i = 0; i < table_.params.size(); ++i)
    o.push_back(!shards_[i].held() ? RowRange{0, 0}
                : dense_.includes(i) ? dense_.owned(i)
                : experts_.includes(i) ? experts_.owned(i)
                                       : RowRange{0, shards_[i].rows});
  return o;
}

std::vector<RowRange> ReplicaSync::write_rows() const {
  std::vector<RowRange> w;
  for (size_t i = 0; i < table_.params.size(); ++i) {
    const Shard& sh = shards_[i];
    const Communicator& g = table_.params[i].expert >= 0 ? experts_.group() : dense_.group();
    const RowRange r = replica_rows(sh.rows, g.rank(), g.size());
    w.push_back(writes(i) ? RowRange{sh.r0 + r.begin, sh.r0 + r.end} : RowRange{0, 0});
  }
  return w;
}

bool ReplicaSync::writes(size_t i) const {
  // The tensor group holds identical copies of a parameter it does not split: rank 0 writes it.
  return shards_[i].held() && !copies_[i] && (table_.params[i].tp != TpSplit::none || tensor_rank_ == 0);
}

std::vector<RowRange> ReplicaSync::moment_write_rows() const {
  if (!zero()) return write_rows();
  std::vector<RowRange> w = owned();
  for (size_t i = 0; i < w.size(); ++i)
    w[i] = writes(i) ? RowRange{shards_[i].r0 + w[i].begin, shards_[i].r0 + w[i].end} : RowRange{0, 0};
  return w;
}

void ReplicaSync::reduce_gradients(ParamStore& store) {
  dense_.reduce_gradients(store);
  experts_.reduce_gradients(store);
}

void ReplicaSync::gather_weights(ParamStore& store) {
  dense_.gather_weights(store);
  experts_.gather_weights(store);
}

std::vector<bool> ReplicaSync::norm_mask() const {
  std::vector<bool> m(table_.params.size());
  for (size_t i = 0; i < m.size(); ++i)
    m[i] = (dense_.counts_in_norm(i) || experts_.counts_in_norm(i)) && !copies_[i] &&
           (table_.params[i].tp != TpSplit::none || tensor_rank_ == 0);  // tp-replicated: counted once
  return m;
}

}  // namespace fp8moe
