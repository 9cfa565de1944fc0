#include "io/hf_format.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "io/read_file.h"
#include "kernels/check.h"
#include "kernels/fp8.h"

namespace fp8moe {
namespace {

using Json = nlohmann::ordered_json;
namespace fs = std::filesystem;

// An architecture field of config.json: its name there, the fp8moe key it comes from (for
// messages), and its value for a model.
struct ArchField {
  const char* hf;
  const char* ours;
  Json (*value)(const ModelConfig&);
};

// The fields transformers' DeepseekV3Config and DeepSeek's own configs use for the architecture.
const ArchField kArchFields[] = {
    {"vocab_size", "model.vocab_size", [](const ModelConfig& m) { return Json(m.vocab_size); }},
    {"hidden_size", "model.d_model", [](const ModelConfig& m) { return Json(m.d_model); }},
    {"intermediate_size", "model.d_ff_dense", [](const ModelConfig& m) { return Json(m.d_ff_dense); }},
    {"moe_intermediate_size", "model.moe.d_expert", [](const ModelConfig& m) { return Json(m.moe.d_expert); }},
    {"num_hidden_layers", "model.n_layers", [](const ModelConfig& m) { return Json(m.n_layers); }},
    {"first_k_dense_replace", "model.first_dense_layers", [](const ModelConfig& m) { return Json(m.first_dense_layers); }},
    {"num_attention_heads", "model.n_heads", [](const ModelConfig& m) { return Json(m.n_heads); }},
    {"num_key_value_heads", "model.n_heads", [](const ModelConfig& m) { return Json(m.n_heads); }},
    {"n_shared_experts", "model.moe.n_shared_experts", [](const ModelConfig& m) { return Json(m.moe.n_shared_experts); }},
    {"n_routed_experts", "model.moe.n_experts", [](const ModelConfig& m) { return Json(m.moe.n_experts); }},
    {"num_experts_per_tok", "model.moe.top_k", [](const ModelConfig& m) { return Json(m.moe.top_k); }},
    {"n_group", "model.moe.n_group", [](const ModelConfig& m) { return Json(m.moe.n_group); }},
    {"topk_group", "model.moe.topk_group", [](const ModelConfig& m) { return Json(m.moe.topk_group); }},
    {"routed_scaling_factor", "model.moe.routed_scaling_factor",
     [](const ModelConfig& m) { return Json(m.moe.routed_scaling_factor); }},
    {"norm_topk_prob", "model.moe.norm_topk_prob", [](const ModelConfig& m) { return Json(m.moe.normalises_gates()); }},
    {"scoring_func", "model.moe.gating",
     [](const ModelConfig& m) { return Json(std::string(to_string(m.moe.gating))); }},
    {"q_lora_rank", "model.q_lora_rank",
     [](const ModelConfig& m) { return m.q_lora_rank > 0 ? Json(m.q_lora_rank) : Json(nullptr); }},
    {"kv_lora_rank", "model.kv_lora_rank", [](const ModelConfig& m) { return Json(m.kv_lora_rank); }},
    {"qk_nope_head_dim", "model.qk_nope_head_dim", [](const ModelConfig& m) { return Json(m.qk_nope_head_dim); }},
    {"qk_rope_head_dim", "model.qk_rope_head_dim", [](const ModelConfig& m) { return Json(m.qk_rope_head_dim); }},
    {"v_head_dim", "model.v_head_dim", [](const ModelConfig& m) { return Json(m.v_head_dim); }},
    {"rope_theta", "model.rope_theta", [](const ModelConfig& m) { return Json(m.rope_theta); }},
    {"rms_norm_eps", "model.norm_eps", [](const ModelConfig& m) { return Json(m.norm_eps); }},
    {"num_nextn_predict_layers", "model.mtp_depth", [](const ModelConfig& m) { return Json(m.mtp_depth); }},
    {"tie_word_embeddings", "(fp8moe's embedding and head are separate)", [](const ModelConfig&) { return Json(false); }},
    {"attention_bias", "(fp8moe's projections have no bias)", [](const ModelConfig&) { return Json(false); }},
};

bool same_value(const Json& a, const Json& b) {
  if (a.is_number() && b.is_number()) {
    const double x = a.get<double>(), y = b.get<double>();
    return x == y || std::fabs(x - y) <= 1e-12 * std::max(std::fabs(x), std::fabs(y));
  }
  // q_lora_rank: null and 0 both mean "no query latent".
  if ((a.is_null() && b.is_number()) || (a.is_number() && b.is_null()))
    return (a.is_null() ? b : a).get<double>() == 0;
  return a == b;
}

// Row order of a rotary part of d rows, fp8moe -> file: i -> 2i (i < d/2), i -> 2(i - d/2) + 1.
int64_t interleaved_row(int64_t i, int64_t d) { return i < d / 2 ? 2 * i : 2 * (i - d / 2) + 1; }

// "layers.3.attn.wq_a" -> the file's name of a block parameter (rest: after the block prefix).
std::string block_name(const std::string& rest) {
  static const std::map<std::string, std::string> fixed = {
      {"attn_norm.weight", "input_layernorm.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"},
      {"attn.wq_a", "self_attn.q_a_proj.weight"},
      {"attn.q_norm.weight", "self_attn.q_a_layernorm.weight"},
      {"attn.wq_b", "self_attn.q_b_proj.weight"},
      {"attn.wq", "self_attn.q_proj.weight"},
      {"attn.wkv_a", "self_attn.kv_a_proj_with_mqa.weight"},
      {"attn.kv_norm.weight", "self_attn.kv_a_layernorm.weight"},
      {"attn.wkv_b", "self_attn.kv_b_proj.weight"},
      {"attn.wo", "self_attn.o_proj.weight"},
      {"mlp.w1", "mlp.gate_proj.weight"},
      {"mlp.w3", "mlp.up_proj.weight"},
      {"mlp.w2", "mlp.down_proj.weight"},
      {"moe.router", "mlp.gate.weight"},
      {"moe.router_bias", "mlp.gate.e_score_correction_bias"},
      {"moe.shared.w1", "mlp.shared_experts.gate_proj.weight"},
      {"moe.shared.w3", "mlp.shared_experts.up_proj.weight"},
      {"moe.shared.w2", "mlp.shared_experts.down_proj.weight"},
  };
  if (const auto it = fixed.find(rest); it != fixed.end()) return it->second;
  // moe.experts.<e>.w1|w3|w2
  const std::string pre = "moe.experts.";
  if (rest.rfind(pre, 0) == 0) {
    const size_t dot = rest.find('.', pre.size());
    const std::string e = rest.substr(pre.size(), dot - pre.size()), w = rest.substr(dot + 1);
    const char* proj = w == "w1" ? "gate_proj" : w == "w3" ? "up_proj" : w == "w2" ? "down_proj" : nullptr;
    if (proj) return "mlp.experts." + e + "." + proj + ".weight";
  }
  throw HfFormatError("no DeepSeek-V3 name for parameter part " + rest);
}

// A JSON file of the directory (config.json, the index): regular, at most 64 MiB (a 671B model's
// index is about 9 MB), never waited on (io/read_file.h).
std::string read_text(const fs::path& p) {
  return read_whole_file<HfFormatError>(p.string(), "JSON file", uintmax_t(64) << 20);
}

float f16_decode(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31, e = (h >> 10) & 0x1f, f = h & 0x3ff;
  if (e == 0) return (sign ? -1.0f : 1.0f) * std::ldexp(float(f), -24);  // zero, subnormal
  if (e == 31) return bits_float(sign | 0x7f800000u | (f << 13));        // infinity, NaN
  return bits_float(sign | ((e + 112) << 23) | (f << 13));
}

// "[r, c]" (a 1-D tensor: "[c]") of element i of rows read from row r0 of a tensor of `shape`.
std::string index_text(const std::vector<int64_t>& shape, int64_t r0, int64_t cols, size_t i) {
  if (shape.size() != 2) return "[" + std::to_string(i) + "]";
  return "[" + std::to_string(r0 + int64_t(i) / cols) + ", " + std::to_string(int64_t(i) % cols) + "]";
}

// NOTE: decode(byte) * weight_scale_inv reaches 448 x the scale (E4M3's largest value): a scale
// must be finite and positive and that product finite (at most FLT_MAX / 448 = 7.6e35), or
// the weights it scales are not numbers. A scale of zero would zero its block: refused too.
constexpr float kE4m3Max = 448.0f;
size_t first_bad_scale(const std::vector<float>& s) {
  for (size_t i = 0; i < s.size(); ++i)
    if (!(s[i] > 0 && std::isfinite(s[i] * kE4m3Max))) return i;
  return s.size();
}

}  // namespace

size_t hf_first_nonfinite(const float* v, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(v[i])) return i;
  return n;
}

