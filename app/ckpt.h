// `fp8moe ckpt inspect DIR` and `fp8moe ckpt verify DIR`: read a checkpoint without training
// (serially, no MPI launch needed). DIR is a step directory or a checkpoint.dir (its `latest`).
#pragma once

#include <string>

namespace fp8moe {

// inspect: step, tokens, config summary, every dataset with its global shape, size and checksum
// status; exit 0 when the checkpoint is valid, 1 when not. verify: recomputes every checksum and
// checks the datasets against the stored config, prints what is wrong; exit 0 (valid) or 1.
int run_ckpt_inspect(const std::string& dir);
int run_ckpt_verify(const std::string& dir);

}  // namespace fp8moe
