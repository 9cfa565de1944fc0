// The staging of a checkpoint's tensors (io/checkpoint_common.h): each dataset's block in chunks
// that fit one bounded host buffer, the checksum terms of a chunk, the moments' dtype conversion
// in that buffer, and the chunk counts the ranks agree on.
#include <algorithm>
#include <cstring>

#include "io/checkpoint_common.h"
#include "kernels/check.h"
#include "kernels/fp8.h"

namespace fp8moe::ckpt {

Chunks chunks_of(Rows rows, int64_t width, size_t elem, int64_t buffer) {
  Chunks c{rows, width};
  if (rows.n <= 0 || width <= 0) return c;
  const int64_t cap = std::max<int64_t>(1, buffer / int64_t(elem));  // elements per chunk
  if (width <= cap) {
    c.rows_per = cap / width, c.piece = width;
    c.count = (rows.n + c.rows_per - 1) / c.rows_per;
  } else {
    c.pieces = (width + cap - 1) / cap, c.piece = cap;
    c.count = rows.n * c.pieces;
  }
  return c;
}

Chunk chunk_at(const Chunks& c, int64_t k) {
  if (k >= c.count) return {};
  if (c.pieces == 1) {
    const int64_t r = c.rows.r0 + k * c.rows_per;
    return {{r, std::min(c.rows_per, c.rows.r0 + c.rows.n - r)}, 0, c.width};
  }
  const int64_t col = (k % c.pieces) * c.piece;
  return {{c.rows.r0 + k / c.pieces, 1}, col, std::min(c.piece, c.width - col)};
}

uint64_t checksum_chunk(const void* buf, Dt t, const Chunk& ch, Rows mine, int64_t c0, int64_t cols) {
  const int64_t lo = std::max(ch.rows.r0, mine.r0), hi = std::min(ch.rows.r0 + ch.rows.n, mine.r0 + mine.n);
  if (ch.empty() || mine.n <= 0 || lo >= hi) return 0;
  return checksum_block(static_cast<const unsigned char*>(buf) + size_t((lo - ch.rows.r0) * ch.w) * dt_size(t), t, lo,
                        hi - lo, c0 + ch.col, ch.w, cols);
}

void convert_in_place(unsigned char* buf, Dt from, Dt to, int64_t n) {
  if (from == to) return;
  FP8MOE_ASSERT((from == Dt::f32 && to == Dt::bf16) || (from == Dt::bf16 && to == Dt::f32), "checkpoint: no conversion from ",
                dt_name(from), " to ", dt_name(to));
  if (from == Dt::f32) {
    for (int64_t j = 0; j < n; ++j) {
      float f;
      std::memcpy(&f, buf + 4 * j, 4);
      const uint16_t b = bf16_encode(f);
      std::memcpy(buf + 2 * j, &b, 2);
    }
  } else {
    for (int64_t j = n; j-- > 0;) {
      uint16_t b;
      std::memcpy(&b, buf + 2 * j, 2);
      const float f = bf16_decode(b);
      std::memcpy(buf + 4 * j, &f, 4);
    }
  }
}

StagingPlan plan_staging(MPI_Comm comm, const std::vector<StagedBlock>& blocks, size_t n_datasets, int64_t bound) {
  FP8MOE_ASSERT(bound >= 8, "checkpoint: a staging buffer of ", bound, " bytes (checkpoint.staging_bytes >= 8)");
  StagingPlan plan;
  plan.calls.resize(n_datasets);
  plan.steps.assign(n_datasets, 0);
  std::vector<bool> open(n_datasets, false);  // the dataset's last call takes more whole blocks
  for (size_t j = 0; j < blocks.size(); ++j) {
    const StagedBlock& b = blocks[j];
    FP8MOE_ASSERT(b.dataset < n_datasets, "checkpoint: block of dataset ", b.dataset, " of ", n_datasets);
    const Chunks c = chunks_of(b.rows, b.width, b.elem, bound);
    if (c.count == 0) continue;  // nothing of this tensor here
    std::vector<Call>& calls = plan.calls[b.dataset];
    const int64_t n = b.rows.n * b.width, elem = int64_t(b.elem);
    if (c.count == 1 && open[b.dataset] && (calls.back().elems + n) * elem <= bound) {
      calls.back().segments.push_back({j, chunk_at(c, 0), calls.back().elems});
      calls.back().elems += n;
      plan.buffer_bytes = std::max(plan.buffer_bytes, calls.back().elems * elem);
    } else {
      for (int64_t k = 0; k < c.count; ++k) {  // the first chunk is the largest, not the last
        const Chunk ch = chunk_at(c, k);
        calls.push_back({{{j, ch, 0}}, ch.rows.n * ch.w});
        plan.buffer_bytes = std::max(plan.buffer_bytes, calls.back().elems * elem);
      }
      open[b.dataset] = c.count == 1;
    }
  }
  for (size_t d = 0; d < n_datasets; ++d) plan.steps[d] = int64_t(plan.calls[d].size());
  // A collective write or read needs the same number of calls on every rank.
  if (comm != MPI_COMM_NULL && n_datasets > 0)
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, plan.steps.data(), int(n_datasets), MPI_INT64_T, MPI_MAX, comm));
  for (int64_t& s : plan.steps) s = std::max<int64_t>(1, s);
  return plan;
}

}  // namespace fp8moe::ckpt
