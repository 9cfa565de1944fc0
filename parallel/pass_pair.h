// Two passes of the model (a forward of one micro-batch and the backward of another) run as one
// pipeline op, interleaved at their expert exchanges so that each exchange travels while the
// other pass computes (DualPipe's F&B; Megatron-Core's --overlap-moe-expert-parallel-comm). The
// passes are plain code on two threads, of which one runs at a time: a pass runs until it reaches
// yield_point() (model/moe.cpp calls it after posting an exchange and before waiting for it), then
// the other pass runs to its own yield point, and so on; once one pass has ended the other runs
// to its end. The switches are at the same points on every run and every rank, so a pair computes
// the same bits as the two passes one after the other, and the ranks of a group post their
// collectives in the same order (every rank of a stage runs the same pairs). MPI must provide
// MPI_THREAD_SERIALIZED at least (parallel/mpi_session.h).
#pragma once

#include <functional>

namespace fp8moe {

class PassPair {
 public:
  // Runs `first` on this thread and `second` on a new one (which calls enter_thread first, e.g.
  // making the rank's GPU current), `first` starting. Returns once both have ended; the first
  // exception either threw is rethrown then.
  static void run(const std::function<void()>& first, const std::function<void()>& second,
                  const std::function<void()>& enter_thread = {});
  // Inside a pass of run(): hands over to the other pass unless it has ended, and returns when it
  // is this pass's turn again. Elsewhere: nothing.
  static void yield_point();
  // Whether the calling code runs inside a pass of run() (its exchanges are worth posting).
  static bool active();
};

}  // namespace fp8moe
