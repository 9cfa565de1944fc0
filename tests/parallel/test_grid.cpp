// The process grid at every valid (tensor, pipeline, expert) layout of the world it runs on.
//
// Expected values come from an independent construction: ranks are handed out by nested loops in
// the documented order (pipeline outermost, then expert-data, then expert, tensor innermost), so
// coordinates are never derived by the division/modulo code under test. Group membership is then
// "every rank that agrees on all other coordinates", and a collective over each group must give
// exactly the bitmask of its members.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <map>
#include <vector>

#include "parallel/grid.h"

namespace fp8moe {
namespace {

struct Layout {
  int tensor, pipeline, expert;
};

// Every (tensor, pipeline, expert) that fits `world` ranks.
std::vector<Layout> valid_layouts(int world) {
  std::vector<Layout> out;
  for (int t = 1; t <= world; ++t)
    for (int p = 1; t * p <= world; ++p)
      for (int e = 1; t * p * e <= world; ++e)
        if (world % (t * p * e) == 0) out.push_back({t, p, e});
  return out;
}

// rank -> coordinates by enumeration in rank order (tp fastest, then ep, then edp, then pp).
std::vector<GridCoord> enumerate_coords(int world, const Layout& l) {
  const int edp_size = world / (l.tensor * l.pipeline * l.expert);
  std::vector<GridCoord> by_rank;
  for (int pp = 0; pp < l.pipeline; ++pp)
    for (int edp = 0; edp < edp_size; ++edp)
      for (int ep = 0; ep < l.expert; ++ep)
        for (int tp = 0; tp < l.tensor; ++tp)
          by_rank.push_back(GridCoord{tp, pp, ep + l.expert * edp, ep, edp});
  return by_rank;
}

enum class Group { tensor, pipeline, data, expert, expert_data };
constexpr Group kGroups[] = {Group::tensor, Group::pipeline, Group::data, Group::expert, Group::expert_data};

const char* name(Group g) {
  switch (g) {
    case Group::tensor: return "tensor";
    case Group::pipeline: return "pipeline";
    case Group::data: return "data";
    case Group::expert: return "expert";
    default: return "expert_data";
  }
}

// Does rank b belong to rank a's group g? (it agrees on every coordinate g holds fixed)
bool same_group(Group g, const GridCoord& a, const GridCoord& b) {
  switch (g) {
    case Group::tensor: return a.pipeline == b.pipeline && a.data == b.data;
    case Group::pipeline: return a.tensor == b.tensor && a.data == b.data;
    case Group::data: return a.tensor == b.tensor && a.pipeline == b.pipeline;
    case Group::expert: return a.tensor == b.tensor && a.pipeline == b.pipeline && a.expert_data == b.expert_data;
    default: return a.tensor == b.tensor && a.pipeline == b.pipeline && a.expert == b.expert;
  }
}

// The coordinate that orders a group.
int position(Group g, const GridCoord& c) {
  switch (g) {
    case Group::tensor: return c.tensor;
    case Group::pipeline: return c.pipeline;
    case Group::data: return c.data;
    case Group::expert: return c.expert;
    default: return c.expert_data;
  }
}

MPI_Comm comm_of(const ProcessGrid& grid, Group g) {
  switch (g) {
    case Group::tensor: return grid.tensor();
    case Group::pipeline: return grid.pipeline();
    case Group::data: return grid.data();
    case Group::expert: return grid.expert();
    default: return grid.expert_data();
  }
}

// World ranks of `comm`'s members, in group-rank order.
std::vector<int> members(MPI_Comm comm) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  MPI_Group world_group, group;
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  MPI_Comm_group(comm, &group);
  std::vector<int> local(size), world(size);
  for (int i = 0; i < size; ++i) local[i] = i;
  MPI_Group_translate_ranks(group, size, local.data(), world_group, world.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  return world;
}

class GridTest : public testing::Test {
 protected:
  void SetUp() override {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &world_);
  }
  int rank_ = 0, world_ = 1;
};

TEST_F(GridTest, LayoutsAreEnumerated) {
  // Sanity of the test's own enumeration: (1,1,1) always, and every layout really divides.
  const auto layouts = valid_layouts(world_);
  ASSERT_FALSE(layouts.empty());
  for (const Layout& l : layouts) EXPECT_FALSE(grid_layout_problem(world_, l.tensor, l.pipeline, l.expert));
  const std::map<int, size_t> expected_count = {{1, 1}, {2, 4}, {4, 10}, {8, 20}};
  if (expected_count.count(world_)) {
    EXPECT_EQ(layouts.size(), expected_count.at(world_));
  }
}

TEST_F(GridTest, CoordinatesGroupsAndCollectivesAtEveryLayout) {
  for (const Layout& l : valid_layouts(world_)) {
    SCOPED_TRACE(testing::Message() << "world " << world_ << " tensor " << l.tensor << " pipeline " << l.pipeline
                                    << " expert " << l.expert);
    const std::vector<GridCoord> expect = enumerate_coords(world_, l);
    ASSERT_EQ(static_cast<int>(expect.size()), world_);

    ProcessGrid grid(MPI_COMM_WORLD, l.tensor, l.pipeline, l.expert);
    const GridDims& d = grid.dims();
    EXPECT_EQ(d.world, world_);
    EXPECT_EQ(d.data, world_ / (l.tensor * l.pipeline));
    EXPECT_EQ(d.expert_data * d.expert, d.data);
    EXPECT_EQ(grid.coord(), expect[rank_]);
    for (int r = 0; r < world_; ++r) {
      EXPECT_EQ(grid_coord_of(d, r), expect[r]) << "rank " << r;
      EXPECT_EQ(grid_rank_of(d, expect[r]), r);
    }

    for (Group g : kGroups) {
      SCOPED_TRACE(name(g));
      // Expected members, ordered by the coordinate that varies in the group.
      std::vector<int> want;
      for (int r = 0; r < world_; ++r)
        if (same_group(g, expect[rank_], expect[r])) want.push_back(r);
      std::sort(want.begin(), want.end(),
                [&](int a, int b) { return position(g, expect[a]) < position(g, expect[b]); });

      MPI_Comm comm = comm_of(grid, g);
      EXPECT_EQ(members(comm), want);
      int group_rank = -1;
      MPI_Comm_rank(comm, &group_rank);
      EXPECT_EQ(group_rank, position(g, expect[rank_]));

      // A collective over the group: the sum of 2^world_rank is exactly the members' bitmask.
      long long bit = 1LL << rank_, mask = 0, want_mask = 0;
      for (int r : want) want_mask |= 1LL << r;
      ASSERT_EQ(MPI_Allreduce(&bit, &mask, 1, MPI_LONG_LONG, MPI_SUM, comm), MPI_SUCCESS);
      EXPECT_EQ(mask, want_mask);
    }
    // Groups of one kind partition the world: sizes multiply out.
    int st = 0, sp = 0, sd = 0, se = 0, sed = 0;
    MPI_Comm_size(grid.tensor(), &st);
    MPI_Comm_size(grid.pipeline(), &sp);
    MPI_Comm_size(grid.data(), &sd);
    MPI_Comm_size(grid.expert(), &se);
    MPI_Comm_size(grid.expert_data(), &sed);
    EXPECT_EQ(st * sp * sd, world_);
    EXPECT_EQ(se * sed, sd);
    EXPECT_EQ(st, l.tensor);
    EXPECT_EQ(sp, l.pipeline);
    EXPECT_EQ(se, l.expert);
  }
}

TEST_F(GridTest, LayoutTableListsEveryRankOnRankZero) {
  const Layout l = valid_layouts(world_).back();
  ProcessGrid grid(MPI_COMM_WORLD, l.tensor, l.pipeline, l.expert);
  const std::string table = grid.layout_table();
  if (rank_ != 0) {
    EXPECT_TRUE(table.empty());
    return;
  }
  EXPECT_NE(table.find("world " + std::to_string(world_) + " = tensor " + std::to_string(l.tensor)), std::string::npos)
      << table;
  // header + title + one row per rank
  EXPECT_EQ(std::count(table.begin(), table.end(), '\n'), 2 + world_) << table;
}

TEST(GridLayoutProblem, RejectsWhatDoesNotFit) {
  EXPECT_FALSE(grid_layout_problem(8, 2, 2, 2));
  EXPECT_EQ(grid_layout_problem(8, 3, 1, 1)->text(), "parallel.tensor: expected a divisor of the world size 8");
  EXPECT_EQ(grid_layout_problem(8, 2, 3, 1)->text(),
            "parallel.pipeline: expected a value with parallel.tensor x parallel.pipeline = 2 x 3 dividing the world size 8");
  EXPECT_EQ(grid_layout_problem(8, 2, 2, 4)->text(),
            "parallel.expert: expected a divisor of the data-parallel size 2 = world 8 / (tensor 2 x pipeline 2)");
  EXPECT_EQ(grid_layout_problem(4, 0, 1, 1)->key, "parallel.tensor");
}

}  // namespace
}  // namespace fp8moe
