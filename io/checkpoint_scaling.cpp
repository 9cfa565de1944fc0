// The delayed-scaling state of the FP8 linear layers in a checkpoint (io/checkpoint_common.h):
// gathered from the ranks that hold the weights, packed into the /fp8 arrays for a save, and
// unpacked from them for a load.
#include <algorithm>
#include <cstring>
#include <iterator>

#include "io/checkpoint_common.h"
#include "kernels/check.h"

namespace fp8moe::ckpt {
namespace {

const char* const kScalingFields[3] = {"x", "w", "dy"};

DelayedScaling& scaling_field(HostLinearScaling& s, int f) { return f == 0 ? s.x : f == 1 ? s.w : s.dy; }
const DelayedScaling& scaling_field(const HostLinearScaling& s, int f) { return f == 0 ? s.x : f == 1 ? s.w : s.dy; }

// This rank's entries of the weights it holds, serialised: per entry the name's length and bytes,
// the field, the history's length and values, steps, scale and last_used.
std::string serialise_scaling(Transformer& model) {
  std::string mine;
  auto put = [&](const void* p, size_t n) { mine.append(static_cast<const char*>(p), n); };
  for (auto& [weight, s] : model.fp8_scaling_to_host()) {
    const int64_t i = model.table().index_of(weight);
    if (i < 0 || !model.holds(size_t(i))) continue;
    for (int f = 0; f < 3; ++f) {
      const DelayedScaling& d = scaling_field(s, f);
      if (d.history.empty()) continue;  // never recorded
      const int64_t len = int64_t(d.history.size()), n = int64_t(weight.size());
      put(&n, 8), put(weight.data(), weight.size()), put(&f, sizeof f), put(&len, 8);
      put(d.history.data(), size_t(len) * 4), put(&d.steps, 8), put(&d.scale, 4), put(&d.last_used, 4);
    }
  }
  return mine;
}

// Every rank's serialisation, concatenated in rank order. Collective.
std::string allgather_text(MPI_Comm comm, const std::string& mine) {
  int size = 1;
  MPI_CHECK(MPI_Comm_size(comm, &size));
  int len = int(mine.size());
  std::vector<int> lens(static_cast<size_t>(size)), offs(static_cast<size_t>(size), 0);
  MPI_CHECK(MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, comm));
  for (int r = 1; r < size; ++r) offs[size_t(r)] = offs[size_t(r - 1)] + lens[size_t(r - 1)];
  std::string all(size_t(offs.back() + lens.back()), '\0');
  MPI_CHECK(MPI_Allgatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), offs.data(), MPI_CHAR, comm));
  return all;
}

}  // namespace

std::map<std::string, HostLinearScaling> gather_scaling(MPI_Comm comm, Transformer& model) {
  const std::string all = allgather_text(comm, serialise_scaling(model));
  std::map<std::string, HostLinearScaling> merged;
  for (size_t at = 0; at < all.size();) {
    auto get = [&](void* p, size_t n) { std::memcpy(p, all.data() + at, n), at += n; };
    int64_t n = 0, hl = 0;
    int f = 0;
    get(&n, 8);
    std::string weight(all.data() + at, size_t(n));
    at += size_t(n);
    get(&f, sizeof f), get(&hl, 8);
    DelayedScaling d;
    d.history.resize(size_t(hl));
    get(d.history.data(), size_t(hl) * 4), get(&d.steps, 8), get(&d.scale, 4), get(&d.last_used, 4);
    scaling_field(merged[weight], f) = std::move(d);  // a replica's copy: the same values
  }
  return merged;
}

ScalingArrays pack_scaling(const std::map<std::string, HostLinearScaling>& state) {
  ScalingArrays a;
  for (auto& [weight, s] : state)
    for (int f = 0; f < 3; ++f) {
      const DelayedScaling& d = scaling_field(s, f);
      if (d.history.empty()) continue;
      FP8MOE_ASSERT(a.len == 0 || int64_t(d.history.size()) == a.len, "amax histories of different lengths");
      a.len = int64_t(d.history.size());
      a.names.push_back(weight + "." + kScalingFields[f]);
      a.history.insert(a.history.end(), d.history.begin(), d.history.end());
      a.scale.push_back(d.scale);
      a.scale.push_back(d.last_used);
      a.steps.push_back(d.steps);
    }
  return a;
}

void unpack_scaling(const ScalingArrays& a, const ParamTable& table, const Transformer* model, const std::string& path,
                    std::map<std::string, HostLinearScaling>* out) {
  const int64_t len = a.len;
  for (size_t i = 0; i < a.names.size(); ++i) {
    const std::string& full = a.names[i];
    const size_t dot = full.rfind('.');
    const std::string field = dot == std::string::npos ? "" : full.substr(dot + 1);
    const auto known = std::find(std::begin(kScalingFields), std::end(kScalingFields), field);
    const int f = known == std::end(kScalingFields) ? -1 : int(known - std::begin(kScalingFields));
    if (f < 0) throw CheckpointError(path + ": /fp8 names an unknown tensor \"" + full + "\"");
    const int64_t w = table.index_of(full.substr(0, dot));
    if (w < 0 || (model && !model->holds(size_t(w)))) continue;  // not a weight of this rank
    DelayedScaling& d = scaling_field((*out)[full.substr(0, dot)], f);
    d.history.resize(size_t(len));
    std::copy_n(a.history.begin() + int64_t(i) * len, len, d.history.begin());
    d.scale = a.scale[i * 2];
    d.last_used = a.scale[i * 2 + 1];
    d.steps = a.steps[i];
  }
}

std::string join_lines(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + "\n";
  return s;
}

}  // namespace fp8moe::ckpt