std::string hf_value_text(float x) {
  if (std::isnan(x)) return "NaN";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char s[32];
  std::snprintf(s, sizeof s, "%g", double(x));
  return s;
}

std::string hf_export_refusal(const ModelConfig& m) {
  if (!m.mla())
    return "model.attention is gqa: the architectures that Hugging Face's libraries share with fp8moe's MoE block "
           "(sigmoid routing with a selection bias, node-limited groups, shared experts, dense first layers) are "
           "DeepSeek-V3's, which has multi-head latent attention only; a GQA model of this MoE has no standard "
           "form (Mixtral and Qwen-MoE route by softmax without the bias, and Qwen-MoE gates its shared expert); "
           "only models with model.attention: mla have one";
  if (m.moe.gating != Gating::sigmoid)
    return "model.moe.gating is softmax: transformers' deepseek_v3 scores experts with a sigmoid only (its "
           "scoring_func is not read), so a softmax-gated model (DeepSeek-V2's) would give other logits there";
  if (m.moe.n_shared_experts == 0)
    return "model.moe.n_shared_experts is 0: DeepSeek-V3's layers always hold shared experts";
  if (m.first_dense_layers >= m.n_layers)
    return "model.first_dense_layers >= model.n_layers: a DeepSeek-V3 model has MoE layers";
  if (m.norm_eps != 1e-6)
    return "model.norm_eps is not 1e-6: DeepSeek's model.py and transformers' DeepseekV3 give the query and "
           "key-value latents' norms an epsilon of 1e-6 whatever rms_norm_eps says (vLLM uses rms_norm_eps), so "
           "only 1e-6 means the same model to all of them";
  return "";
}

