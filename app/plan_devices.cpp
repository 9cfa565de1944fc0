// The devices of `fp8moe plan`: the GPUs' datasheet peaks, the CPU's resident memory besides its
// tensors (measured once, below), and the lookup of --device. This CPU's rates and step are
// measured when the plan runs (app/plan_probe.cpp).
#include "app/plan_parts.h"

#include <string>

namespace fp8moe::plan_detail {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

}  // namespace

const char* const kDeviceNames = "h100, h200, h800, b200 or cpu";

std::string device_name(const PlanOptions& o, const Config& c) {
  if (!o.device.empty()) return o.device;
  return c.runtime.device == DeviceChoice::cpu || c.runtime.device == DeviceChoice::emulated ? "cpu" : "h100";
}

bool is_device(const std::string& name) {
  return name == "cpu" || name == "h100" || name == "h200" || name == "h800" || name == "b200";
}

// GPUs: dense (no sparsity) tensor-core peaks of the SXM parts.
// Sources: NVIDIA H100 datasheet (H100 SXM: FP8 1,979 TFLOPS, BF16 989, FP32 67, 80 GB HBM3 at
// 3.35 TB/s, NVLink 900 GB/s bidirectional); H200 datasheet (the same compute, 141 GB HBM3e at
// 4.8 TB/s); H800 SXM: the H100's compute and memory with NVLink cut to 400 GB/s bidirectional,
// of which DeepSeek-V3's report (arXiv 2412.19437, section 3.2) measures 160 GB/s per GPU, and
// 50 GB/s of InfiniBand per GPU; B200 (DGX B200 datasheet / Blackwell architecture brief: FP8
// 4.5 PFLOPS dense, BF16 2.25, FP32 75 TFLOPS, 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s
// bidirectional). InfiniBand: one 400 Gb/s NDR port per GPU (50 GB/s), B200 one 800 Gb/s
// ConnectX-8 port (100 GB/s). Capacities in GiB: what a process can hold, not the marketing GB
// (an H100 80GB reports 81,559 MiB; the H200 lent to this project reports about 139 GiB free).
Device gpu(const std::string& name) {
  Device d;
  d.name = name;
  if (name == "h100" || name == "h800" || name == "h200") {
    d.fp8 = 1979e12, d.bf16 = 989e12, d.fp32 = 66.9e12;
    d.memory = name == "h200" ? 139 * kGiB : 79.6 * kGiB;
    d.hbm = name == "h200" ? 4.8e12 : 3.35e12;
    d.nvlink = name == "h800" ? 160e9 : 450e9;
    d.ib = 50e9;
  } else if (name == "b200") {
    d.fp8 = 4.5e15, d.bf16 = 2.25e15, d.fp32 = 75e12;
    d.memory = 180e9, d.hbm = 8e12, d.nvlink = 900e9, d.ib = 100e9;
  }
  d.attention = d.bf16;
  d.basis = "datasheet dense peaks (see app/plan_devices.cpp)";
  return d;
}

// The resident memory of an `fp8moe train` process besides the backend's tensors, in two measured
// parts (measured, not derived; this repository's 2-core development machine, AMD EPYC, Debian 12,
// Open MPI 4.1.4, OpenBLAS 0.3.21, oneDNN 2.6 (libdnnl.so.2.6), the CUDA release build, 2 OpenMP
// threads):
// - the process: bench/plan-vs-measured.sh's `minimal` run (45K parameters, its tensors < 1 MB)
//   peaks at 201-203 MB of RSS (the log's mem, OMP_NUM_THREADS 1, 2 and 4). Of it, by
//   /proc/PID/smaps: 84 MB of anonymous memory that OpenBLAS's GEMM buffers fill (the 1024^3
//   SGEMM app/step_report.cpp times at start-up), ~60 MB of libcublasLt's pages (linked by the
//   CUDA build even on the CPU), the other libraries' pages, a 7 MB heap; ru_maxrss also keeps the
//   12.6 MB of that SGEMM's operands. A CPU-only build has no libcublasLt (--baseline-bytes).
//   Since 2026-12-05 the SGEMMs are oneDNN's (no OpenBLAS): the same run peaks at 203 MB (1
//   thread) and 210 MB (2 threads) on an Intel Xeon (Emerald Rapids) VM; not broken down again;
// - the libraries' heap beside the tensors: heaptrack over tiny.yaml on one rank (10 steps) peaks
//   at 221.8 MB of heap, of which 171.8 MB are the backend's tensors (HostBackend::allocate) and
//   50.0 MB the rest: 38.2 MB oneDNN's (its primitives' scratchpads and JIT code), the CPU FP8
//   GEMM's thread-local BF16 operand copies (kernels/cpu/gemm_fp8.cpp), the host copies of losses
//   and loads. The ~200M-parameter bench config run with glibc's retention off (see below) leaves
//   52 MB beside its tensors and the process baseline: the same 50 MB within 2 MB.
// Not modelled: the freed tensor memory glibc's heap keeps resident. Its dynamic mmap threshold
// rises to 32 MB after the first large free, so every later tensor below that comes from the
// heap, which returns pages only at its top: the peak RSS grows for 10-15 steps and then stays
// 1.4-1.8x the modelled figure (bench/plan-vs-measured.sh's RSS column; with
// MALLOC_MMAP_THRESHOLD_=262144 it stays 1.00-1.21x, the RSS/thr column).
const double kCpuProcessBaseline = 202e6;
const double kCpuLibraryHeap = 50e6;

}  // namespace fp8moe::plan_detail
