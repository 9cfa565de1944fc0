#include "parallel/expert_dispatch.h"

#include <algorithm>
#include <bit>
#include <exception>
#include <functional>
#include <numeric>

#include "kernels/backend.h"
#include "kernels/check.h"

namespace fp8moe {

ExpertDispatcher::ExpertDispatcher(Backend& be, Communicator& rows, Communicator& counts, int n_experts)
    : be_(be), rows_(rows), counts_(counts), experts_(n_experts) {
  FP8MOE_ASSERT(rows.size() == counts.size(), "the expert group's two communicators differ in size");
  FP8MOE_ASSERT(n_experts % rows.size() == 0, n_experts, " experts over ", rows.size(), " expert-parallel ranks");
  local_ = ExpertOwnership{n_experts, rows.size()}.per_rank();
  nodes_.node.assign(size_t(rows.size()), 0);
}

std::vector<int> NodeMap::ranks_of(int64_t n) const {
  std::vector<int> r;
  for (int j = 0; j < int(node.size()); ++j)
    if (node[size_t(j)] == n) r.push_back(j);
  return r;
}

int NodeMap::relay(int source, int64_t n) const {
  const std::vector<int> mine = ranks_of(node[size_t(source)]), there = ranks_of(n);
  FP8MOE_ASSERT(!there.empty(), "expert dispatch: no rank on node ", n);
  const auto index = std::find(mine.begin(), mine.end(), source) - mine.begin();
  return there[size_t(index) % there.size()];
}

void ExpertDispatcher::set_nodes(std::vector<int64_t> node, bool dedup) {
  FP8MOE_ASSERT(int(node.size()) == rows_.size(), node.size(), " node indices for an expert group of ", rows_.size());
  nodes_.node = std::move(node), dedup_ = dedup;
}

bool ExpertDispatcher::spans_nodes() const {
  const std::vector<int64_t>& n = nodes_.node;
  return std::any_of(n.begin(), n.end(), [&](int64_t v) { return v != n.front(); });
}

void ExpertDispatcher::count(const std::vector<int64_t>& send_words) {
  for (int j = 0; j < int(send_words.size()); ++j)
    if (j != rows_.rank()) (same_node(j) ? node_bytes_.in_node : node_bytes_.across) += send_words[size_t(j)] * 4;
}

DispatchPlan ExpertDispatcher::plan(const int64_t* counts, const int64_t* row_token) {
  const int P = counts_.size(), L = local_;
  DispatchPlan p;
  p.ranks = P, p.local_experts = L;
  p.send_rows.assign(size_t(P), 0);
  for (int j = 0; j < P; ++j)
    for (int l = 0; l < L; ++l) p.send_rows[size_t(j)] += counts[j * L + l];
  if (relays()) {
    plan_relay(counts, row_token, &p);
  } else {
    p.recv_counts.resize(size_t(P * L));
    counts_.alltoall(counts, p.recv_counts.data(), L);  // block j of counts: the experts of rank j
  }
  p.local_rows.assign(size_t(L), 0);
  for (int j = 0; j < P; ++j)
    for (int l = 0; l < L; ++l) p.local_rows[size_t(l)] += p.recv_counts[size_t(j * L + l)];
  p.received = std::accumulate(p.local_rows.begin(), p.local_rows.end(), int64_t(0));
  return p;
}

namespace {
// Row counts -> the communicator's counts of 32-bit words, rows of `words` words.
std::vector<int64_t> in_words(const std::vector<int64_t>& rows, int64_t words) {
  std::vector<int64_t> w(rows.size());
  for (size_t j = 0; j < rows.size(); ++j) w[j] = rows[j] * words;
  return w;
}

Tensor upload_indices(Backend& be, const std::vector<int64_t>& v) {
  Tensor t(be, DType::i64, {int64_t(v.size())});
  if (!v.empty()) be.upload(t.raw(), v.data(), v.size() * sizeof(int64_t));
  return t;
}
}  // namespace

// The relay's plan. Each source tells each other node's relay, with the counts, how many token rows
// it sends there and how long its map is; the map (int32 values carried as 32-bit words over the
// counts' group) gives, for the rows to each rank of that node in order, the index of their token
// among the ones sent. Row order everywhere is the direct exchange's: by destination rank, then
// the sender's order, so the experts' rows come out as the direct exchange lays them.
void ExpertDispatcher::plan_relay(const int64_t* counts, const int64_t* row_token, DispatchPlan* p) {
  const int P = counts_.size(), L = local_, me = rows_.rank();
  const int64_t my_node = nodes_.node[size_t(me)];
  auto relay = std::make_shared<DispatchPlan::Relay>();
  DispatchPlan::Relay& y = *relay;
  std::vector<int64_t> row0(static_cast<size_t>(P) + 1, 0);  // first row of each destination's block
  for (int j = 0; j < P; ++j) row0[size_t(j) + 1] = row0[size_t(j)] + p->send_rows[size_t(j)];
  FP8MOE_ASSERT(row_token || row0.back() == 0, "expert dispatch across nodes: the plan needs each row's token");

  // This rank as a source: its node's ranks get their rows; each other node's relay its tokens once.
  // slot: each token's index among the ones sent to the node at hand (-1: none yet).
  int64_t tokens = 0;
  for (int64_t i = 0; i < row0.back(); ++i) tokens = std::max(tokens, row_token[i] + 1);
  std::vector<int32_t> slot(static_cast<size_t>(tokens), -1);
  y.send1.assign(size_t(P), 0);
  std::vector<int64_t> gather1, meta_len(static_cast<size_t>(P), 0);
  std::vector<std::vector<int32_t>> meta(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) {
    if (nodes_.same(j, me)) {
      for (int64_t i = row0[size_t(j)]; i < row0[size_t(j) + 1]; ++i) gather1.push_back(i);
      y.send1[size_t(j)] = p->send_rows[size_t(j)];
      continue;
    }
    const int64_t n = nodes_.node[size_t(j)];
    const int relay_rank = nodes_.relay(me, n);
    if (relay_rank != j) continue;
    const std::vector<int> there = nodes_.ranks_of(n);
    std::vector<int32_t>& m = meta[size_t(j)];
    for (int q : there) m.push_back(int32_t(p->send_rows[size_t(q)]));
    const size_t first = gather1.size();
    for (int q : there)
      for (int64_t i = row0[size_t(q)]; i < row0[size_t(q) + 1]; ++i) {
        int32_t& u = slot[size_t(row_token[i])];
        if (u < 0) {  // the token's first row to this node: sent
          u = int32_t(y.send1[size_t(j)]++);
          gather1.push_back(i);
        }
        m.push_back(u);
      }
    for (size_t x = first; x < gather1.size(); ++x) slot[size_t(row_token[gather1[x]])] = -1;
    meta_len[size_t(j)] = int64_t(m.size());
    y.across += y.send1[size_t(j)];
  }

  // The counts, and each relay's two numbers: L + 2 values per rank.
  const int W = L + 2;
  std::vector<int64_t> out(static_cast<size_t>(P * W)), in(static_cast<size_t>(P * W));
  for (int j = 0; j < P; ++j) {
    std::copy_n(counts + j * L, L, out.data() + j * W);
    out[size_t(j * W + L)] = nodes_.same(j, me) ? 0 : y.send1[size_t(j)];
    out[size_t(j * W + L + 1)] = meta_len[size_t(j)];
  }
  counts_.alltoall(out.data(), in.data(), W);
  p->recv_counts.resize(size_t(P * L));
  std::vector<int64_t> tokens_from(static_cast<size_t>(P)), meta_from(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) {
    std::copy_n(in.data() + j * W, L, p->recv_counts.data() + j * L);
    tokens_from[size_t(j)] = in[size_t(j * W + L)], meta_from[size_t(j)] = in[size_t(j * W + L + 1)];
  }
  auto rows_from = [&](int j) {  // rows of source j for this rank's experts
    int64_t r = 0;
    for (int l = 0; l < L; ++l) r += p->recv_counts[size_t(j * L + l)];
    return r;
  };
  std::vector<float> meta_out, meta_in;
  std::vector<int64_t> msc(static_cast<size_t>(P)), mrc(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) {
    for (int32_t v : meta[size_t(j)]) meta_out.push_back(std::bit_cast<float>(v));
    msc[size_t(j)] = meta_len[size_t(j)], mrc[size_t(j)] = meta_from[size_t(j)];
  }
  meta_in.resize(size_t(std::accumulate(mrc.begin(), mrc.end(), int64_t(0))));
  counts_.alltoallv(meta_out.data(), msc.data(), meta_in.data(), mrc.data());

  // The first exchange's arrivals: from this node's ranks their rows, from the sources this rank
  // relays for their tokens, in rank order.
  y.recv1.assign(size_t(P), 0);
  std::vector<int64_t> at1(static_cast<size_t>(P), 0);
  for (int j = 0; j < P; ++j) {
    at1[size_t(j)] = y.arrived1;
    y.recv1[size_t(j)] = nodes_.same(j, me) ? rows_from(j) : tokens_from[size_t(j)];
    y.arrived1 += y.recv1[size_t(j)];
  }

  // This rank as a relay: for each rank q of its node, the rows of each source it relays for, in
  // source order, each source's rows to q in their order.
  const std::vector<int> here = nodes_.ranks_of(my_node);
  y.send2.assign(size_t(P), 0);
  std::vector<int64_t> gather2;
  std::vector<int64_t> meta_at(static_cast<size_t>(P), 0);
  for (int64_t j = 0, o = 0; j < P; ++j) meta_at[size_t(j)] = o, o += mrc[size_t(j)];
  auto meta_value = [&](int j, int64_t i) { return std::bit_cast<int32_t>(meta_in[size_t(meta_at[size_t(j)] + i)]); };
  for (size_t qi = 0; qi < here.size(); ++qi) {
    const int q = here[qi];
    for (int s = 0; s < P; ++s) {
      if (mrc[size_t(s)] == 0) continue;  // not a source this rank relays for
      FP8MOE_ASSERT(mrc[size_t(s)] >= int64_t(here.size()), "expert dispatch: a relay map without its counts");
      int64_t skip = 0;
      for (size_t b = 0; b < qi; ++b) skip += meta_value(s, int64_t(b));
      const int64_t n = meta_value(s, int64_t(qi)), base = int64_t(here.size()) + skip;
      for (int64_t i = 0; i < n; ++i) {
        const int32_t u = meta_value(s, base + i);
        FP8MOE_ASSERT(u >= 0 && u < tokens_from[size_t(s)], "expert dispatch: a relay map's token ", u, " of ",
                      tokens_from[size_t(s)]);
        gather2.push_back(at1[size_t(s)] + u);
      }
      y.send2[size_t(q)] += n;
    }
    if (q != me) y.relayed += y.send2[size_t(q)];
  }
  // What arrives from each relay of this node: the rows of the other nodes' sources it relays for.
  y.recv2.assign(size_t(P), 0);
  for (int s = 0; s < P; ++s)
    if (!nodes_.same(s, me)) y.recv2[size_t(nodes_.relay(s, my_node))] += rows_from(s);
  std::vector<int64_t> at2(static_cast<size_t>(P), 0);  // where each source's rows start among the relays' arrivals
  {
    std::vector<int64_t> next(static_cast<size_t>(P), 0);  // per relay, running offset
    for (int64_t r = 0, o = 0; r < P; ++r) next[size_t(r)] = o, o += y.recv2[size_t(r)];
    for (int s = 0; s < P; ++s)
      if (!nodes_.same(s, me)) {
        int64_t& n = next[size_t(nodes_.relay(s, my_node))];
        at2[size_t(s)] = n, n += rows_from(s);
      }
    y.arrived2 = std::accumulate(y.recv2.begin(), y.recv2.end(), int64_t(0));
  }
  // The experts' rows, expert-major and source-ordered, from [first arrivals | relays' arrivals].
  std::vector<int64_t> gather_out;
  for (int l = 0; l < L; ++l)
    for (int j = 0; j < P; ++j) {
      int64_t o = nodes_.same(j, me) ? at1[size_t(j)] : y.arrived1 + at2[size_t(j)];
      for (int b = 0; b < l; ++b) o += p->recv_counts[size_t(j * L + b)];
      for (int64_t i = 0; i < p->recv_counts[size_t(j * L + l)]; ++i) gather_out.push_back(o + i);
    }
  // The summed combine's gathers, the inverses of these. inv: each arrival that is an expert's row
  // (this node's sources' in the first exchange, every relayed one) -> that row.
  std::vector<int64_t> inv(size_t(y.arrived1 + y.arrived2), -1);
  for (size_t o = 0; o < gather_out.size(); ++o) inv[size_t(gather_out[o])] = int64_t(o);
  std::vector<int64_t> back2(inv.begin() + y.arrived1, inv.end());
  // The relay's sums: each token row it received from another node, over the rows of it that it
  // forwarded (in the order it sent them), in the order of its arrival.
  std::vector<std::vector<int64_t>> into(size_t(y.arrived1));
  for (size_t i = 0; i < gather2.size(); ++i) into[size_t(gather2[i])].push_back(int64_t(i));
  std::vector<int64_t> sum_offsets{0}, sum_index, back1(size_t(y.arrived1));
  for (int j = 0; j < P; ++j)
    for (int64_t x = at1[size_t(j)]; x < at1[size_t(j)] + y.recv1[size_t(j)]; ++x) {
      if (nodes_.same(j, me)) {
        back1[size_t(x)] = inv[size_t(x)];
        continue;
      }
      back1[size_t(x)] = int64_t(gather_out.size()) + y.sums++;  // (the experts' rows first)
      sum_index.insert(sum_index.end(), into[size_t(x)].begin(), into[size_t(x)].end());
      sum_offsets.push_back(int64_t(sum_index.size()));
    }
  // This rank's rows: each sent one's arrival back, the zero row (after the arrivals) for the others.
  std::vector<int64_t> back_out(size_t(row0.back()), int64_t(gather1.size()));
  for (size_t x = 0; x < gather1.size(); ++x) back_out[size_t(gather1[x])] = int64_t(x);
  y.gather1 = std::move(gather1), y.gather2 = std::move(gather2), y.gather_out = std::move(gather_out);
  y.back2 = std::move(back2), y.back1 = std::move(back1), y.back_out = std::move(back_out);
  y.sum_offsets = std::move(sum_offsets), y.sum_index = std::move(sum_index);
  relay_rows_.across += y.across, relay_rows_.relayed += y.relayed, ++relay_rows_.plans;
  p->relay = std::move(relay);
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

ExchangeLater::~ExchangeLater() {
  if (!steps_.empty() && std::uncaught_exceptions() == 0) finish();  // (an unwinding rank waits for nothing)
}

void ExchangeLater::finish() {
  for (auto& step : steps_) step();
  steps_.clear(), kept_.clear();
}

// The communicator moves FP32 values; every format's rows are whole 32-bit words of bytes, which
// it moves unchanged (an all-to-all does no arithmetic).
void ExpertDispatcher::exchange(const void* send, const std::vector<int64_t>& sc, void* recv,
                                const std::vector<int64_t>& rc, ExchangeLater* later, std::function<void()> then) {
  count(sc);
  const auto* s = static_cast<const float*>(send);
  auto* r = static_cast<float*>(recv);
  if (!later) {
    rows_.alltoallv(s, sc.data(), r, rc.data());
    if (then) then();
    return;
  }
  const int64_t ticket = rows_.ialltoallv(s, sc.data(), r, rc.data());
  later->steps_.push_back([this, ticket, then = std::move(then)] {
    rows_.wait(ticket);
    if (then) then();
  });
}

void ExpertDispatcher::dispatch_bytes(const DispatchPlan& p, const void* rows, int64_t row_bytes, void* out,
                                      bool per_token, ExchangeLater* later) {
  if (per_token && p.relay) return relay_bytes(p, rows, row_bytes, out, later);
  FP8MOE_ASSERT(row_bytes % 4 == 0, "expert dispatch: rows of ", row_bytes, " bytes are not whole 32-bit words");
  const int P = p.ranks, L = p.local_experts;
  const int64_t words = row_bytes / 4;
  std::vector<int64_t> sc(static_cast<size_t>(P)), rc(static_cast<size_t>(P), 0);
  for (int j = 0; j < P; ++j) {
    sc[size_t(j)] = p.send_rows[size_t(j)] * words;
    for (int l = 0; l < L; ++l) rc[size_t(j)] += p.recv_counts[size_t(j * L + l)] * words;
  }
  auto buf = std::make_shared<Tensor>(be_, DType::f32, Shape{p.received * words});
  // Source-major -> expert-major: P x L contiguous blocks moved on the device.
  std::vector<int64_t> src_off, dst_off;
  block_offsets(p, &src_off, &dst_off);
  exchange(rows, sc, buf->raw(), rc, later,
           [this, buf, out = static_cast<char*>(out), counts = p.recv_counts, src_off, dst_off, row_bytes] {
             const auto* b = static_cast<const char*>(buf->raw());
             for (size_t i = 0; i < counts.size(); ++i)
               if (counts[i] > 0)
                 be_.copy(out + dst_off[i] * row_bytes, b + src_off[i] * row_bytes, size_t(counts[i] * row_bytes));
           });
}

// rows[index[i]] -> out[i], rows of `words` 32-bit words moved unchanged; the index uploaded for
// this gather (the plan keeps it on the host). No rows: nothing (an empty tensor may hold no memory).
void ExpertDispatcher::gather_rows(const void* rows, const std::vector<int64_t>& index, int64_t words, void* out) {
  if (index.empty()) return;
  const Tensor i = upload_indices(be_, index);
  be_.permute(static_cast<const float*>(rows), i.data<int64_t>(), int64_t(index.size()), words, static_cast<float*>(out));
}

// The relay's two exchanges: rows gathered into the first exchange's order, out to this node's
// ranks and other nodes' relays; the relayed rows gathered and forwarded in the node; the experts'
// rows gathered from both arrivals. Gathers move 32-bit words unchanged, as the exchanges do.
// Posted (later), the first exchange is the one posted: it carries the rows across nodes.
void ExpertDispatcher::relay_bytes(const DispatchPlan& p, const void* rows, int64_t row_bytes, void* out,
                                   ExchangeLater* later) {
  FP8MOE_ASSERT(row_bytes % 4 == 0, "expert dispatch: rows of ", row_bytes, " bytes are not whole 32-bit words");
  const std::shared_ptr<const DispatchPlan::Relay> relay = p.relay;
  const DispatchPlan::Relay& y = *relay;
  const int64_t words = row_bytes / 4;
  const std::vector<int64_t> sc1 = in_words(y.send1, words), rc1 = in_words(y.recv1, words);
  auto send1 = std::make_shared<Tensor>(be_, DType::f32, Shape{int64_t(y.gather1.size()) * words});
  gather_rows(rows, y.gather1, words, send1->raw());
  auto arrived = std::make_shared<Tensor>(be_, DType::f32, Shape{(y.arrived1 + y.arrived2) * words});  // [first | relayed]
  const int64_t received = p.received;
  exchange(send1->raw(), sc1, arrived->raw(), rc1, later, [this, relay, send1, arrived, words, received, out] {
    const DispatchPlan::Relay& y = *relay;
    send1->reset();
    Tensor send2(be_, DType::f32, {int64_t(y.gather2.size()) * words});
    gather_rows(arrived->raw(), y.gather2, words, send2.raw());
    exchange(send2.raw(), in_words(y.send2, words), arrived->f32() + y.arrived1 * words, in_words(y.recv2, words),
             nullptr, {});
    send2.reset();
    FP8MOE_ASSERT(int64_t(y.gather_out.size()) == received, "expert dispatch: the relay's plan gathers ",
                  y.gather_out.size(), " rows of ", received);
    gather_rows(arrived->raw(), y.gather_out, words, out);
  });
}

// Posted (later), the last exchange is the one posted: it carries the sums back across nodes.
void ExpertDispatcher::relay_combine(const DispatchPlan& p, const void* rows, int64_t D, bool bf16, void* out,
                                     ExchangeLater* later) {
  const std::shared_ptr<const DispatchPlan::Relay> relay = p.relay;
  const DispatchPlan::Relay& y = *relay;
  const int64_t row_bytes = D * (bf16 ? 2 : 4);
  FP8MOE_ASSERT(row_bytes % 4 == 0, "expert combine: rows of ", row_bytes, " bytes are not whole 32-bit words");
  const int64_t words = row_bytes / 4;
  // The relayed rows back to their relays in the node.
  const std::vector<int64_t> sc2 = in_words(y.recv2, words), rc2 = in_words(y.send2, words),
                             sc1 = in_words(y.recv1, words), rc1 = in_words(y.send1, words);
  Tensor send2(be_, DType::f32, {y.arrived2 * words}), at_relay(be_, DType::f32, {int64_t(y.gather2.size()) * words});
  gather_rows(rows, y.back2, words, send2.raw());
  exchange(send2.raw(), sc2, at_relay.raw(), rc2, nullptr, {});
  send2.reset();
  // [the experts' rows | the relay's sums], back through the first exchange.
  Tensor both(be_, DType::f32, {(p.received + y.sums) * words});
  if (p.received > 0) be_.copy(both.raw(), rows, size_t(p.received * row_bytes));
  if (y.sums > 0) {
    char* sums = static_cast<char*>(both.raw()) + p.received * row_bytes;
    const Tensor offsets = upload_indices(be_, y.sum_offsets), index = upload_indices(be_, y.sum_index);
    if (bf16)
      be_.sum_rows_bf16(static_cast<const uint16_t*>(at_relay.raw()), offsets.data<int64_t>(), index.data<int64_t>(),
                        y.sums, D, reinterpret_cast<uint16_t*>(sums));
    else
      be_.sum_rows(at_relay.f32(), offsets.data<int64_t>(), index.data<int64_t>(), y.sums, D,
                   reinterpret_cast<float*>(sums));
  }
  at_relay.reset();
  auto send1 = std::make_shared<Tensor>(be_, DType::f32, Shape{y.arrived1 * words});
  gather_rows(both.raw(), y.back1, words, send1->raw());
  both.reset();
  const int64_t back = int64_t(y.gather1.size());
  auto arrived = std::make_shared<Tensor>(be_, DType::f32, Shape{(back + 1) * words});  // [arrivals | a zero row]
  be_.zero(static_cast<char*>(arrived->raw()) + back * row_bytes, size_t(row_bytes));
  exchange(send1->raw(), sc1, arrived->raw(), rc1, later, [this, relay, send1, arrived, words, out] {
    send1->reset();
    gather_rows(arrived->raw(), relay->back_out, words, out);
  });
}

void ExpertDispatcher::combine_bytes(const DispatchPlan& p, const void* rows, int64_t row_bytes, void* out,
                                     ExchangeLater* later) {
  FP8MOE_ASSERT(row_bytes % 4 == 0, "expert combine: rows of ", row_bytes, " bytes are not whole 32-bit words");
  const int P = p.ranks, L = p.local_experts;
  const int64_t words = row_bytes / 4;
  // Expert-major -> source-major, then back to the senders.
  auto buf = std::make_shared<Tensor>(be_, DType::f32, Shape{p.received * words});
  std::vector<int64_t> src_off, dst_off;
  block_offsets(p, &dst_off, &src_off);
  auto* b = static_cast<char*>(buf->raw());
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
  exchange(buf->raw(), sc, out, rc, later, [buf] {});  // (the staging alive until the exchange is done)
}

void ExpertDispatcher::dispatch(const DispatchPlan& p, const float* rows, int64_t D, Tensor* out, bool per_token,
                                ExchangeLater* later) {
  *out = Tensor(be_, DType::f32, {p.received, D});
  dispatch_bytes(p, rows, D * int64_t(sizeof(float)), out->raw(), per_token, later);
}

void ExpertDispatcher::combine(const DispatchPlan& p, const float* rows, int64_t D, float* out, bool summed,
                               ExchangeLater* later) {
  if (summed && p.relay) return relay_combine(p, rows, D, false, out, later);
  combine_bytes(p, rows, D * int64_t(sizeof(float)), out, later);
}

void ExpertDispatcher::dispatch(const DispatchPlan& p, const uint16_t* rows, int64_t D, Tensor* out, bool per_token,
                                ExchangeLater* later) {
  *out = Tensor(be_, DType::bf16, {p.received, D});
  dispatch_bytes(p, rows, D * int64_t(sizeof(uint16_t)), out->raw(), per_token, later);
}

void ExpertDispatcher::combine(const DispatchPlan& p, const uint16_t* rows, int64_t D, uint16_t* out, bool summed,
                               ExchangeLater* later) {
  if (summed && p.relay) return relay_combine(p, rows, D, true, out, later);
  combine_bytes(p, rows, D * int64_t(sizeof(uint16_t)), out, later);
}

void ExpertDispatcher::combine(const DispatchPlan& p, const double* rows, int64_t D, double* out, ExchangeLater* later) {
  combine_bytes(p, rows, D * int64_t(sizeof(double)), out, later);
}

void ExpertDispatcher::dispatch(const DispatchPlan& p, const QTensor& rows, QTensor* out, bool per_token,
                                ExchangeLater* later) {
  FP8MOE_ASSERT(rows.tiling == Tiling::rows_1xT || rows.tiling == Tiling::per_tensor,
                "FP8 expert dispatch takes rows in 1 x T tiles or with one scale");
  const int64_t D = rows.cols, S = tiling_scale_cols(rows.tiling, rows.tile, D);
  *out = QTensor(be_, p.received, D, rows.dtype, rows.tiling, rows.tile);
  dispatch_bytes(p, rows.data.raw(), D, out->data.raw(), per_token, later);
  if (rows.tiling == Tiling::per_tensor) {  // the group's one scale, which every rank holds
    be_.copy(out->scale_inv.raw(), rows.scale_inv.raw(), sizeof(float));
    return;
  }
  dispatch_bytes(p, rows.scale_inv.raw(), S * int64_t(sizeof(float)), out->scale_inv.raw(), per_token, later);
}

}  // namespace fp8moe