std::string hf_config_json(const Config& cfg, const std::string& torch_dtype, bool fp8) {
  const ModelConfig& m = cfg.model;
  Json j;
  j["architectures"] = {"DeepseekV3ForCausalLM"};
  j["model_type"] = "deepseek_v3";
  for (const ArchField& f : kArchFields) j[f.hf] = f.value(m);
  j["hidden_act"] = "silu";
  j["topk_method"] = "noaux_tc";  // the selection bias (e_score_correction_bias), aux-loss-free balancing
  j["moe_layer_freq"] = 1;
  // fp8moe's rotary pairs are stored in DeepSeek's interleaved order (this file's header).
  j["rope_interleave"] = true;
  j["rope_scaling"] = nullptr;  // no YaRN: fp8moe trains with plain RoPE
  j["max_position_embeddings"] = cfg.train.seq_len;
  j["initializer_range"] = m.init_std;
  j["attention_dropout"] = 0.0;
  if (m.pad_id >= 0) j["pad_token_id"] = m.pad_id;
  // Byte-level models (fp8moe prepare-data) separate documents with byte 0, which generation
  // stops at; otherwise the tokenizer's ids are not known here (transformers' default would be 1).
  j["bos_token_id"] = m.vocab_size == 256 ? Json(0) : Json(nullptr);
  j["eos_token_id"] = m.vocab_size == 256 ? Json(0) : Json(nullptr);
  j["use_cache"] = true;
  j["torch_dtype"] = torch_dtype;
  if (fp8)
    j["quantization_config"] = {{"quant_method", "fp8"},
                                {"fmt", "e4m3"},
                                {"activation_scheme", "dynamic"},
                                {"weight_block_size", {kHfFp8Block, kHfFp8Block}}};
  return j.dump(2) + "\n";
}

