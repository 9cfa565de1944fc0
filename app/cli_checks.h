// Checks of the numbers the command line's options take, as CLI11 validators: a value given must be
// finite and inside its interval (no NaN, no infinity, no 0 standing for "unset": an option not
// given keeps its default). A violation is CLI11's ValidationError, which app/main.cpp prints as
// fp8moe's one line "fp8moe: error: --OPTION: expected ..., got ..." with exit 2.
#pragma once

#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace fp8moe {

// A real number x with lo < x (lo_open) or lo <= x, and x < hi (hi_open) or x <= hi; `what` says
// what it counts ("a fraction of the peak", "tokens").
inline CLI::Validator finite_in(double lo, bool lo_open, double hi, bool hi_open, const std::string& what) {
  auto text = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", v);
    return std::string(b);
  };
  const std::string range = std::string(lo_open ? "(" : "[") + text(lo) + ", " + text(hi) + (hi_open ? ")" : "]");
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        const std::string expected = "expected " + what + ", a finite number in " + range + ", got '" + s + "'";
        char* end = nullptr;
        errno = 0;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || end == s.c_str() || *end != '\0' || errno == ERANGE || !std::isfinite(v)) return expected;
        if (lo_open ? !(v > lo) : !(v >= lo)) return expected;
        if (hi_open ? !(v < hi) : !(v <= hi)) return expected;
        return "";
      },
      range, "finite number");
}

// A value that must not be empty (a name).
inline CLI::Validator not_empty(const std::string& what) {
  return CLI::Validator([=](std::string& s) -> std::string { return s.empty() ? "expected " + what + ", got ''" : ""; },
                        "", "not empty");
}

}  // namespace fp8moe
