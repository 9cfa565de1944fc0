// Where `fp8moe export` and `fp8moe import` write, checked before they write anything: a path that
// cannot be a directory of theirs is a usage error (exit 2) naming it, never a failure half-way.
#pragma once

#include <stdexcept>
#include <string>

namespace fp8moe {

// A directory export or import cannot use: the message names it and why (exit 2).
struct OutputRefused : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Why directory `path` (existing or to be created) cannot be written: it is not a directory, its
// nearest existing ancestor is not one, or that ancestor is not writable (a read-only file system,
// permissions). "" when it can.
std::string unwritable_reason(const std::string& path);

// Why import may not write a checkpoint into `dir`: unwritable (above), or it already holds
// checkpoints (entries named step_* or latest*, which are listed). "" when it may: absent, empty, or
// holding other files only.
std::string import_destination_refusal(const std::string& dir);

}  // namespace fp8moe