namespace {

// A string field, or "" when absent; another type is an error.
std::string string_field(const Json& j, const char* key) {
  if (!j.contains(key) || j[key].is_null()) return "";
  if (!j[key].is_string()) throw HfFormatError(std::string("config.json: ") + key + " is not a string: " + j[key].dump());
  return j[key].get<std::string>();
}

std::vector<std::string> config_differences(const std::string& text, const ModelConfig& m) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    throw HfFormatError(std::string("config.json is not JSON: ") + e.what());
  }
  if (!j.is_object()) throw HfFormatError("config.json is not a JSON object");
  std::vector<std::string> out;
  const std::string type = string_field(j, "model_type");
  if (type != "deepseek_v3") out.push_back("model_type: config.json \"" + type + "\", fp8moe reads deepseek_v3");
  if (const std::string act = string_field(j, "hidden_act"); !act.empty() && act != "silu")
    out.push_back("hidden_act: config.json " + act + ", fp8moe's MLPs are SwiGLU (silu)");
  if (const std::string method = string_field(j, "topk_method"); !method.empty() && method != "noaux_tc")
    out.push_back("topk_method: config.json " + method + ", fp8moe routes with the selection bias (noaux_tc)");
  // rope_theta at the top (DeepSeek's files, transformers 4) or in rope_parameters (transformers 5).
  Json given_theta = j.contains("rope_theta") ? j["rope_theta"] : Json(nullptr);
  for (const char* key : {"rope_scaling", "rope_parameters"})
    if (j.contains(key) && j[key].is_object()) {
      const Json& r = j[key];
      std::string kind = string_field(r, "rope_type");
      if (kind.empty()) kind = string_field(r, "type");
      if (kind.empty()) kind = "default";
      if (kind != "default")
        out.push_back(std::string(key) + ": rope_type " + kind + "; fp8moe runs plain RoPE (no YaRN or other scaling)");
      if (given_theta.is_null() && r.contains("rope_theta")) given_theta = r["rope_theta"];
    }
  if (j.contains("rope_interleave") && j["rope_interleave"] != Json(true))
    out.push_back("rope_interleave: config.json false; fp8moe reads DeepSeek's interleaved rotary rows");
  for (const ArchField& f : kArchFields) {
    const Json want = f.value(m);
    Json got = std::string(f.hf) == "rope_theta" ? given_theta : j.contains(f.hf) ? j[f.hf] : Json(nullptr);
    // Fields that configs may leave out, at transformers' defaults.
    if (got.is_null() && std::string(f.hf) == "tie_word_embeddings") got = false;
    if (got.is_null() && std::string(f.hf) == "attention_bias") got = false;
    if (got.is_null() && std::string(f.hf) == "num_nextn_predict_layers") got = 0;
    if (std::string(f.hf) == "intermediate_size" && m.first_dense_layers == 0) continue;  // no dense layer reads it
    if (std::string(f.hf) == "num_key_value_heads") continue;  // MLA's heads are num_attention_heads
    if (std::string(f.hf) == "scoring_func" && got.is_null()) got = "sigmoid";  // transformers' only scoring
    if (!same_value(got, want))
      out.push_back(std::string(f.hf) + ": config.json " + (j.contains(f.hf) || !got.is_null() ? got.dump() : "absent") +
                    ", " + f.ours + " " + want.dump());
  }
  return out;
}

}  // namespace

std::vector<std::string> hf_config_differences(const std::string& text, const ModelConfig& m) {
  try {
    return config_differences(text, m);
  } catch (const Json::exception& e) {  // a field of the wrong JSON type
    throw HfFormatError(std::string("config.json: ") + e.what());
  }
}

