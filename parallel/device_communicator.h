// Communicators on a backend's memory: the activations, gradients and parameters the model
// computes on (parallel/communicator.h's interface; every pointer is memory of `be`).
//
//   cpu backend               the MPI communicator itself (host memory is the backend's memory)
//   emulated, nccl            the emulated device's own collectives: MPI on the host memory behind
//                             the device tags, in the order of the ops (the emulated device runs
//                             its ops synchronously), with no staging and no host synchronisation
//                             (what NCCL does on a GPU)
//   emulated or cuda, mpi     staged: each call copies its data to pinned host memory, waits for
//                             the copy (one counted host synchronisation per call), runs MPI there
//                             and copies the result back. Several ranks may share one GPU this way
//                             (NCCL refuses that): the layout tests on a one-GPU machine.
//   cuda, nccl                NCCL on device memory (parallel/nccl_communicator.h)
#pragma once

#include <mpi.h>

#include <memory>

#include "kernels/backend.h"
#include "parallel/communicator.h"

namespace fp8moe {

// Collective over `comm` (not owned; it must outlive the communicator). `name` (static) names the
// group in the watchdog's report. For the cpu backend use the MPI communicator directly.
std::unique_ptr<Communicator> make_device_communicator(MPI_Comm comm, Backend& be, bool nccl, const char* name);

}  // namespace fp8moe
