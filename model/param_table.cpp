#include "model/param_table.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <string_view>

#include "kernels/check.h"

namespace fp8moe {

const ParamSpec& ParamTable::at(const std::string& name) const {
  const int64_t i = index_of(name);
  FP8MOE_ASSERT(i >= 0, "no parameter named ", name);
  return params[size_t(i)];
}

int64_t ParamTable::index_of(const std::string& name) const {
  FP8MOE_ASSERT(index_.size() == params.size(), "ParamTable: ", params.size(), " entries but ", index_.size(),
                " indexed: call reindex() after changing the table");
  const auto it = index_.find(name);
  return it == index_.end() ? -1 : it->second;
}

void ParamTable::reindex() {
  index_.clear();
  index_.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i)
    FP8MOE_ASSERT(index_.emplace(params[i].name, int64_t(i)).second, "ParamTable: two entries named ", params[i].name);
}

int64_t ParamTable::trainable_numel() const {
  int64_t n = 0;
  for (const ParamSpec& p : params) n += p.trainable ? p.numel() : 0;
  return n;
}

void init_shard(const ParamSpec& p, uint64_t seed, const Shard& s, float* out) {
  if (s.cols == p.cols) {
    init_param_slice(p, seed, s.r0 * p.cols, (s.r0 + s.rows) * p.cols, out);
    return;
  }
  for (int64_t r = 0; r < s.rows; ++r)
    init_param_slice(p, seed, (s.r0 + r) * p.cols + s.c0, (s.r0 + r) * p.cols + s.c0 + s.cols, out + r * s.cols);
}

std::string block_prefix(const ModelConfig& m, int l) {
  return l < m.n_layers ? "layers." + std::to_string(l) + "." : "mtp." + std::to_string(l - m.n_layers) + ".";
}

