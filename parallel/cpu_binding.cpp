#include "parallel/cpu_binding.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "kernels/check.h"
#include "parallel/watchdog.h"

namespace fp8moe {

ThreadPlan plan_threads(const std::vector<cpu_set_t>& bindings, int me, const cpu_set_t& available) {
  FP8MOE_ASSERT(me >= 0 && size_t(me) < bindings.size(), "plan_threads: rank ", me, " of ", bindings.size());
  const cpu_set_t& mine = bindings[size_t(me)];
  ThreadPlan p;
  p.binding_cpus = CPU_COUNT(&mine);
  p.sharing = 0;
  cpu_set_t bound;
  CPU_ZERO(&bound);
  for (const cpu_set_t& b : bindings) {
    if (CPU_EQUAL(&b, &mine)) ++p.sharing;
    CPU_OR(&bound, &bound, &b);
  }
  CPU_AND(&bound, &bound, &available);
  p.node_ranks = int(bindings.size());
  p.node_cpus = CPU_COUNT(&available);
  p.bound_cpus = CPU_COUNT(&bound);
  // NOTE: never more threads than CPUs: OpenMP's spinning threads crawl on shared cores.
  p.threads = std::max(1, p.binding_cpus / p.sharing);
  return p;
}

cpu_set_t own_binding() {
  cpu_set_t s;
  CPU_ZERO(&s);
  // NOTE: a fixed cpu_set_t holds CPUs 0-1023 (CPU_SETSIZE); on a machine with more the call fails.
  FP8MOE_ASSERT(sched_getaffinity(0, sizeof s, &s) == 0, "sched_getaffinity: ", std::strerror(errno));
  return s;
}

bool parse_cpu_list(const std::string& text, cpu_set_t* out) {
  CPU_ZERO(out);
  std::string t = text;
  while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.pop_back();
  if (t.empty()) return false;
  std::stringstream items(t);
  std::string item;
  while (std::getline(items, item, ',')) {
    const size_t dash = item.find('-');
    char* end = nullptr;
    const long a = std::strtol(item.c_str(), &end, 10);
    if (end == item.c_str() || (dash == std::string::npos ? *end != '\0' : end != item.c_str() + dash)) return false;
    long b = a;
    if (dash != std::string::npos) {
      const char* from = item.c_str() + dash + 1;
      b = std::strtol(from, &end, 10);
      if (end == from || *end != '\0') return false;
    }
    if (a < 0 || b < a || b >= CPU_SETSIZE) return false;
    for (long c = a; c <= b; ++c) CPU_SET(int(c), out);
  }
  return true;
}

namespace {

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return f ? s.str() : std::string();
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, sep)) parts.push_back(part);
  return parts;
}

bool has_item(const std::string& list, const std::string& item) {
  for (const std::string& x : split(list, ','))
    if (x == item) return true;
  return false;
}

}  // namespace

CpusetDir cpuset_dir(const std::string& mountinfo, const std::string& proc_cgroup) {
  // /proc/self/cgroup: "ID:CONTROLLERS:PATH" per hierarchy; v1's cpuset names it, v2 is "0::PATH".
  std::string v1, v2;
  bool have_v1 = false, have_v2 = false;
  for (const std::string& line : split(proc_cgroup, '\n')) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (has_item(controllers, "cpuset")) v1 = path, have_v1 = true;
    if (line.substr(0, a) == "0" && controllers.empty()) v2 = path, have_v2 = true;
  }
  // /proc/self/mountinfo: "ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTIONS".
  CpusetDir v1_dir, v2_dir;
  for (const std::string& line : split(mountinfo, '\n')) {
    const std::vector<std::string> f = split(line, ' ');
    const auto dash = std::find(f.begin(), f.end(), "-");
    if (f.size() < 5 || dash == f.end() || f.end() - dash < 4) continue;
    const std::string &root = f[3], &mount = f[4], &fstype = dash[1], &super = dash[3];
    auto under = [&](const std::string& path) -> std::string {  // PATH seen from this mount, or ""
      if (root == "/") return mount + (path == "/" ? "" : path);
      if (path.compare(0, root.size(), root) == 0 && (path.size() == root.size() || path[root.size()] == '/'))
        return mount + path.substr(root.size());
      return "";
    };
    if (have_v1 && fstype == "cgroup" && has_item(super, "cpuset") && v1_dir.dir.empty())
      v1_dir = CpusetDir{under(v1), mount, "cpuset.effective_cpus"};
    if (have_v2 && fstype == "cgroup2" && v2_dir.dir.empty())
      v2_dir = CpusetDir{under(v2), mount, "cpuset.cpus.effective"};
  }
  // v1's cpuset controller, where mounted, holds the cpusets; else v2's (a hybrid mount's v2 tree
  // has no controllers).
  if (!v1_dir.dir.empty()) return v1_dir;
  if (!v2_dir.dir.empty()) return v2_dir;
  return CpusetDir{};
}