HfTensor hf_tensor(const ModelConfig& m, const ParamSpec& p) {
  HfTensor t;
  const std::string& n = p.name;
  const bool vector = p.rows == 1 && (n.find("norm.weight") != std::string::npos || n.find("router_bias") != std::string::npos);
  t.shape = vector ? std::vector<int64_t>{p.cols} : std::vector<int64_t>{p.rows, p.cols};
  if (n == "embed.weight") t.name = "model.embed_tokens.weight";
  else if (n == "final_norm.weight") t.name = "model.norm.weight";
  else if (n == "head.weight") t.name = "lm_head.weight";
  else if (n.rfind("layers.", 0) == 0 || n.rfind("mtp.", 0) == 0) {
    const bool mtp = n[0] == 'm';
    const size_t a = n.find('.') + 1, b = n.find('.', a);
    const int index = std::stoi(n.substr(a, b - a));
    const std::string rest = n.substr(b + 1);
    const std::string layer = "model.layers." + std::to_string(mtp ? m.n_layers + index : index) + ".";
    static const std::map<std::string, std::string> mtp_own = {{"enorm.weight", "enorm.weight"},
                                                               {"hnorm.weight", "hnorm.weight"},
                                                               {"eh_proj", "eh_proj.weight"},
                                                               {"norm.weight", "shared_head.norm.weight"}};
    const auto own = mtp ? mtp_own.find(rest) : mtp_own.end();
    t.name = layer + (own != mtp_own.end() ? own->second : block_name(rest));
  } else {
    throw HfFormatError("no DeepSeek-V3 name for parameter " + n);
  }
  // The rows that produce rotary channels, to DeepSeek's interleaved order.
  const int64_t d = m.qk_rope_head_dim;
  const bool q = n.ends_with(".attn.wq") || n.ends_with(".attn.wq_b"), kv_a = n.ends_with(".attn.wkv_a");
  if (m.mla() && (q || kv_a)) {
    t.hf_row.resize(size_t(p.rows));
    for (int64_t r = 0; r < p.rows; ++r) t.hf_row[size_t(r)] = r;
    const int64_t qk = m.qk_head_dim();
    auto move_part = [&](int64_t first) {
      for (int64_t i = 0; i < d; ++i) t.hf_row[size_t(first + i)] = first + interleaved_row(i, d);
    };
    if (q)
      for (int64_t h = 0; h < m.n_heads; ++h) move_part(h * qk + m.qk_nope_head_dim);
    else
      move_part(m.kv_lora_rank);
  }
  return t;
}

std::vector<std::pair<std::string, std::string>> hf_copies(const ModelConfig& m) {
  std::vector<std::pair<std::string, std::string>> out;
  for (int k = 0; k < m.mtp_depth; ++k) {
    const std::string layer = "model.layers." + std::to_string(m.n_layers + k) + ".";
    out.emplace_back(layer + "embed_tokens.weight", "embed.weight");
    out.emplace_back(layer + "shared_head.head.weight", "head.weight");
  }
  return out;
}

bool hf_fp8_weight(const ParamSpec& p) {
  return p.linear != LinearClass::none;
}

// ---------------------------------------------------------------- reading a directory

