// The process grid: world = tensor x pipeline x data, with expert parallelism carved out of data
// (data = expert x expert_data). Rank order (kRankOrder) "tp-ep-edp-pp": tensor fastest, then
// expert within data, then the rest of data, then pipeline, so that neighbouring ranks (one node's
// fast links) form the tensor groups first:
//
//   rank = tp + T * (ep + E * (edp + D_e * pp))       data index dp = ep + E * edp
//
// Gradients of dense parameters are summed over `data`, of expert parameters over `expert_data`;
// MoE dispatch/combine runs over `expert`.
#pragma once

#include <mpi.h>

#include <array>
#include <optional>
#include <string>
#include <vector>

namespace fp8moe {

struct GridDims {
  int world = 1;
  int tensor = 1;       // T
  int pipeline = 1;     // P
  int data = 1;         // D = world / (T * P)
  int expert = 1;       // E, divides D
  int expert_data = 1;  // D_e = D / E
};

struct GridCoord {
  int tensor = 0;       // in [0, T)
  int pipeline = 0;     // in [0, P)
  int data = 0;         // in [0, D)   = expert + E * expert_data
  int expert = 0;       // in [0, E)
  int expert_data = 0;  // in [0, D_e)
  bool operator==(const GridCoord&) const = default;
};

// The rank order, fastest-varying first: one list that grid_coord_of, grid_rank_of and the printed
// layout all read. Tensor groups come first so that they sit on neighbouring ranks (one node).
struct GridAxis {
  const char* name;           // "tp", "ep", "edp", "pp"
  int GridDims::*size;        // d.*size: the axis's size
  int GridCoord::*coordinate; // c.*coordinate: a rank's index along it
};
inline constexpr std::array<GridAxis, 4> kRankOrder = {{{"tp", &GridDims::tensor, &GridCoord::tensor},
                                                        {"ep", &GridDims::expert, &GridCoord::expert},
                                                        {"edp", &GridDims::expert_data, &GridCoord::expert_data},
                                                        {"pp", &GridDims::pipeline, &GridCoord::pipeline}}};

// What makes (tensor, pipeline, expert) an invalid layout of `world` ranks: the `parallel.` key at
// fault and what it must be (the first broken rule, in the order tensor, pipeline, expert). The
// world-size rules are written here only: io/config's validation and make_grid_dims ask this.
struct GridProblem {
  std::string key;       // "parallel.tensor", "parallel.pipeline" or "parallel.expert"
  std::string expected;  // "a divisor of the world size 4", ...
  std::string text() const { return key + ": expected " + expected; }
};
std::optional<GridProblem> grid_layout_problem(int world, int tensor, int pipeline, int expert);

// Dims of a valid layout (asserts validity: user input is checked by io/config first).
GridDims make_grid_dims(int world, int tensor, int pipeline, int expert);
// The layout of `d` as the start of a run prints it: the grid's formula, then the first 64 ranks'
// coordinates with hosts[r] ("-" past the end of hosts: a layout not launched).
std::string grid_layout_table(const GridDims& d, const std::vector<std::string>& hosts);
GridCoord grid_coord_of(const GridDims& d, int rank);
int grid_rank_of(const GridDims& d, const GridCoord& c);

// One rank's place in the grid and its communicators. Passed explicitly, never a global.
// Construction and layout_table() are collective over `world`.
class ProcessGrid {
 public:
  ProcessGrid(MPI_Comm world, int tensor, int pipeline, int expert);
  ~ProcessGrid();
  ProcessGrid(const ProcessGrid&) = delete;
  ProcessGrid& operator=(const ProcessGrid&) = delete;

  const GridDims& dims() const { return dims_; }
  const GridCoord& coord() const { return coord_; }
  int rank() const { return rank_; }

  MPI_Comm world() const { return world_; }
  MPI_Comm tensor() const { return tensor_; }            // size T: same (dp, pp)
  MPI_Comm pipeline() const { return pipeline_; }        // size P: same (tp, dp)
  MPI_Comm data() const { return data_; }                // size D: same (tp, pp)
  MPI_Comm expert() const { return expert_; }            // size E: same (tp, edp, pp)
  MPI_Comm expert_data() const { return expert_data_; }  // size D_e: same (tp, ep, pp)

  // Collective: gathers host names; rank 0 gets a compact table of the layout, others "".
  std::string layout_table() const;

 private:
  GridDims dims_;
  GridCoord coord_;
  int rank_ = 0;
  MPI_Comm world_ = MPI_COMM_NULL;
  MPI_Comm tensor_ = MPI_COMM_NULL, pipeline_ = MPI_COMM_NULL, data_ = MPI_COMM_NULL;
  MPI_Comm expert_ = MPI_COMM_NULL, expert_data_ = MPI_COMM_NULL;
};

}  // namespace fp8moe
