#include "parallel/self_communicator.h"

#include <cstdlib>

#include "kernels/check.h"

namespace fp8moe {

void SelfCommunicator::alltoall(const int64_t* send, int64_t* recv, int64_t n) {
  if (recv != send && n > 0) be_.copy(recv, send, size_t(n) * sizeof(int64_t));
}

void SelfCommunicator::copy(float* out, const float* in, int64_t n) {
  if (out != in && n > 0) be_.copy(out, in, size_t(n) * sizeof(float));
}

void SelfCommunicator::no_peer(int peer) {
  FP8MOE_ASSERT(false, "a group of one rank has no peer ", peer, " to send to or receive from");
  std::abort();
}

}  // namespace fp8moe
