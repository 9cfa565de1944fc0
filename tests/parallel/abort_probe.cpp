// Run under mpirun by test_mpi_abort: rank 1 makes an MPI call fail (a send to a rank that does
// not exist) while rank 0 waits in a barrier that can never complete. MPI_CHECK must print the
// decoded error with rank and host and MPI_Abort the whole job, so nobody hangs.
#include <mpi.h>

#include "kernels/check.h"
#include "parallel/mpi_session.h"

int main(int argc, char** argv) {
  fp8moe::MpiSession mpi(&argc, &argv);
  if (mpi.rank() == 1) {
    int value = 42;
    MPI_CHECK(MPI_Send(&value, 1, MPI_INT, mpi.size() + 10, 0, MPI_COMM_WORLD));
  } else {
    MPI_Barrier(MPI_COMM_WORLD);
  }
  return 0;
}
