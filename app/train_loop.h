// The training loop on one rank: data -> micro-batches -> forward/backward -> AdamW -> router
// bias update, with evaluation and a metrics line (stdout) plus JSONL record per logged step.
#pragma once

#include "model/config.h"

namespace fp8moe {

// Returns the process exit status (2 with a message on stderr for what this build cannot do yet
// or bad data files).
int train_one_rank(const Config& cfg, int world_size);

}  // namespace fp8moe
