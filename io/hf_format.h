// fp8moe's model in Hugging Face's DeepSeek-V3 form (`fp8moe export`, `fp8moe import`): config.json
// with model_type deepseek_v3, and the tensors under the names and layouts of DeepSeek-V3's
// published checkpoints (model.layers.N.self_attn.q_a_proj.weight, ..., the multi-token prediction
// modules as model.layers.<num_hidden_layers + k>), in safetensors shards listed by
// model.safetensors.index.json. What transformers, vLLM and SGLang read.
//
// Two things change on the way:
// - RoPE. fp8moe rotates the two halves of a head's rotary part against each other (x_i with
//   x_{i+d/2}, GPT-NeoX's layout); DeepSeek's weights rotate adjacent pairs (x_2i with x_2i+1, the
//   complex form of its model.py, which transformers undoes with rope_interleave and vLLM runs as
//   is_neox_style false). Both give pair i the angle t theta^(-2i/d), so the export moves the rows
//   that produce a rotary channel: fp8moe row i of a rotary part becomes row 2i, row i + d/2 row
//   2i + 1 (the rope rows of each query head of wq_b / wq, the last qk_rope rows of wkv_a); the
//   import moves them back.
// - Vectors. Norm weights and the router bias are (1, n) in fp8moe, (n) in the files.
// Everything else keeps its (out, in) layout, with fp8moe's w1 / w3 / w2 as gate_proj / up_proj /
// down_proj and its shared experts already one MLP of width n_shared x d_expert, as DeepSeek's.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/config.h"
#include "model/param_table.h"

namespace fp8moe {

// Why this model has no DeepSeek-V3 form; "" when it has one.
std::string hf_export_refusal(const ModelConfig& m);

// config.json (model_type deepseek_v3) for `cfg`'s model, pretty-printed. torch_dtype names the
// stored dtype ("bfloat16", "float32"); fp8 adds DeepSeek's quantization_config (E4M3, 128 x 128
// weight blocks, dynamic activation scales).
std::string hf_config_json(const Config& cfg, const std::string& torch_dtype, bool fp8);

// The architecture fields of a config.json text that disagree with model `m`, one line each
// ("hidden_size: config.json 7168, model.d_model 256"), or that fp8moe cannot run (YaRN rope
// scaling, another model_type). Empty: the files are a model of `m`'s shape. Throws HfFormatError
// when the text is not JSON.
std::vector<std::string> hf_config_differences(const std::string& config_json, const ModelConfig& m);

// One fp8moe parameter in the files: its name and shape there; hf_row[i] is the file's row of
// fp8moe row i (empty: the same rows).
struct HfTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<int64_t> hf_row;
};
HfTensor hf_tensor(const ModelConfig& m, const ParamSpec& p);

// The tensors DeepSeek stores twice: each multi-token prediction layer's copy of the embedding
// and of the head (file name, fp8moe parameter it copies).
std::vector<std::pair<std::string, std::string>> hf_copies(const ModelConfig& m);

// Whether the FP8 form stores this parameter as E4M3 with weight_scale_inv blocks: the weights of
// fp8moe's FP8 linear layers (attention projections, dense MLPs, routed and shared experts).
// The embedding, head, router, norms, router bias and the MTP modules' eh_proj stay BF16 (the
// bias FP32), as in DeepSeek-V3's release.
bool hf_fp8_weight(const ParamSpec& p);
constexpr int kHfFp8Block = 128;  // DeepSeek-V3's weight_block_size

// The first element of v[0, n) that is NaN or infinite; n when every one is finite. Export and
// import move finite weights only (a NaN or an infinity is a diverged or damaged model).
size_t hf_first_nonfinite(const float* v, size_t n);
// "NaN", "inf", "-inf" or the value, for messages.
std::string hf_value_text(float x);

// A Hugging Face model directory being read: config.json and the safetensors files that
// model.safetensors.index.json names (or the directory's *.safetensors without an index).
class HfDirectory {
 public:
  explicit HfDirectory(const std::string& dir);  // throws HfFormatError
  const std::string& config_json() const { return config_json_; }
  bool has(const std::string& name) const;
  // A tensor as FP32 values in the file's layout (F32, BF16, F16, or F8_E4M3 times its
  // <name>_scale_inv blocks), its shape checked against `shape`. Throws HfFormatError, also for a
  // value that is not finite and for an FP8 scale that is not finite and positive (or whose
  // product with E4M3's largest value, 448, is not finite), naming the tensor and the index.
  std::vector<float> read_f32(const std::string& name, const std::vector<int64_t>& shape) const;
  // Rows [r0, r0 + n) of it (a 1-D tensor is one row; FP8 rows with their blocks' scales).
  std::vector<float> read_f32_rows(const std::string& name, const std::vector<int64_t>& shape, int64_t r0,
                                   int64_t n) const;
  // Every tensor name in the files.
  std::vector<std::string> names() const;

 private:
  std::string dir_, config_json_;
  int64_t fp8_block_[2] = {kHfFp8Block, kHfFp8Block};
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
};

// Block s of fp8moe parameter p ((s.rows, s.cols) of its global tensor, row-major) from the files,
// rows moved back per hf_tensor; only the rows of the block are read. Throws HfFormatError.
std::vector<float> hf_read_param(const HfDirectory& d, const ModelConfig& m, const ParamSpec& p, const Shard& s);

}  // namespace fp8moe
