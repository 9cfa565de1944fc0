// model_logits CHECKPOINT TOKENS OUT [OUT_MTP]: fp8moe's forward on a fixed batch, for the
// comparison with Hugging Face transformers (tests/app/hf_interop.py). TOKENS: a .npy of int32
// (B, T); OUT: a .npy of float32 (B, T, V), the main model's logits of every position; OUT_MTP:
// (depth, B, T, V), the multi-token prediction modules' (teacher-forced; NaN at the positions
// t + k + 1 >= T, which predict nothing). One process, the CPU backend, whatever layout trained
// the checkpoint.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "kernels/backend.h"
#include "model/transformer.h"

namespace {

// The one .npy form used here: version 1.0, little-endian, C order, of the given descr.
std::vector<char> read_npy(const std::string& path, const std::string& descr, std::vector<int64_t>* shape) {
  std::ifstream f(path, std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (all.size() < 10 || all.compare(0, 6, "\x93NUMPY") != 0) throw std::runtime_error(path + ": not a .npy file");
  const size_t hlen = size_t(uint8_t(all[8])) | size_t(uint8_t(all[9])) << 8;
  const std::string header = all.substr(10, hlen);
  if (header.find("'descr': '" + descr + "'") == std::string::npos || header.find("'fortran_order': False") == std::string::npos)
    throw std::runtime_error(path + ": expected a C-order " + descr + " array: " + header);
  const size_t a = header.find('(', header.find("'shape'")), b = header.find(')', a);
  std::stringstream dims(header.substr(a + 1, b - a - 1));
  for (std::string d; std::getline(dims, d, ',');)
    if (d.find_first_not_of(' ') != std::string::npos) shape->push_back(std::stoll(d));
  return {all.begin() + long(10 + hlen), all.end()};
}

void write_npy(const std::string& path, const std::vector<int64_t>& shape, const std::vector<float>& v) {
  std::string dims;
  for (int64_t d : shape) dims += std::to_string(d) + ", ";
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  header.append(63 - (10 + header.size()) % 64, ' ');
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  f.write("\x93NUMPY\x01\x00", 8);
  const uint16_t n = uint16_t(header.size());
  f.put(char(n & 0xff)).put(char(n >> 8));
  f << header;
  f.write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * 4));
}

}  // namespace

int run(int argc, char** argv) {
  using namespace fp8moe;
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr, "usage: model_logits CHECKPOINT TOKENS.npy OUT.npy [OUT_MTP.npy]\n");
    return 2;
  }
  std::vector<int64_t> shape;
  const std::vector<char> raw = read_npy(argv[2], "<i4", &shape);
  if (shape.size() != 2) throw std::runtime_error("tokens: expected (B, T)");
  const int64_t B = shape[0], T = shape[1];
  std::vector<int32_t> tokens(size_t(B * T));
  if (raw.size() < tokens.size() * 4) throw std::runtime_error("tokens: the file is shorter than its shape");
  std::memcpy(tokens.data(), raw.data(), tokens.size() * 4);

  std::vector<std::vector<float>> params;
  const Config cfg = load_checkpoint_weights(argv[1], &params);
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::cpu);
  Transformer model(*be, cfg);
  for (size_t i = 0; i < params.size(); ++i) model.set_param(i, params[i]);
  const int64_t V = cfg.model.vocab_size, depth = cfg.model.mtp_depth;
  std::vector<float> out, mtp(size_t(depth * B * T * V));
  for (int64_t b = 0; b < B; ++b) {
    std::vector<std::vector<float>> modules;
    const std::vector<float> l = model.sequence_logits(tokens.data() + b * T, T, argc == 5 ? &modules : nullptr);
    out.insert(out.end(), l.begin(), l.end());
    for (int64_t k = 0; k < int64_t(modules.size()); ++k)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t v = 0; v < V; ++v)
          mtp[size_t(((k * B + b) * T + t) * V + v)] = t + k + 1 < T ? modules[size_t(k)][size_t(t * V + v)] : NAN;
  }
  write_npy(argv[3], {B, T, V}, out);
  if (argc == 5) write_npy(argv[4], {depth, B, T, V}, mtp);
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "model_logits: %s\n", e.what());
    return 2;
  }
}
