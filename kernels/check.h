// The one family of fatal-error checks: FP8MOE_ASSERT, CUDA_CHECK, CUBLAS_CHECK, NCCL_CHECK,
// MPI_CHECK, H5_CHECK.
//
// Every check prints "fp8moe: fatal: rank R on HOST: file:line: <what failed>: <decoded error>"
// and then ends the whole job with exit status 1: once parallel/ has started MPI it installs an
// abort hook that calls MPI_Abort (so no rank is left blocked in a collective); before that (or
// after MPI_Finalize) the process exits with _Exit(1).
//
// NOTE: this header lives in kernels/ (the bottom of the dependency graph) so that every folder
// can use it, and it includes no library headers itself. Each macro decodes its error with the
// library's own function at the place it is expanded, where that library's header is included
// anyway; kernels/ therefore still never needs MPI or HDF5.
//
// These are for internal errors (a failed library call, a broken invariant). User errors (config,
// paths, world size) are reported by io/ and app/ with exit status 2, never through these.
#pragma once

#include <sstream>
#include <string>

namespace fp8moe {

// Prints the fatal message with rank and host and ends the job. Never returns.
[[noreturn]] void fatal_error(const char* file, int line, const std::string& what);

// Installed by parallel/ once MPI is up: the rank to print and the function that ends the job.
using AbortHook = void (*)(int exit_code);
void set_fatal_context(int rank, AbortHook hook);

namespace detail {
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}
}  // namespace detail
}  // namespace fp8moe

// FP8MOE_ASSERT(cond, "message", values...): a broken invariant.
#define FP8MOE_ASSERT(cond, ...)                                                                 \
  do {                                                                                           \
    if (!(cond)) [[unlikely]]                                                                    \
      ::fp8moe::fatal_error(__FILE__, __LINE__,                                                  \
                            ::fp8moe::detail::concat("assertion `" #cond "` failed: ", __VA_ARGS__)); \
  } while (0)

#define CUDA_CHECK(call)                                                                         \
  do {                                                                                           \
    const cudaError_t fp8moe_err_ = (call);                                                      \
    if (fp8moe_err_ != cudaSuccess) [[unlikely]]                                                 \
      ::fp8moe::fatal_error(__FILE__, __LINE__,                                                  \
                            ::fp8moe::detail::concat(#call, ": CUDA error ",                     \
                                                     cudaGetErrorName(fp8moe_err_), ": ",        \
                                                     cudaGetErrorString(fp8moe_err_)));          \
  } while (0)

#define CUBLAS_CHECK(call)                                                                       \
  do {                                                                                           \
    const cublasStatus_t fp8moe_st_ = (call);                                                    \
    if (fp8moe_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                        \
      ::fp8moe::fatal_error(__FILE__, __LINE__,                                                  \
                            ::fp8moe::detail::concat(#call, ": cuBLAS error ",                   \
                                                     cublasLtGetStatusName(fp8moe_st_), ": ",    \
                                                     cublasLtGetStatusString(fp8moe_st_)));      \
  } while (0)

#define NCCL_CHECK(call)                                                                         \
  do {                                                                                           \
    const ncclResult_t fp8moe_nr_ = (call);                                                      \
    if (fp8moe_nr_ != ncclSuccess) [[unlikely]]                                                  \
      ::fp8moe::fatal_error(__FILE__, __LINE__,                                                  \
                            ::fp8moe::detail::concat(#call, ": NCCL error ",                     \
                                                     ncclGetErrorString(fp8moe_nr_), " (",       \
                                                     ncclGetLastError(nullptr), ")"));           \
  } while (0)

// Needs MPI_ERRORS_RETURN on the communicator (parallel/ sets it on MPI_COMM_WORLD, and derived
// communicators inherit it); with MPI's default handler MPI aborts before we can decode.
#define MPI_CHECK(call)                                                                          \
  do {                                                                                           \
    const int fp8moe_mr_ = (call);                                                               \
    if (fp8moe_mr_ != MPI_SUCCESS) [[unlikely]] {                                                \
      char fp8moe_msg_[MPI_MAX_ERROR_STRING];                                                    \
      int fp8moe_len_ = 0;                                                                       \
      MPI_Error_string(fp8moe_mr_, fp8moe_msg_, &fp8moe_len_);                                   \
      ::fp8moe::fatal_error(__FILE__, __LINE__,                                                  \
                            ::fp8moe::detail::concat(#call, ": MPI error ", fp8moe_mr_, ": ",    \
                                                     std::string(fp8moe_msg_, fp8moe_len_)));    \
    }                                                                                            \
  } while (0)

// HDF5 reports failure as a negative herr_t/hid_t; its error stack is printed before we abort.
#define H5_CHECK(call)                                                                           \
  ([&]() {                                                                                       \
    const auto fp8moe_h5_ = (call);                                                              \
    if (fp8moe_h5_ < 0) [[unlikely]] {                                                           \
      H5Eprint2(H5E_DEFAULT, stderr);                                                            \
      ::fp8moe::fatal_error(__FILE__, __LINE__,                                                  \
                            ::fp8moe::detail::concat(#call, ": HDF5 call failed (returned ",     \
                                                     static_cast<long long>(fp8moe_h5_),         \
                                                     "; error stack above)"));                   \
    }                                                                                            \
    return fp8moe_h5_;                                                                           \
  }())