HfDirectory::HfDirectory(const std::string& dir) : dir_(dir) {
  const fs::path root(dir);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) throw HfFormatError(dir + ": not a directory");
  if (!fs::exists(root / "config.json", ec)) throw HfFormatError(dir + ": no config.json");
  config_json_ = read_text(root / "config.json");
  // The FP8 form's weight blocks (DeepSeek-V3: 128 x 128).
  try {
    const Json j = Json::parse(config_json_);
    if (j.contains("quantization_config") && j["quantization_config"].contains("weight_block_size")) {
      const Json& b = j["quantization_config"]["weight_block_size"];
      if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
          b[0].get<int64_t>() <= 0 || b[1].get<int64_t>() <= 0)
        throw HfFormatError(dir + "/config.json: quantization_config.weight_block_size is not [rows, cols]");
      fp8_block_[0] = b[0].get<int64_t>(), fp8_block_[1] = b[1].get<int64_t>();
    }
  } catch (const Json::exception& e) {
    throw HfFormatError(dir + "/config.json: " + e.what());
  }
  std::vector<std::string> files;
  std::map<std::string, std::string> indexed;  // tensor -> file, from the index
  const fs::path index = root / "model.safetensors.index.json";
  if (fs::exists(index, ec)) {
    Json j;
    try {
      j = Json::parse(read_text(index));
    } catch (const Json::exception& e) {
      throw HfFormatError(index.string() + ": not JSON: " + e.what());
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw HfFormatError(index.string() + ": no weight_map object");
    std::set<std::string> seen;
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) throw HfFormatError(index.string() + ": weight_map[" + name + "] is not a file name");
      const std::string f = file.get<std::string>();
      if (f.find('/') != std::string::npos) throw HfFormatError(index.string() + ": " + f + " is not a file of the directory");
      indexed[name] = f;
      if (seen.insert(f).second) files.push_back(f);
    }
  } else {
    for (auto it = fs::directory_iterator(root, ec); !ec && it != fs::directory_iterator(); it.increment(ec))
      if (it->path().extension() == ".safetensors") files.push_back(it->path().filename().string());
    if (ec) throw HfFormatError(dir + ": cannot list: " + ec.message());
    std::sort(files.begin(), files.end());
  }
  if (files.empty()) throw HfFormatError(dir + ": no .safetensors files");
  for (const std::string& f : files) {
    files_.push_back(std::make_unique<SafetensorsFile>((root / f).string()));
    for (const SafeTensor& t : files_.back()->tensors())
      if (!where_.emplace(t.name, files_.back().get()).second)
        throw HfFormatError(dir + ": tensor " + t.name + " is in two files");
  }
  for (const auto& [name, f] : indexed) {
    const auto it = where_.find(name);
    if (it == where_.end() || fs::path(it->second->path()).filename() != f)
      throw HfFormatError(index.string() + ": names " + name + " in " + f + ", which does not hold it");
  }
}

bool HfDirectory::has(const std::string& name) const { return where_.count(name) > 0; }

std::vector<std::string> HfDirectory::names() const {
  std::vector<std::string> out;
  for (const auto& [n, f] : where_) out.push_back(n);
  return out;
}

std::vector<float> HfDirectory::read_f32(const std::string& name, const std::vector<int64_t>& shape) const {
  return read_f32_rows(name, shape, 0, shape.size() == 2 ? shape[0] : 1);
}

namespace {

// Rows [r0, r0 + n) of an F32, BF16 or F16 tensor into *out (sized for them).
void read_plain(const SafetensorsFile& f, const SafeTensor& t, const std::vector<int64_t>& shape, int64_t r0,
                int64_t n, std::vector<float>* out) {
  if (t.dtype != "F32" && t.dtype != "BF16" && t.dtype != "F16")
    throw HfFormatError(f.path() + ": tensor " + t.name + " is " + t.dtype + "; fp8moe reads F32, BF16, F16 and F8_E4M3");
  const std::vector<unsigned char> raw = shape.size() == 2 ? f.read_rows(t, r0, n) : f.read(t);
  if (t.dtype == "F32") {
    std::memcpy(out->data(), raw.data(), out->size() * 4);
    return;
  }
  for (size_t i = 0; i < out->size(); ++i) {
    uint16_t b;
    std::memcpy(&b, raw.data() + 2 * i, 2);
    (*out)[i] = t.dtype == "BF16" ? bf16_decode(b) : f16_decode(b);
  }
}

}  // namespace