cpu_set_t node_cpus() {
  cpu_set_t online;
  if (!parse_cpu_list(read_text("/sys/devices/system/cpu/online"), &online)) {
    CPU_ZERO(&online);
    const long n = std::min<long>(sysconf(_SC_NPROCESSORS_ONLN), CPU_SETSIZE);
    for (long c = 0; c < std::max(1L, n); ++c) CPU_SET(int(c), &online);
  }
  const CpusetDir where = cpuset_dir(read_text("/proc/self/mountinfo"), read_text("/proc/self/cgroup"));
  // The nearest cgroup up the tree with a cpuset (under cgroup v2 a cgroup whose parent does not
  // enable the controller has no cpuset file).
  for (std::string dir = where.dir; !dir.empty() && dir.size() >= where.mount.size();) {
    cpu_set_t allowed;
    if (parse_cpu_list(read_text(dir + "/" + where.file), &allowed)) {
      CPU_AND(&allowed, &allowed, &online);
      if (CPU_COUNT(&allowed) > 0) return allowed;
    }
    if (dir == where.mount) break;
    const size_t slash = dir.find_last_of('/');
    dir = slash == std::string::npos || slash < where.mount.size() ? where.mount : dir.substr(0, slash);
  }
  return online;
}

namespace {

std::string plural(int n, const char* one, const char* many) { return std::to_string(n) + " " + (n == 1 ? one : many); }

bool threads_from_env() { return std::getenv("OMP_NUM_THREADS") != nullptr; }

// The plan's threads, unless OMP_NUM_THREADS says otherwise (OpenMP read it at start-up).
int apply(const ThreadPlan& p) {
  if (!threads_from_env()) omp_set_num_threads(p.threads);
  return omp_get_max_threads();
}

}  // namespace

RankThreads set_rank_threads(MPI_Comm comm) {
  const WatchScope watch("thread set-up (the node's CPU bindings)");
  MPI_Comm node;
  int local = 0, local_size = 1;
  MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  MPI_CHECK(MPI_Comm_rank(node, &local));
  MPI_CHECK(MPI_Comm_size(node, &local_size));
  const cpu_set_t mine = own_binding();
  std::vector<cpu_set_t> bindings(static_cast<size_t>(local_size));
  MPI_CHECK(MPI_Allgather(&mine, int(sizeof mine), MPI_BYTE, bindings.data(), int(sizeof mine), MPI_BYTE, node));
  // The node's usable CPUs: those any of its ranks may use (Slurm may give each task a cgroup of
  // its own CPUs).
  const cpu_set_t own = node_cpus();
  cpu_set_t available;
  MPI_CHECK(MPI_Allreduce(&own, &available, int(sizeof own), MPI_BYTE, MPI_BOR, node));
  MPI_CHECK(MPI_Comm_free(&node));

  RankThreads r;
  r.plan = plan_threads(bindings, local, available);
  r.from_env = threads_from_env();
  r.threads = apply(r.plan);
  MPI_CHECK(MPI_Allreduce(&r.threads, &r.min_threads, 1, MPI_INT, MPI_MIN, comm));
  MPI_CHECK(MPI_Allreduce(&r.threads, &r.max_threads, 1, MPI_INT, MPI_MAX, comm));
  int mine_nodes[2] = {local == 0 ? 1 : 0, local == 0 && r.plan.idle_cpus() > 0 ? 1 : 0}, nodes[2] = {0, 0};
  MPI_CHECK(MPI_Allreduce(mine_nodes, nodes, 2, MPI_INT, MPI_SUM, comm));

  const ThreadPlan& p = r.plan;
  const std::string n = std::to_string(r.threads);
  const std::string count = r.min_threads == r.max_threads ? n
                                                           : std::to_string(r.min_threads) + " to " +
                                                                 std::to_string(r.max_threads) + ", rank 0 " + n;
  if (r.from_env && r.threads > p.binding_cpus)
    r.summary = count + " (OMP_NUM_THREADS; more than the " + plural(p.binding_cpus, "CPU", "CPUs") +
                " of rank 0's binding)";
  else if (r.from_env)
    r.summary = count + " (OMP_NUM_THREADS)";
  else
    r.summary = count + " (the CPUs of its binding / the ranks of its node sharing them; rank 0: " +
                std::to_string(p.binding_cpus) + " / " + std::to_string(p.sharing) +
                (p.binding_cpus < p.sharing ? ", at least 1" : "") + ")";

  if (nodes[1] == 0) return r;
  const std::string how =
      "; launch with `mpirun --bind-to none` (the ranks of a node share its CPUs) or `mpirun --map-by slot:pe=N` "
      "(N CPUs per rank) to use them";
  const std::string ranks = p.node_ranks == 1 ? "the 1 rank of this node is" : "the " + std::to_string(p.node_ranks) +
                                                                                    " ranks of this node are";
  const std::string here = ranks + " bound to " + std::to_string(p.bound_cpus) + " of its " +
                           plural(p.node_cpus, "CPU", "CPUs") + ", " + std::to_string(p.idle_cpus()) + " idle";
  const std::string some = "on " + std::to_string(nodes[1]) + " of the " + std::to_string(nodes[0]) +
                           " nodes the ranks' bindings leave CPUs idle";
  if (nodes[0] == 1)
    r.idle_line = here + how;
  else if (p.idle_cpus() > 0)
    r.idle_line = some + " (rank 0's node: " + here + ")" + how;
  else
    r.idle_line = some + " (not on rank 0's)" + how;
  return r;
}

int set_shared_binding_threads(int ranks) {
  return apply(plan_threads(std::vector<cpu_set_t>(size_t(std::max(1, ranks)), own_binding()), 0, node_cpus()));
}

}  // namespace fp8moe