ParamTable build_param_table(const ModelConfig& m) {
  ParamTable t;
  const float std = float(m.init_std);
  // NOTE: output projections (o, w2) start smaller, std / sqrt(2 n_layers), so that the residual
  // stream's variance does not grow with depth (GPT-2, Megatron's scaled init).
  const float out_std = float(m.init_std / std::sqrt(2.0 * m.n_layers));
  auto add = [&](ParamSpec p) { t.params.push_back(std::move(p)); };
  auto norm = [&](const std::string& name, int layer, int64_t size = 0) {
    add({name, 1, size > 0 ? size : m.d_model, TpSplit::none, layer, -1, LinearClass::none, true, false,
         InitKind::ones, 0.0f});
  };
  auto linear = [&](const std::string& name, int64_t out, int64_t in, TpSplit tp, int layer, int expert,
                    LinearClass cls, float s) {
    add({name, out, in, tp, layer, expert, cls, true, true, InitKind::normal, s});
  };

  const int64_t q_dim = int64_t(m.n_heads) * m.head_dim, kv_dim = int64_t(m.n_kv_heads) * m.head_dim;
  add({"embed.weight", m.vocab_size, m.d_model, TpSplit::rows, -1, -1, LinearClass::none, true, true, InitKind::normal, std});
  // One block (l: its index in placement terms; the multi-token prediction modules' blocks count on
  // from n_layers and are MoE blocks).
  auto block = [&](const std::string& p, int l) {
    norm(p + "attn_norm.weight", l);
    if (m.mla()) {
      // Multi-head latent attention (DeepSeek-V3's names, model.py): the down-projections and the
      // latents' norms replicated over tensor parallelism, the up-projections split by heads
      // (each head's rows together: [nope | rope] of a query, [nope | v] of a key-value head).
      const int64_t H = m.n_heads, qk = m.qk_head_dim(), nope = m.qk_nope_head_dim;
      const int64_t ql = m.q_lora_rank, kvl = m.kv_lora_rank;
      if (ql > 0) {
        linear(p + "attn.wq_a", ql, m.d_model, TpSplit::none, l, -1, LinearClass::attention, std);
        norm(p + "attn.q_norm.weight", l, ql);
        linear(p + "attn.wq_b", H * qk, ql, TpSplit::rows, l, -1, LinearClass::attention, std);
      } else {
        linear(p + "attn.wq", H * qk, m.d_model, TpSplit::rows, l, -1, LinearClass::attention, std);
      }
      linear(p + "attn.wkv_a", kvl + m.qk_rope_head_dim, m.d_model, TpSplit::none, l, -1, LinearClass::attention, std);
      norm(p + "attn.kv_norm.weight", l, kvl);
      linear(p + "attn.wkv_b", H * (nope + m.v_head_dim), kvl, TpSplit::rows, l, -1, LinearClass::attention, std);
      linear(p + "attn.wo", m.d_model, H * m.v_head_dim, TpSplit::cols, l, -1, LinearClass::attention, out_std);
    } else {
      linear(p + "attn.wq", q_dim, m.d_model, TpSplit::rows, l, -1, LinearClass::attention, std);
      linear(p + "attn.wk", kv_dim, m.d_model, TpSplit::rows, l, -1, LinearClass::attention, std);
      linear(p + "attn.wv", kv_dim, m.d_model, TpSplit::rows, l, -1, LinearClass::attention, std);
      linear(p + "attn.wo", m.d_model, q_dim, TpSplit::cols, l, -1, LinearClass::attention, out_std);
    }
    norm(p + "ffn_norm.weight", l);
    if (l < m.first_dense_layers) {
      linear(p + "mlp.w1", m.d_ff_dense, m.d_model, TpSplit::rows, l, -1, LinearClass::mlp, std);
      linear(p + "mlp.w3", m.d_ff_dense, m.d_model, TpSplit::rows, l, -1, LinearClass::mlp, std);
      linear(p + "mlp.w2", m.d_model, m.d_ff_dense, TpSplit::cols, l, -1, LinearClass::mlp, out_std);
      return;
    }
    const MoeConfig& e = m.moe;
    // The router stays FP32 and replicated; its bias steers expert choice only (not trained).
    add({p + "moe.router", e.n_experts, m.d_model, TpSplit::none, l, -1, LinearClass::none, true, true, InitKind::normal, std});
    add({p + "moe.router_bias", 1, e.n_experts, TpSplit::none, l, -1, LinearClass::none, false, false, InitKind::zeros, 0.0f});
    if (e.n_shared_experts > 0) {
      // The shared experts as one SwiGLU of width n_shared x d_expert (the same function as a sum
      // of n_shared separate ones).
      const int64_t w = int64_t(e.n_shared_experts) * e.d_expert;
      linear(p + "moe.shared.w1", w, m.d_model, TpSplit::rows, l, -1, LinearClass::shared_experts, std);
      linear(p + "moe.shared.w3", w, m.d_model, TpSplit::rows, l, -1, LinearClass::shared_experts, std);
      linear(p + "moe.shared.w2", m.d_model, w, TpSplit::cols, l, -1, LinearClass::shared_experts, out_std);
    }
    for (int x = 0; x < e.n_experts; ++x) {
      const std::string q = p + "moe.experts." + std::to_string(x) + ".";
      linear(q + "w1", e.d_expert, m.d_model, TpSplit::rows, l, x, LinearClass::experts, std);
      linear(q + "w3", e.d_expert, m.d_model, TpSplit::rows, l, x, LinearClass::experts, std);
      linear(q + "w2", m.d_model, e.d_expert, TpSplit::cols, l, x, LinearClass::experts, out_std);
    }
  };
  for (int l = 0; l < m.n_layers; ++l) block(block_prefix(m, l), l);
  norm("final_norm.weight", m.n_layers);
  add({"head.weight", m.vocab_size, m.d_model, TpSplit::rows, m.n_layers, -1, LinearClass::none, true, true, InitKind::normal, std});
  // Multi-token prediction modules, on the last stage (DeepSeek-V3's enorm, hnorm, eh_proj, a
  // block, and shared_head.norm; the embedding and the head are the model's). eh_proj is an FP32
  // GEMM, replicated over tensor parallelism, like the router.
  for (int k = 0; k < m.mtp_depth; ++k) {
    const int l = m.n_layers + k;
    const std::string p = "mtp." + std::to_string(k) + ".";
    norm(p + "enorm.weight", l);
    norm(p + "hnorm.weight", l);
    linear(p + "eh_proj", m.d_model, 2 * int64_t(m.d_model), TpSplit::none, l, -1, LinearClass::none, std);
    block(block_prefix(m, l), l);
    norm(p + "norm.weight", l);
  }
  t.reindex();
  return t;
}

