#include "io/metrics.h"

#include <cmath>
#include <filesystem>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace fp8moe {

namespace {
nlohmann::ordered_json number(double v) { return std::isfinite(v) ? nlohmann::ordered_json(v) : nullptr; }
}  // namespace

std::string metrics_json(const StepMetrics& m) {
  nlohmann::ordered_json j;  // insertion order: the order of the keys in the file
  j["step"] = m.step;
  j["loss"] = number(m.loss);
  j["val_loss"] = number(m.val_loss);
  j["mtp_loss"] = number(m.mtp_loss);
  j["lr"] = number(m.lr);
  j["grad_norm"] = number(m.grad_norm);
  j["tokens_per_s"] = number(m.tokens_per_s);
  j["step_time_s"] = number(m.step_time_s);
  j["mfu"] = number(m.mfu);
  j["peak_mem_bytes"] = m.peak_mem_bytes;
  j["peak_device_mem_bytes"] = m.peak_device_mem_bytes ? nlohmann::ordered_json(*m.peak_device_mem_bytes) : nullptr;
  j["expert_load_imbalance"] = number(m.expert_load_imbalance);
  j["fp8_saturated"] = m.fp8_saturated;
  j["fp8_underflowed"] = m.fp8_underflowed;
  j["skipped_steps"] = m.skipped_steps;
  j["loss_scale"] = number(m.loss_scale);
  j["pipeline_bubble"] = number(m.pipeline_bubble);
  j["pipeline_bubble_ideal"] = number(m.pipeline_bubble_ideal);
  j["host_syncs"] = m.host_syncs;
  j["h2d_bytes"] = m.h2d_bytes;
  j["d2h_bytes"] = m.d2h_bytes;
  j["comm_exposed_s"] = number(m.comm_exposed_s);
  return j.dump();
}

MetricsLog::MetricsLog(const std::string& path) : path_(path) {
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  out_.open(path, std::ios::app);
  if (!out_) throw std::runtime_error("log.jsonl: cannot write " + path);
}

bool MetricsLog::restart() {
  if (!out_.is_open()) return true;
  out_.close();
  out_.open(path_, std::ios::trunc);
  return out_.is_open();
}

void MetricsLog::write(const StepMetrics& m) {
  if (!out_.is_open()) return;
  out_ << metrics_json(m) << '\n';
  out_.flush();
}

}  // namespace fp8moe
