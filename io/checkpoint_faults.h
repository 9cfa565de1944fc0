// The fault points of a checkpoint save, where the tests kill, freeze or starve it
// (io/checkpoint.h), of an export (app/hf_output.h), and of an overlapped collective's wait.
//
// Compiled in two forms (io/CMakeLists.txt): in the product (`fp8moe`, and every other program
// linking fp8moe_io) a FaultPoint does nothing and nothing reads the variables below; in
// `fp8moe-faults`, the tests' build of the same program, io/checkpoint_faults.cpp is compiled with
// FP8MOE_TEST_FAULTS and reads them:
//   FP8MOE_CKPT_KILL=RANK:K   on rank RANK, the K-th hit() sends SIGKILL to this process.
//   FP8MOE_CKPT_STOP=RANK:K   the same with SIGSTOP: a rank frozen in the middle of a save.
//   FP8MOE_CKPT_FILL=RANK:P   on rank RANK, when the save reaches point P (fill_at(P): first-dataset,
//                             middle, before-close, before-latest), fills the file system of the
//                             checkpoint directory, as another job writing there would. Only on a
//                             tmpfs; elsewhere it refuses with a warning.
//   FP8MOE_EXPORT_KILL=POINT  an export sends itself SIGKILL at POINT (export_fault_point);
//   FP8MOE_EXPORT_STOP=POINT  SIGSTOP;
//   FP8MOE_EXPORT_NO_EXCHANGE=1  an export replaces its directory as where the file system has no
//                             RENAME_EXCHANGE (two renames).
//   FP8MOE_WAIT_STOP=RANK:K   rank RANK (MPI_COMM_WORLD's) sends itself SIGSTOP before its K-th
//                             wait for an overlapped collective (parallel/watchdog.h
//                             wait_fault_point): a rank frozen inside the gradients' reduction.
#pragma once

#include <string>

namespace fp8moe::ckpt {

class FaultPoint {
 public:
  FaultPoint(int rank, std::string dir);
  void hit();
  void fill_at(const char* point);

 private:
  long long k_ = -1, count_ = 0;
  int signal_ = 0;
  std::string fill_point_, dir_;
};

}  // namespace fp8moe::ckpt

namespace fp8moe {

// An export's fault point POINT (app/hf_output.h names them): nothing in the product.
void export_fault_point(const char* point);
// Whether an export must do without RENAME_EXCHANGE: false in the product.
bool export_without_exchange();

}  // namespace fp8moe
