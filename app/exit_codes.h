// Exit statuses of fp8moe (documented in the README and in --help).
#pragma once

namespace fp8moe {
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;  // an internal error (fatal check, MPI_Abort)
constexpr int kExitUsage = 2;    // bad command line, config, file or world size: nothing was run
}  // namespace fp8moe