std::vector<ParamCount> count_params(const ModelConfig& m) {
  static const char* const kOrder[] = {"embedding", "attention", "dense MLP", "routed experts", "shared experts",
                                       "router", "norms", "head"};
  auto component = [](const std::string& n) -> const char* {
    auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
    if (n.rfind("mtp.", 0) == 0) return "MTP";  // the multi-token prediction modules, everything in them
    if (n == "embed.weight") return "embedding";
    if (n == "head.weight") return "head";
    if (has(".attn.")) return "attention";  // MLA's latent norms included
    if (has(".mlp.")) return "dense MLP";
    if (has(".moe.experts.")) return "routed experts";
    if (has(".moe.shared.")) return "shared experts";
    if (has(".moe.router")) return "router";
    return "norms";  // attn_norm, ffn_norm, final_norm
  };
  std::map<std::string, ParamCount> by;
  const double routed_share = double(m.moe.top_k) / double(m.moe.n_experts);
  for (const ParamSpec& p : build_param_table(m).params) {
    const char* c = component(p.name);
    ParamCount& e = by[c];
    e.component = c;
    e.total += p.numel();
    const double share = std::string_view(c) == "embedding"              ? 0.0
                         : p.name.find(".moe.experts.") != std::string::npos ? routed_share
                                                                             : 1.0;
    e.activated += double(p.numel()) * share;
  }
  std::vector<ParamCount> out;
  ParamCount total{"total", 0, 0};
  for (const char* c : kOrder)
    if (by.count(c)) {
      out.push_back(by[c]);
      total.total += by[c].total, total.activated += by[c].activated;
    }
  out.push_back(total);
  if (by.count("MTP")) {
    out.push_back(by["MTP"]);
    out.push_back({"total with MTP", total.total + by["MTP"].total, total.activated + by["MTP"].activated});
  }
  return out;
}

std::string param_count_table(const ModelConfig& m) {
  auto human = [](double n) {
    char b[32];
    if (n >= 1e9) std::snprintf(b, sizeof b, "%.2fB", n / 1e9);
    else if (n >= 1e6) std::snprintf(b, sizeof b, "%.2fM", n / 1e6);
    else if (n >= 1e3) std::snprintf(b, sizeof b, "%.2fK", n / 1e3);
    else std::snprintf(b, sizeof b, "%.0f", n);
    return std::string(b);
  };
  std::string out = "parameters (activated per token: routed experts " + std::to_string(m.moe.top_k) + " of " +
                    std::to_string(m.moe.n_experts) + ", the embedding not counted):\n";
  char line[160];
  std::snprintf(line, sizeof line, "  %-16s %18s %10s %10s\n", "component", "total", "", "activated");
  out += line;
  for (const ParamCount& c : count_params(m)) {
    std::snprintf(line, sizeof line, "  %-16s %18lld %10s %10s\n", c.component.c_str(), (long long)c.total,
                  human(double(c.total)).c_str(), human(c.activated).c_str());
    out += line;
  }
  return out;
}

namespace {
constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
inline void mulhilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = uint64_t(a) * b;
  *hi = uint32_t(p >> 32);
  *lo = uint32_t(p);
}
}  // namespace

Philox4x32 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) k0 += kW0, k1 += kW1;
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kM0, c0, &hi0, &lo0);
    mulhilo(kM1, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
  }
  return {{c0, c1, c2, c3}};
}

uint64_t name_hash(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

void init_param_slice(const ParamSpec& p, uint64_t seed, int64_t begin, int64_t end, float* out) {
  FP8MOE_ASSERT(0 <= begin && begin <= end && end <= p.numel(), "init slice [", begin, ", ", end, ") of ", p.name);
  if (p.init != InitKind::normal) {
    for (int64_t i = begin; i < end; ++i) out[i - begin] = p.init == InitKind::ones ? 1.0f : 0.0f;
    return;
  }
  const uint64_t key = seed ^ name_hash(p.name);
  constexpr double kTwoPi = 6.283185307179586476925286766559;
#pragma omp parallel for schedule(static)
  for (int64_t i = begin; i < end; ++i) {
    // One counter per element: its global index. Box-Muller on two of the four outputs.
    const Philox4x32 r = philox4x32_10(uint32_t(i), uint32_t(uint64_t(i) >> 32), 0x243F6A88u, 0x85A308D3u,
                                       uint32_t(key), uint32_t(key >> 32));
    const double u1 = (double(r.v[0]) + 0.5) * 0x1p-32, u2 = (double(r.v[1]) + 0.5) * 0x1p-32;
    out[i - begin] = float(p.init_std * std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2));
  }
}

}  // namespace fp8moe
