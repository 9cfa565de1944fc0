// parallel/cpu_binding.h: the threads of a rank from the node's bindings, the idle CPUs, and the
// readers of Linux's CPU lists and cgroup files, on bindings and files written here.
#include "parallel/cpu_binding.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace fp8moe {
namespace {

cpu_set_t cpus(std::initializer_list<std::pair<int, int>> ranges) {  // {first, last} inclusive
  cpu_set_t s;
  CPU_ZERO(&s);
  for (auto [a, b] : ranges)
    for (int c = a; c <= b; ++c) CPU_SET(c, &s);
  return s;
}

TEST(CpuBinding, RanksOfOneBindingSplitItsCpus) {
  const cpu_set_t all = cpus({{0, 7}});
  const std::vector<cpu_set_t> three(3, all);  // mpirun --bind-to none, 3 ranks on 8 CPUs
  for (int me = 0; me < 3; ++me) {
    const ThreadPlan p = plan_threads(three, me, all);
    EXPECT_EQ(p.threads, 2);  // 8 / 3, rounded down
    EXPECT_EQ(p.binding_cpus, 8);
    EXPECT_EQ(p.sharing, 3);
    EXPECT_EQ(p.node_ranks, 3);
    EXPECT_EQ(p.idle_cpus(), 0);
  }
  const std::vector<cpu_set_t> twelve(12, all);  // more ranks than CPUs: one thread each
  EXPECT_EQ(plan_threads(twelve, 5, all).threads, 1);
}

TEST(CpuBinding, RanksOfTheirOwnBindingsUseAllOfIt) {
  // mpirun --map-by slot:pe=4 on 16 CPUs, 3 ranks: each its own 4, and 4 CPUs left idle.
  const cpu_set_t node = cpus({{0, 15}});
  const std::vector<cpu_set_t> own = {cpus({{0, 3}}), cpus({{4, 7}}), cpus({{8, 11}})};
  for (int me = 0; me < 3; ++me) {
    const ThreadPlan p = plan_threads(own, me, node);
    EXPECT_EQ(p.threads, 4);
    EXPECT_EQ(p.sharing, 1);
    EXPECT_EQ(p.node_cpus, 16);
    EXPECT_EQ(p.bound_cpus, 12);
    EXPECT_EQ(p.idle_cpus(), 4);
  }
}

TEST(CpuBinding, SharedAndOwnBindingsOnOneNode) {
  // Two ranks on socket 0 (bind-to socket) and one alone on socket 1: 8 / 2 and 8 / 1.
  const cpu_set_t s0 = cpus({{0, 7}}), s1 = cpus({{8, 15}});
  const std::vector<cpu_set_t> b = {s0, s1, s0};
  const cpu_set_t node = cpus({{0, 15}});
  EXPECT_EQ(plan_threads(b, 0, node).threads, 4);
  EXPECT_EQ(plan_threads(b, 2, node).threads, 4);
  EXPECT_EQ(plan_threads(b, 1, node).threads, 8);
  EXPECT_EQ(plan_threads(b, 1, node).sharing, 1);
  EXPECT_EQ(plan_threads(b, 1, node).idle_cpus(), 0);
}

TEST(CpuBinding, OneRankBoundToOneCoreLeavesTheOthersIdle) {
  // `mpirun -np 1` on a 2-CPU machine: Open MPI binds the rank to core 0.
  const ThreadPlan p = plan_threads({cpus({{0, 0}})}, 0, cpus({{0, 1}}));
  EXPECT_EQ(p.threads, 1);
  EXPECT_EQ(p.bound_cpus, 1);
  EXPECT_EQ(p.idle_cpus(), 1);
  // CPUs of a binding outside the usable ones (another cgroup's) are not counted as covered.
  const ThreadPlan q = plan_threads({cpus({{0, 3}})}, 0, cpus({{2, 5}}));
  EXPECT_EQ(q.threads, 4);
  EXPECT_EQ(q.node_cpus, 4);
  EXPECT_EQ(q.bound_cpus, 2);
  EXPECT_EQ(q.idle_cpus(), 2);
}

TEST(CpuBinding, CpuListsAsLinuxWritesThem) {
  cpu_set_t s;
  ASSERT_TRUE(parse_cpu_list("0-3,8,10-11\n", &s));
  EXPECT_EQ(CPU_COUNT(&s), 7);
  for (int c : {0, 1, 2, 3, 8, 10, 11}) EXPECT_TRUE(CPU_ISSET(c, &s)) << c;
  for (int c : {4, 7, 9, 12}) EXPECT_FALSE(CPU_ISSET(c, &s)) << c;
  ASSERT_TRUE(parse_cpu_list("5", &s));
  EXPECT_EQ(CPU_COUNT(&s), 1);
  EXPECT_TRUE(CPU_ISSET(5, &s));
  for (const char* bad : {"", "\n", "a", "3-1", "0-", "-2", "1,,2", "1-2-3", "0-99999", "2x"})
    EXPECT_FALSE(parse_cpu_list(bad, &s)) << "'" << bad << "'";
}

TEST(CpuBinding, CpusetDirectoryOfCgroupV1V2AndANamespacedMount) {
  // cgroup v1 beside a v2 tree without controllers (this project's development VM).
  const std::string hybrid_mounts =
      "30 25 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
      "31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw\n"
      "33 30 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:12 - cgroup cgroup rw,cpu,cpuacct\n"
      "34 30 0:30 / /sys/fs/cgroup/cpuset rw,nosuid shared:13 - cgroup cgroup rw,cpuset\n";
  CpusetDir d = cpuset_dir(hybrid_mounts, "4:cpu,cpuacct:/\n3:cpuset:/slurm/job_7\n0::/user.slice\n");
  EXPECT_EQ(d.dir, "/sys/fs/cgroup/cpuset/slurm/job_7");
  EXPECT_EQ(d.mount, "/sys/fs/cgroup/cpuset");
  EXPECT_EQ(d.file, "cpuset.effective_cpus");
  // cgroup v2 alone.
  d = cpuset_dir("29 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n",
                 "0::/system.slice/job.scope\n");
  EXPECT_EQ(d.dir, "/sys/fs/cgroup/system.slice/job.scope");
  EXPECT_EQ(d.file, "cpuset.cpus.effective");
  // A container's mount of its own subtree (root /docker/abc): the path is under it.
  d = cpuset_dir("40 30 0:30 /docker/abc /sys/fs/cgroup/cpuset ro - cgroup cgroup rw,cpuset\n",
                 "3:cpuset:/docker/abc/inner\n");
  EXPECT_EQ(d.dir, "/sys/fs/cgroup/cpuset/inner");
  // Not under the mount's root, or no cgroup file system: nothing (node_cpus() takes the online CPUs).
  EXPECT_EQ(cpuset_dir("40 30 0:30 /docker/abc /sys/fs/cgroup/cpuset ro - cgroup cgroup rw,cpuset\n",
                       "3:cpuset:/docker/abcd\n").dir,
            "");
  EXPECT_EQ(cpuset_dir("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n", "0::/\n").dir, "");
}

TEST(CpuBinding, ThisProcessIsBoundWithinTheNodesUsableCpus) {
  const cpu_set_t mine = own_binding(), node = node_cpus();
  cpu_set_t both;
  CPU_AND(&both, &mine, &node);
  EXPECT_GE(CPU_COUNT(&mine), 1);
  EXPECT_TRUE(CPU_EQUAL(&both, &mine)) << "the process's affinity reaches beyond its cgroup's online CPUs";
}

TEST(CpuBinding, SharedBindingThreadsUnlessOmpNumThreadsIsSet) {
  const char* was = std::getenv("OMP_NUM_THREADS");
  const std::string saved = was ? was : "";
  const cpu_set_t mine = own_binding();
  ::unsetenv("OMP_NUM_THREADS");
  for (int ranks : {1, 2, 3, 1000}) {
    const int want = std::max(1, CPU_COUNT(&mine) / ranks);
    EXPECT_EQ(set_shared_binding_threads(ranks), want) << ranks << " ranks";
    EXPECT_EQ(omp_get_max_threads(), want);
  }
  omp_set_num_threads(3);
  ::setenv("OMP_NUM_THREADS", "3", 1);
  EXPECT_EQ(set_shared_binding_threads(1000), 3);  // OMP_NUM_THREADS stands
  if (was)
    ::setenv("OMP_NUM_THREADS", saved.c_str(), 1);
  else
    ::unsetenv("OMP_NUM_THREADS");
}

}  // namespace
}  // namespace fp8moe
