#include "parallel/grid.h"

#include <unistd.h>

#include <cstdio>
#include <vector>

#include "kernels/check.h"

namespace fp8moe {

std::optional<GridProblem> grid_layout_problem(int world, int tensor, int pipeline, int expert) {
  const auto n = [](int v) { return std::to_string(v); };
  if (world < 1) return GridProblem{"world size", "at least 1, got " + n(world)};
  for (auto [key, v] : {std::pair{"parallel.tensor", tensor}, {"parallel.pipeline", pipeline}, {"parallel.expert", expert}})
    if (v < 1) return GridProblem{key, "at least 1, got " + n(v)};
  const std::string w = "the world size " + n(world);
  if (world % tensor != 0) return GridProblem{"parallel.tensor", "a divisor of " + w};
  if (world % (tensor * pipeline) != 0)
    return GridProblem{"parallel.pipeline",
                       "a value with parallel.tensor x parallel.pipeline = " + n(tensor) + " x " + n(pipeline) + " dividing " + w};
  const int data = world / (tensor * pipeline);
  if (data % expert != 0)
    return GridProblem{"parallel.expert", "a divisor of the data-parallel size " + n(data) + " = world " + n(world) +
                                              " / (tensor " + n(tensor) + " x pipeline " + n(pipeline) + ")"};
  return std::nullopt;
}

GridDims make_grid_dims(int world, int tensor, int pipeline, int expert) {
  const auto problem = grid_layout_problem(world, tensor, pipeline, expert);
  FP8MOE_ASSERT(!problem, "invalid grid layout: ", problem ? problem->text() : "");
  GridDims d;
  d.world = world;
  d.tensor = tensor;
  d.pipeline = pipeline;
  d.data = world / (tensor * pipeline);
  d.expert = expert;
  d.expert_data = d.data / expert;
  return d;
}

GridCoord grid_coord_of(const GridDims& d, int rank) {
  FP8MOE_ASSERT(rank >= 0 && rank < d.world, "rank ", rank, " outside world ", d.world);
  GridCoord c;
  int rest = rank;
  for (const GridAxis& a : kRankOrder) c.*a.coordinate = rest % d.*a.size, rest /= d.*a.size;
  c.data = c.expert + d.expert * c.expert_data;
  return c;
}

int grid_rank_of(const GridDims& d, const GridCoord& c) {
  int rank = 0;
  for (auto a = kRankOrder.rbegin(); a != kRankOrder.rend(); ++a) rank = rank * d.*a->size + c.*a->coordinate;
  return rank;
}

namespace {
// Ranks sharing `color` form one group, ordered by `key` (the coordinate that varies inside it).
MPI_Comm split(MPI_Comm world, int color, int key) {
  MPI_Comm out = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split(world, color, key, &out));
  return out;
}
}  // namespace

ProcessGrid::ProcessGrid(MPI_Comm world, int tensor, int pipeline, int expert) : world_(world) {
  int size = 0;
  MPI_CHECK(MPI_Comm_rank(world, &rank_));
  MPI_CHECK(MPI_Comm_size(world, &size));
  dims_ = make_grid_dims(size, tensor, pipeline, expert);
  coord_ = grid_coord_of(dims_, rank_);
  const GridDims& d = dims_;
  const GridCoord& c = coord_;
  // Each color is a unique index of the coordinates the group holds fixed.
  tensor_ = split(world, c.data + d.data * c.pipeline, c.tensor);
  pipeline_ = split(world, c.tensor + d.tensor * c.data, c.pipeline);
  data_ = split(world, c.tensor + d.tensor * c.pipeline, c.data);
  expert_ = split(world, c.tensor + d.tensor * (c.expert_data + d.expert_data * c.pipeline), c.expert);
  expert_data_ = split(world, c.tensor + d.tensor * (c.expert + d.expert * c.pipeline), c.expert_data);
}

ProcessGrid::~ProcessGrid() {
  for (MPI_Comm* comm : {&tensor_, &pipeline_, &data_, &expert_, &expert_data_})
    if (*comm != MPI_COMM_NULL) MPI_Comm_free(comm);
}

std::string grid_layout_table(const GridDims& d, const std::vector<std::string>& hosts) {
  std::string out;
  char line[256];
  std::string order;
  for (const GridAxis& a : kRankOrder) order += std::string(order.empty() ? "" : "-") + a.name;
  std::snprintf(line, sizeof line,
                "process grid: world %d = tensor %d x pipeline %d x data %d; data %d = expert %d x "
                "expert-data %d; rank order %s (tensor fastest)\n",
                d.world, d.tensor, d.pipeline, d.data, d.data, d.expert, d.expert_data, order.c_str());
  out += line;
  out += "   rank  host                  tp   pp   dp   ep  edp\n";
  // NOTE: a full table of thousands of ranks helps nobody; the coordinates follow from the
  // formula in grid.h, so show the first 64 rows only.
  constexpr int kMaxRows = 64;
  for (int r = 0; r < d.world && r < kMaxRows; ++r) {
    const GridCoord c = grid_coord_of(d, r);
    const char* host = size_t(r) < hosts.size() ? hosts[size_t(r)].c_str() : "-";
    std::snprintf(line, sizeof line, "  %5d  %-20.20s %4d %4d %4d %4d %4d\n", r, host, c.tensor, c.pipeline, c.data,
                  c.expert, c.expert_data);
    out += line;
  }
  if (d.world > kMaxRows) out += "  ... (" + std::to_string(d.world - kMaxRows) + " more ranks)\n";
  return out;
}

std::string ProcessGrid::layout_table() const {
  constexpr int kHost = 64;
  char host[kHost] = {};
  gethostname(host, kHost - 1);
  std::vector<char> gathered(rank_ == 0 ? static_cast<size_t>(dims_.world) * kHost : 0);
  MPI_CHECK(MPI_Gather(host, kHost, MPI_CHAR, gathered.data(), kHost, MPI_CHAR, 0, world_));
  if (rank_ != 0) return {};
  std::vector<std::string> hosts;
  for (int r = 0; r < dims_.world; ++r) hosts.emplace_back(&gathered[size_t(r) * kHost]);
  return grid_layout_table(dims_, hosts);
}

}  // namespace fp8moe
