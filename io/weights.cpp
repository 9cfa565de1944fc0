#include "io/weights.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace fp8moe {
namespace {
constexpr char kMagic[8] = {'F', 'P', '8', 'M', 'O', 'E', 'W', '1'};
}

void save_weights(const std::string& path, const std::string& config_yaml, const ParamTable& table,
                  const std::vector<std::vector<float>>& params) {
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  if (!out) throw WeightsError(tmp + ": cannot write: " + std::strerror(errno));
  auto u64 = [&](uint64_t v) { out.write(reinterpret_cast<const char*>(&v), 8); };
  out.write(kMagic, 8);
  u64(config_yaml.size());
  out.write(config_yaml.data(), std::streamsize(config_yaml.size()));
  u64(table.params.size());
  for (size_t i = 0; i < table.params.size(); ++i) {
    const std::string& name = table.params[i].name;
    const uint32_t n = uint32_t(name.size());
    out.write(reinterpret_cast<const char*>(&n), 4);
    out.write(name.data(), n);
    u64(params[i].size());
    out.write(reinterpret_cast<const char*>(params[i].data()), std::streamsize(params[i].size() * sizeof(float)));
  }
  out.close();
  if (!out) throw WeightsError(tmp + ": write failed: " + std::strerror(errno));
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw WeightsError(path + ": cannot rename " + tmp + ": " + std::strerror(errno));
}

Weights load_weights(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw WeightsError(path + ": cannot open the weights file: " + std::strerror(errno));
  auto fail = [&](const std::string& why) -> Weights { throw WeightsError(path + ": " + why); };
  auto u64 = [&]() {
    uint64_t v = 0;
    if (!in.read(reinterpret_cast<char*>(&v), 8)) fail("truncated");
    return v;
  };
  char magic[8] = {};
  if (!in.read(magic, 8) || std::memcmp(magic, kMagic, 8) != 0) fail("not an fp8moe weights file (bad magic)");
  Weights w;
  const uint64_t yaml = u64();
  if (yaml > (64u << 20)) fail("config of " + std::to_string(yaml) + " bytes: corrupt");
  w.config_yaml.resize(yaml);
  if (!in.read(w.config_yaml.data(), std::streamsize(yaml))) fail("truncated in the config");
  const uint64_t n = u64();
  if (n > 1000000) fail(std::to_string(n) + " parameters: corrupt");
  for (uint64_t i = 0; i < n; ++i) {
    uint32_t len = 0;
    if (!in.read(reinterpret_cast<char*>(&len), 4) || len > 4096) fail("truncated or corrupt parameter name");
    std::string name(len, '\0');
    if (!in.read(name.data(), len)) fail("truncated in a parameter name");
    const uint64_t numel = u64();
    if (numel > (uint64_t(1) << 36)) fail(name + ": " + std::to_string(numel) + " values: corrupt");
    std::vector<float> v(numel);
    if (!in.read(reinterpret_cast<char*>(v.data()), std::streamsize(numel * sizeof(float)))) fail("truncated in " + name);
    w.params.emplace_back(std::move(name), std::move(v));
  }
  if (in.peek() != EOF) fail("trailing bytes after the last parameter");
  return w;
}

}  // namespace fp8moe
