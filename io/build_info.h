// Versions of the libraries io/ uses (for `fp8moe --version`).
#pragma once

#include <string>

namespace fp8moe {
// "  HDF5: ...\n  yaml-cpp: ...\n"
std::string io_build_info();
}  // namespace fp8moe
