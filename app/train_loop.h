// The training loop on one rank: data -> micro-batches -> forward/backward -> AdamW -> router
// bias update, with evaluation and a metrics line (stdout) plus JSONL record per logged step.
#pragma once

#include "model/config.h"

namespace fp8moe {

// Called with a one-rank layout (the caller refuses others). Returns the process exit status
// (2 with a message on stderr for bad data files or paths).
int train_one_rank(const Config& cfg);

}  // namespace fp8moe
