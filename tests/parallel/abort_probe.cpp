// Run under mpirun by test_mpi_abort.
//   (no argument) rank 1 makes an MPI call fail (a send to a rank that does not exist) while rank 0
//     waits in a barrier that can never complete. MPI_CHECK must print the decoded error with rank
//     and host and MPI_Abort the whole job, so nobody hangs.
//   watchdog-step / watchdog-call: a 1 s watchdog; the main thread stays 20 s in step 7 (phase
//     "compute", no call) or in one call ("allreduce" over "dp"): the watchdog must end the job
//     with exit 4 and name it.
//   watchdog-progress: a 1 s watchdog; 3 s of calls of 0.1 s each inside one outer call, then a
//     0.6 s step: nothing lasts longer than the limit, so the job must finish, exit 0.
#include <mpi.h>

#include <chrono>
#include <string>
#include <thread>

#include "kernels/check.h"
#include "parallel/mpi_session.h"
#include "parallel/watchdog.h"

int main(int argc, char** argv) {
  using namespace std::chrono_literals;
  fp8moe::MpiSession mpi(&argc, &argv);
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode.empty()) {
    if (mpi.rank() == 1) {
      int value = 42;
      MPI_CHECK(MPI_Send(&value, 1, MPI_INT, mpi.size() + 10, 0, MPI_COMM_WORLD));
    } else {
      MPI_Barrier(MPI_COMM_WORLD);
    }
    return 0;
  }
  const fp8moe::Watchdog watchdog(1.0, mpi.rank());
  if (mode == "watchdog-step") {
    fp8moe::watch_step(7, "compute");
    std::this_thread::sleep_for(20s);
  } else if (mode == "watchdog-call") {
    const fp8moe::WatchScope scope("allreduce", "dp");
    std::this_thread::sleep_for(20s);
  } else if (mode == "watchdog-progress") {
    const fp8moe::WatchScope outer("checkpoint I/O");
    for (int i = 0; i < 30; ++i) {
      const fp8moe::WatchScope inner("allreduce", "world");
      std::this_thread::sleep_for(100ms);
    }
    fp8moe::watch_step(1, "forward and backward");
    std::this_thread::sleep_for(600ms);
    fp8moe::watch_step_done("after");
  }
  return 0;
}