std::vector<float> HfDirectory::read_f32_rows(const std::string& name, const std::vector<int64_t>& shape, int64_t r0,
                                              int64_t n) const {
  const auto it = where_.find(name);
  if (it == where_.end()) throw HfFormatError(dir_ + ": no tensor " + name);
  const SafetensorsFile& f = *it->second;
  const SafeTensor& t = *f.find(name);
  auto dims = [](const std::vector<int64_t>& s) {
    std::string out = "(";
    for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + ")";
  };
  if (t.shape != shape)
    throw HfFormatError(f.path() + ": tensor " + name + " has shape " + dims(t.shape) + ", the model needs " + dims(shape));
  const int64_t rows = shape.size() == 2 ? shape[0] : 1, cols = shape.size() == 2 ? shape[1] : t.numel();
  FP8MOE_ASSERT(0 <= r0 && 0 <= n && r0 + n <= rows, name, ": rows [", r0, ", ", r0 + n, ") of ", rows);
  std::vector<float> out(size_t(n * cols));
  if (t.dtype == "F8_E4M3") {
    // DeepSeek's FP8 form: E4M3 values times their block's weight_scale_inv.
    const std::string sname = name + "_scale_inv";
    if (shape.size() != 2 || !has(sname))
      throw HfFormatError(f.path() + ": tensor " + name + " is F8_E4M3 without a 2-D " + sname);
    const SafetensorsFile& sf = *where_.at(sname);
    const SafeTensor& st = *sf.find(sname);
    const int64_t by = fp8_block_[0], bx = fp8_block_[1];
    const std::vector<int64_t> grid = {(rows + by - 1) / by, (cols + bx - 1) / bx};
    if (st.shape != grid)
      throw HfFormatError(sf.path() + ": " + sname + " has shape " + dims(st.shape) + ", not the " +
                          std::to_string(by) + " x " + std::to_string(bx) + " block grid " + dims(grid) + " of a " +
                          dims(shape) + " weight (quantization_config.weight_block_size)");
    const std::vector<float> scale = read_f32(sname, st.shape);
    if (const size_t i = first_bad_scale(scale); i < scale.size())
      throw HfFormatError(sf.path() + ": tensor " + sname + " holds " + hf_value_text(scale[i]) + " at " +
                          index_text(st.shape, 0, grid[1], i) + ": a weight_scale_inv must be finite and positive, " +
                          "and its product with E4M3's largest value (448) finite (at most 7.6e35)");
    const std::vector<unsigned char> raw = f.read_rows(t, r0, n);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < cols; ++c)
        out[size_t(r * cols + c)] =
            fp8_decode(raw[size_t(r * cols + c)], Fp8Dtype::e4m3) * scale[size_t(((r0 + r) / by) * grid[1] + c / bx)];
  } else {
    read_plain(f, t, shape, r0, n, &out);
  }
  if (const size_t i = hf_first_nonfinite(out.data(), out.size()); i < out.size())
    throw HfFormatError(f.path() + ": tensor " + name + " holds " + hf_value_text(out[i]) + " at " +
                        index_text(shape, r0, cols, i) + ": fp8moe imports finite weights only");
  return out;
}

std::vector<float> hf_read_param(const HfDirectory& d, const ModelConfig& m, const ParamSpec& p, const Shard& s) {
  const HfTensor t = hf_tensor(m, p);
  // The file's rows that hold the shard's rows (the same rows but for the RoPE order, which stays
  // inside a head, and heads are not split by a shard): one read of that range.
  auto file_row = [&](int64_t r) { return t.hf_row.empty() ? r : t.hf_row[size_t(r)]; };
  int64_t lo = file_row(s.r0), hi = lo;
  for (int64_t r = s.r0; r < s.r0 + s.rows; ++r) lo = std::min(lo, file_row(r)), hi = std::max(hi, file_row(r));
  const std::vector<float> v = d.read_f32_rows(t.name, t.shape, lo, hi - lo + 1);
  std::vector<float> out(size_t(s.numel()));
  for (int64_t r = 0; r < s.rows; ++r)
    std::copy_n(v.data() + (file_row(s.r0 + r) - lo) * p.cols + s.c0, s.cols, out.data() + r * s.cols);
  return out;
}

}  // namespace fp8moe
