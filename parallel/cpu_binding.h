// How many OpenMP threads a rank runs: the CPUs of its binding (the affinity mask its launcher gave
// it), split among the ranks of its node that share that same binding; and the CPUs of the node
// that no rank's binding covers (idle for the whole run). Used by `train` (every rank, collective)
// and by plan's probe (one process, predicting a launch whose ranks share this process's CPUs).
//
// A CPU is a logical CPU as Linux numbers them (a core, or one hardware thread of it where SMT is
// on): what affinity masks, `nproc` and OpenMP's omp_get_num_procs() count.
#pragma once

#include <mpi.h>
#include <sched.h>

#include <string>
#include <vector>

namespace fp8moe {

// What one rank's threads come from, among the node-local ranks' bindings.
struct ThreadPlan {
  int threads = 1;     // the OpenMP threads of this rank: binding_cpus / sharing, at least 1
  int binding_cpus = 0;  // CPUs in this rank's binding
  int sharing = 1;     // node-local ranks with exactly this binding, this one included
  int node_ranks = 1;  // ranks on the node
  int node_cpus = 0;   // the node's CPUs this job may use (node_cpus() below)
  int bound_cpus = 0;  // of those, the CPUs in at least one node-local rank's binding
  int idle_cpus() const { return node_cpus - bound_cpus; }
};

// The plan of rank `me` of the node-local ranks whose bindings are `bindings` (one per rank, in
// node-local rank order), on a node whose usable CPUs are `available`. Ranks with an identical
// binding split it; a binding not identical to any other is the rank's own (NOTE: partly overlapping
// bindings are counted as distinct: no launcher makes them; mpirun's core, package, NUMA and
// `slot:pe=N` bindings are each identical or disjoint). Pure.
ThreadPlan plan_threads(const std::vector<cpu_set_t>& bindings, int me, const cpu_set_t& available);

// This process's binding (sched_getaffinity); a failed call is fatal (kernels/check.h).
cpu_set_t own_binding();

// The CPUs this job may use on this node: the online CPUs (/sys/devices/system/cpu/online) that
// the process's cgroup cpuset allows (cgroup v2's cpuset.cpus.effective, or v1's
// cpuset.effective_cpus, of the nearest cgroup up the tree that has one). A container limited to
// some CPUs, or a Slurm job's cgroup, is the limit, not the whole machine; mpirun's binding is an
// affinity mask, not a cgroup, so it does not shrink this. NOTE: a cgroup CPU quota (cpu.max)
// limits time, not CPUs, and is not counted. Without a readable cpuset, the online CPUs; without
// those, sysconf(_SC_NPROCESSORS_ONLN) CPUs numbered from 0.
cpu_set_t node_cpus();

// The pieces of node_cpus(), on text (for the tests): the CPUs of a list as Linux writes them
// ("0-3,8,10-11\n"); false on anything else.
bool parse_cpu_list(const std::string& text, cpu_set_t* out);
// The directory of the process's cpuset cgroup from /proc/self/mountinfo and /proc/self/cgroup, and
// the name of its file of effective CPUs there ("cpuset.cpus.effective" for cgroup v2,
// "cpuset.effective_cpus" for v1); empty when neither names a cpuset hierarchy.
struct CpusetDir {
  std::string dir, mount, file;
};
CpusetDir cpuset_dir(const std::string& mountinfo, const std::string& proc_cgroup);

// A rank's threads as `train` sets them: the plan over the node's ranks (bindings gathered over
// its node, MPI_Comm_split_type shared), omp_set_num_threads(plan.threads) unless OMP_NUM_THREADS
// is set (then OpenMP's own count stands). Collective over `comm`.
struct RankThreads {
  ThreadPlan plan;       // this rank's
  int threads = 1;       // omp_get_max_threads() after setting them
  int min_threads = 1, max_threads = 1;  // over every rank of `comm`
  bool from_env = false;  // OMP_NUM_THREADS is set
  std::string summary;    // "2 (...)": the count and where it came from (rank 0's)
  std::string idle_line;  // empty, or the one line saying the bindings leave CPUs idle (rank 0's)
};
RankThreads set_rank_threads(MPI_Comm comm);

// The threads of each of `ranks` ranks of one node that all share this process's binding (as
// `mpirun --bind-to none` runs them), set as set_rank_threads sets them: plan's probe, one process
// without MPI, measures the step `train` would run on such a launch. Returns omp_get_max_threads().
int set_shared_binding_threads(int ranks);

}  // namespace fp8moe
