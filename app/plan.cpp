// `fp8moe plan`: the command and its options, the loading of the config (also of each candidate
// layout), the search for a layout that fits, and run_plan, which plans the config on its layout
// and device (app/plan_roofline.cpp, app/plan_devices.cpp, app/plan_probe.cpp) and prints the
// report (app/plan_report.cpp) part by part.
#include "app/plan.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "app/cli_checks.h"
#include "app/exit_codes.h"
#include "app/plan_parts.h"
#include "io/config.h"

namespace fp8moe {
namespace plan_detail {
namespace {

struct Loaded {
  Config cfg;
  int world = 0;
  std::string error;
};

Loaded load(const PlanOptions& o, const std::string& text, const std::vector<std::string>& extra, int world) {
  Loaded l;
  std::vector<std::string> sets = o.overrides;
  sets.insert(sets.end(), extra.begin(), extra.end());
  try {
    const Config unchecked = load_config(ConfigSource{o.config_path, text, sets}, 0);
    l.world = world > 0 ? world : unchecked.parallel.tensor * unchecked.parallel.pipeline * unchecked.parallel.expert;
    l.cfg = load_config(ConfigSource{o.config_path, text, sets}, l.world);
  } catch (const ConfigError& e) {
    l.error = e.what();
  }
  return l;
}

// The nearest layouts that fit: changes of one key first, then of two; each candidate validated
// by load_config for the same world size, ranked by the number of keys changed, then step time.
std::vector<Candidate> search_fits(const PlanOptions& o, const std::string& text, const Config& base, int world,
                                   const Device& d, double eff, std::string* searched) {
  std::map<std::string, std::vector<std::string>> options;
  auto add = [&](const std::string& key, const std::string& value) { options[key].push_back(key + "=" + value); };
  for (int v = 1; v <= world && v <= base.model.n_layers; v *= 2)
    if (v != base.parallel.pipeline) add("parallel.pipeline", std::to_string(v));
  for (int v = 1; v <= world && v <= base.model.moe.n_experts; v *= 2)
    if (v != base.parallel.expert) add("parallel.expert", std::to_string(v));
  for (int v = 1; v <= o.node_size && v <= world; v *= 2)
    if (v != base.parallel.tensor) add("parallel.tensor", std::to_string(v));
  for (int v = base.parallel.micro_batches * 2; v <= base.train.global_batch; v *= 2) add("parallel.micro_batches", std::to_string(v));
  for (const char* v : {"selective", "moe", "full"})
    if (to_string(base.train.recompute) != v) add("train.recompute", v);
  if (base.train.moe_gates != GateSite::expert) add("train.moe_gates", "expert");
  if (base.optim.zero != 1) add("optim.zero", "1");
  if (base.train.moments_dtype != MomentsDtype::bf16) add("train.moments_dtype", "bf16");
  std::vector<std::string> keys;
  for (const auto& [k, v] : options) keys.push_back(k);
  {
    std::ostringstream s;
    for (const auto& [k, v] : options) {
      s << "  " << k << ":";
      for (const std::string& x : v) s << " " << x.substr(x.find('=') + 1);
      s << "\n";
    }
    *searched = s.str();
  }
  std::vector<Candidate> fits;
  auto consider = [&](std::vector<std::string> sets) {
    // A split given per stage does not fit another stage count: those candidates split by work.
    const bool pipeline = std::any_of(sets.begin(), sets.end(), [](const std::string& s) { return s.rfind("parallel.pipeline=", 0) == 0; });
    if (pipeline && base.parallel.stage_layers.split == StageSplit::given) sets.push_back("parallel.stage_layers=balanced");
    const Loaded l = load(o, text, sets, world);
    if (!l.error.empty()) return;
    const Plan p = make_plan(l.cfg, l.world, o.node_size);
    if (p.worst_total() > d.memory) return;
    fits.push_back({sets, p.worst_total(), roofline(p, d, o, eff).step});
  };
  for (const std::string& k : keys)
    for (const std::string& v : options[k]) consider({v});
  if (fits.empty())
    for (size_t i = 0; i < keys.size(); ++i)
      for (size_t j = i + 1; j < keys.size(); ++j)
        for (const std::string& a : options[keys[i]])
          for (const std::string& b : options[keys[j]]) consider({a, b});
  std::sort(fits.begin(), fits.end(), [](const Candidate& a, const Candidate& b) {
    return a.sets.size() != b.sets.size() ? a.sets.size() < b.sets.size() : a.step < b.step;
  });
  return fits;
}

// What run_plan plans: the config on its world, and the device.
struct Inputs {
  std::string text;    // the config file
  Loaded loaded;       // the config with --set, validated for its world size
  std::string device;  // a name of the device table
};

// Reads and validates the config (as `train` would, for the world size), the options and the
// device; kExitOk, or the status of the usage error it reported.
int read_inputs(const PlanOptions& o, Inputs* in) {
  try {
    in->text = read_config_file(o.config_path);
  } catch (const ConfigError& e) {
    return usage_error(e.what());
  }
  in->loaded = load(o, in->text, {}, o.world);
  if (!in->loaded.error.empty()) return usage_error(in->loaded.error);
  if (o.target_hours > 0 && o.tokens <= 0) return usage_error("--target-gpu-hours needs --tokens");
  in->device = device_name(o, in->loaded.cfg);
  if (!is_device(in->device)) return usage_error("--device " + in->device + ": expected " + kDeviceNames);
  return kExitOk;
}

}  // namespace
}  // namespace plan_detail

using namespace plan_detail;

CLI::App* add_plan_command(CLI::App& app, PlanOptions* o) {
  CLI::App* cmd = app.add_subcommand(
      "plan", "What CONFIG needs on a layout (parameters, FLOPs, memory per rank, communication, bubble, a roofline "
              "step time), without allocating the model");
  cmd->add_option("config", o->config_path, "YAML config file (see `fp8moe defaults`)")->required();
  cmd->add_option("--set", o->overrides, "Override one key: --set parallel.pipeline=4 (repeatable)")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_option("--world", o->world,
                  "World size (ranks) to validate and plan for (default: tensor x pipeline x expert, one data replica "
                  "per expert group)")
      ->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--device", o->device, "h100 | h200 | h800 | b200 | cpu (this machine, measured); default: cpu for "
                                         "runtime.device cpu or emulated, else h100")
      ->check(not_empty(std::string("a device: ") + kDeviceNames));
  cmd->add_option("--efficiency", o->efficiency,
                  "Fraction of the peak the GEMMs and attention reach (default 0.4 on a GPU; 1.0 of the rates measured "
                  "on the CPU)")
      ->check(finite_in(0, true, 1, false, "a fraction of the peak"));
  cmd->add_option("--node-size", o->node_size, "GPUs per node: groups within a node use NVLink (default 8)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_flag("--overlap", o->overlap,
                "Model all communication hidden behind compute where compute is longer (as DeepSeek-V3's DualPipe "
                "does); the default is fp8moe's own: exposed but for the gradient reduction behind the last "
                "backward and the expert exchanges behind each MoE layer's work");
  cmd->add_option("--higher-precision", o->higher_precision,
                  "The GEMMs not run in FP8: fp32 (what fp8moe runs: FP32, no TF32) or bf16 (a model of a BF16 engine)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  cmd->add_option("--tokens", o->tokens, "Print the device-hours to train this many tokens (e.g. 1e12)")
      ->check(finite_in(0, true, 1e24, false, "a number of tokens"));
  cmd->add_option("--target-gpu-hours", o->target_hours,
                  "With --tokens: solve for the efficiency that takes this many device-hours (e.g. 180000, DeepSeek-V3's "
                  "H800 GPU-hours per trillion tokens)")
      ->check(finite_in(0, true, 1e15, false, "device-hours"));
  cmd->add_flag("!--no-search", o->search, "Do not search for a layout that fits when a rank does not");
  cmd->add_flag("!--no-probe", o->probe,
                "cpu: do not train the probe models of the config's blocks (seconds); the step time then comes from the "
                "measured GEMM, attention and memory rates alone (about 2-4x optimistic for small configs)");
  cmd->add_option("--baseline-bytes", o->baseline_bytes,
                  "cpu: the process's resident memory besides its tensors and the libraries' heap (default: the 202 MB "
                  "measured here, see app/plan_devices.cpp)")
      ->check(finite_in(0, false, 1e15, false, "bytes"));
  return cmd;
}

int run_plan(const PlanOptions& o) {
  Inputs in;
  if (const int status = read_inputs(o, &in); status != kExitOk) return status;
  const Config& c = in.loaded.cfg;
  const int world = in.loaded.world;
  const Plan p = make_plan(c, world, o.node_size);
  const Device d = in.device == "cpu" ? cpu_device(c, p.L, o.probe) : gpu(in.device);
  const PlanReport rep = make_report(o, p, d, world);

  print_layout(rep);
  print_flops(rep);
  print_memory(rep);
  print_communication(rep);
  print_bubble(rep);
  print_step_time(rep);
  if (o.tokens > 0) print_tokens(rep);
  print_summary(rep);
  if (!d.cpu || c.model.d_model >= 1024) print_fp8_savings(c, world);
  if (p.worst_total() + rep.baseline > d.memory) {
    print_misfit(rep);
    if (o.search) {
      std::string searched;
      const std::vector<Candidate> fits = search_fits(o, in.text, c, world, d, rep.eff, &searched);
      print_fits(rep, fits, searched);
    }
  }
  return kExitOk;
}

}  // namespace fp8moe
