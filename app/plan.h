// `fp8moe plan CONFIG`: what a config and layout need and take, without allocating the model
// (parameters, FLOPs, memory per rank, communication, bubble, a roofline step time for a named
// device). The numbers come from model/plan_model.h; this file adds the devices, the roofline,
// the search for a layout that fits and the report.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

namespace fp8moe {

struct PlanOptions {
  std::string config_path;
  std::vector<std::string> overrides;
  int world = 0;              // 0: the config's model-parallel size (tensor x pipeline x expert), data 1
  std::string device;         // h100 | h200 | h800 | b200 | cpu; empty: cpu for runtime.device cpu or
                              // emulated, else h100
  double efficiency = 0;      // of the peak, for GEMMs and attention; 0: 0.4 on a GPU, 1 on the CPU
                              // (whose step is measured on probe models of the config's blocks)
  int node_size = 8;          // GPUs per node: a group within one node talks over NVLink
  bool overlap = false;       // communication hidden behind compute (DualPipe-like), else exposed
  std::string higher_precision = "fp32";  // the GEMMs not in FP8: fp32 (what fp8moe runs) or bf16
  double tokens = 0;          // > 0: GPU-hours (device-hours) to train this many tokens
  double target_hours = 0;    // with tokens: solve for the efficiency that takes this many hours, with
                              // fp8moe's communication exposed, overlapped, and compute only
  bool search = true;         // when a rank does not fit: look for the nearest layout that does
  bool probe = true;          // cpu: time probe models of the config's blocks (else the roofline of the rates)
  double baseline_bytes = -1; // cpu: the process's own resident memory (< 0: the measured constant)
};

// Registers the `plan` subcommand and its options on `app`, filling *o when parsed.
CLI::App* add_plan_command(CLI::App& app, PlanOptions* o);
// Prints the plan; returns the exit status (2 for a bad config or world size).
int run_plan(const PlanOptions& o);

}  // namespace fp8moe
