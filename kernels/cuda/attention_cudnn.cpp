#include "kernels/cuda/attention_cudnn.h"

// Dynamic loading: the frontend reaches cuDNN through cudnn_frontend::cudnn_dlhandle (defined
// below), so that fp8moe does not need libcudnn to start.
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>

#include "kernels/check.h"

namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}

namespace fp8moe::cuda {
namespace {

namespace fe = cudnn_frontend;
using Graph = fe::graph::Graph;
using TensorAttr = fe::graph::Tensor_attributes;

// The tensors' uids in the variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// libcudnn.so.9 opened once per process (never closed: plans and handles outlive any owner).
bool open_cudnn(std::string* why) {
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    const char* env = std::getenv("FP8MOE_CUDNN_LIBRARY");
    const char* name = env && *env ? env : "libcudnn.so.9";
    fe::cudnn_dlhandle = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
    if (!fe::cudnn_dlhandle) {
      const char* e = dlerror();
      error = std::string("cannot open ") + name + " (" + (e ? e : "dlopen failed") +
              "; put cuDNN 9's lib directory on LD_LIBRARY_PATH or set FP8MOE_CUDNN_LIBRARY)";
    }
  });
  if (!error.empty()) *why = error;
  return error.empty();
}

std::vector<int64_t> dims(int64_t B, int64_t heads, int64_t T, int64_t width) { return {B, heads, T, width}; }
// (B*T, heads, width) rows seen as [B, heads, T, width].
std::vector<int64_t> strides(int64_t heads, int64_t T, int64_t width) {
  return {T * heads * width, width, heads * width, 1};
}

// Which of the four layouts a tensor has: its heads (H or KVH) and its width (hd or hdv).
enum class Role { q, k, v, o };  // q, dq | k, dk | v, dv | o, do
int64_t heads_of(const AttnDims& d, Role r) { return r == Role::k || r == Role::v ? d.KVH : d.H; }
int64_t width_of(const AttnDims& d, Role r) { return r == Role::q || r == Role::k ? d.hd : d.hdv; }

std::shared_ptr<TensorAttr> input(Graph& g, const char* name, Uid uid, const AttnDims& d, Role r) {
  const int64_t h = heads_of(d, r), w = width_of(d, r);
  return g.tensor(
      TensorAttr().set_name(name).set_uid(uid).set_dim(dims(d.B, h, d.T, w)).set_stride(strides(h, d.T, w)));
}
void as_output(const std::shared_ptr<TensorAttr>& t, const char* name, Uid uid, const AttnDims& d, Role r) {
  const int64_t h = heads_of(d, r), w = width_of(d, r);
  t->set_output(true).set_name(name).set_uid(uid).set_dim(dims(d.B, h, d.T, w)).set_stride(strides(h, d.T, w));
}
std::shared_ptr<Graph> new_graph() {
  auto g = std::make_shared<Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

// validate, lower, plan by heuristics, check, build: the first failure's message, or "".
std::string build(Graph& g, cudnnHandle_t handle) {
  if (auto e = g.validate(); e.is_bad()) return "validate: " + e.get_message();
  if (auto e = g.build_operation_graph(handle); e.is_bad()) return "build_operation_graph: " + e.get_message();
  if (auto e = g.create_execution_plans({fe::HeurMode_t::A}); e.is_bad()) return "create_execution_plans: " + e.get_message();
  if (auto e = g.check_support(handle); e.is_bad()) return "check_support: " + e.get_message();
  if (auto e = g.build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE); e.is_bad())
    return "build_plans: " + e.get_message();
  return "";
}


}  // namespace

std::string to_string(const AttnDims& d) {
  return "B " + std::to_string(d.B) + " T " + std::to_string(d.T) + " H " + std::to_string(d.H) + " KVH " +
         std::to_string(d.KVH) + " head_dim " + std::to_string(d.hd) +
         (d.hdv != d.hd ? " value_head_dim " + std::to_string(d.hdv) : std::string());
}

std::string cudnn_library_error() {
  std::string why;
  return open_cudnn(&why) ? std::string() : why;
}

int64_t cudnn_library_version() {
  std::string why;
  if (!open_cudnn(&why)) return 0;
  try {
    return int64_t(fe::detail::get_backend_version());
  } catch (const std::exception&) {
    return 0;
  }
}

struct CudnnAttention::Impl {
  cudnnHandle_t handle = nullptr;
  struct Plans {
    std::shared_ptr<Graph> fwd, bwd;
    int64_t fwd_ws = 0, bwd_ws = 0;
  };
  std::map<AttnDims, Plans> plans;
  const Plans& at(const AttnDims& d) const {
    const auto it = plans.find(d);
    FP8MOE_ASSERT(it != plans.end(), "cuDNN attention: shape not prepared: ", to_string(d));
    return it->second;
  }
};

CudnnAttention::CudnnAttention(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CudnnAttention::~CudnnAttention() {
  if (impl_ && impl_->handle) {
    impl_->plans.clear();
    (void)fe::detail::destroy_handle(impl_->handle);
  }
}

std::unique_ptr<CudnnAttention> CudnnAttention::create(cudaStream_t stream, std::string* why) {
  if (!open_cudnn(why)) return nullptr;
  try {
    if (fe::detail::get_backend_version() < 90000) {
      *why = "cuDNN " + fe::detail::get_backend_version_string() + " is older than 9.0";
      return nullptr;
    }
    auto impl = std::make_unique<Impl>();
    if (const cudnnStatus_t s = fe::detail::create_handle(&impl->handle); s != CUDNN_STATUS_SUCCESS) {
      *why = std::string("cudnnCreate: ") + "status " + std::to_string(int(s));
      return nullptr;
    }
    if (const cudnnStatus_t s = fe::detail::set_stream(impl->handle, stream); s != CUDNN_STATUS_SUCCESS) {
      *why = std::string("cudnnSetStream: ") + "status " + std::to_string(int(s));
      (void)fe::detail::destroy_handle(impl->handle);
      return nullptr;
    }
    return std::unique_ptr<CudnnAttention>(new CudnnAttention(std::move(impl)));
  } catch (const std::exception& e) {
    *why = std::string("cuDNN: ") + e.what();
    return nullptr;
  }
}

std::string CudnnAttention::version() const {
  return "cuDNN " + fe::detail::get_backend_version_string() + " (frontend " +
         std::to_string(CUDNN_FRONTEND_MAJOR_VERSION) + "." + std::to_string(CUDNN_FRONTEND_MINOR_VERSION) + "." +
         std::to_string(CUDNN_FRONTEND_PATCH_VERSION) + ")";
}

bool CudnnAttention::prepare(const AttnDims& d, std::string* why) {
  if (impl_->plans.count(d)) return true;
  if (d.H % d.KVH != 0) {
    *why = "H not a multiple of KVH";
    return false;
  }
  const float scale = float(1.0 / std::sqrt(double(d.hd)));  // as kernels/attention.h
  Impl::Plans p;
  try {
    // Forward: O and the statistics backward needs.
    p.fwd = new_graph();
    Graph& f = *p.fwd;
    auto q = input(f, "q", kQ, d, Role::q), k = input(f, "k", kK, d, Role::k), v = input(f, "v", kV, d, Role::v);
    auto opts = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_causal_mask(true).set_attn_scale(scale);
    auto [o, stats] = f.sdpa(q, k, v, opts);
    as_output(o, "o", kO, d, Role::o);
    stats->set_output(true).set_name("stats").set_uid(kStats).set_data_type(fe::DataType_t::FLOAT)
        .set_dim({d.B, d.H, d.T, 1}).set_stride({d.H * d.T, d.T, 1, 1});
    if (const std::string e = build(f, impl_->handle); !e.empty()) {
      *why = "forward, " + to_string(d) + ": " + e;
      return false;
    }
    // Backward: dq, dk, dv from q, k, v, o, do and the statistics; deterministic.
    p.bwd = new_graph();
    Graph& b = *p.bwd;
    auto bq = input(b, "q", kQ, d, Role::q), bk = input(b, "k", kK, d, Role::k), bv = input(b, "v", kV, d, Role::v);
    auto bo = input(b, "o", kO, d, Role::o), bdo = input(b, "do", kDO, d, Role::o);
    auto bstats = b.tensor(TensorAttr().set_name("stats").set_uid(kStats).set_data_type(fe::DataType_t::FLOAT)
                               .set_dim({d.B, d.H, d.T, 1}).set_stride({d.H * d.T, d.T, 1, 1}));
    auto bopts = fe::graph::SDPA_backward_attributes()
                     .set_name("sdpa_backward")
                     .set_causal_mask(true)
                     .set_attn_scale(scale)
                     .set_deterministic_algorithm(true);
    auto [dq, dk, dv] = b.sdpa_backward(bq, bk, bv, bo, bdo, bstats, bopts);
    as_output(dq, "dq", kDQ, d, Role::q);
    as_output(dk, "dk", kDK, d, Role::k);
    as_output(dv, "dv", kDV, d, Role::v);
    if (const std::string e = build(b, impl_->handle); !e.empty()) {
      *why = "backward, " + to_string(d) + ": " + e;
      return false;
    }
    if (auto e = f.get_workspace_size(p.fwd_ws); e.is_bad()) return *why = "forward workspace: " + e.get_message(), false;
    if (auto e = b.get_workspace_size(p.bwd_ws); e.is_bad()) return *why = "backward workspace: " + e.get_message(), false;
  } catch (const std::exception& e) {
    *why = "cuDNN, " + to_string(d) + ": " + e.what();
    return false;
  }
  impl_->plans.emplace(d, std::move(p));
  return true;
}

int64_t CudnnAttention::forward_workspace(const AttnDims& d) const { return impl_->at(d).fwd_ws; }
int64_t CudnnAttention::backward_workspace(const AttnDims& d) const { return impl_->at(d).bwd_ws; }

namespace {
void run(const Graph& g, cudnnHandle_t handle, std::unordered_map<int64_t, void*>& pack, void* workspace,
         const char* what, const AttnDims& d) {
  fe::error_t e = g.execute(handle, pack, workspace);
  if (e.is_bad()) fatal_error(__FILE__, __LINE__, std::string("cuDNN attention ") + what + ", " + to_string(d) + ": " + e.get_message());
}
}  // namespace

void CudnnAttention::forward(const AttnDims& d, const void* q, const void* k, const void* v, void* o, float* stats,
                             void* workspace) const {
  if (d.B * d.T * d.H == 0) return;
  std::unordered_map<int64_t, void*> pack{{kQ, const_cast<void*>(q)}, {kK, const_cast<void*>(k)},
                                          {kV, const_cast<void*>(v)}, {kO, o}, {kStats, stats}};
  run(*impl_->at(d).fwd, impl_->handle, pack, workspace, "forward", d);
}

void CudnnAttention::backward(const AttnDims& d, const void* q, const void* k, const void* v, const void* o,
                              const void* dout, const float* stats, void* dq, void* dk, void* dv,
                              void* workspace) const {
  if (d.B * d.T * d.H == 0) return;
  std::unordered_map<int64_t, void*> pack{
      {kQ, const_cast<void*>(q)},    {kK, const_cast<void*>(k)},  {kV, const_cast<void*>(v)},
      {kO, const_cast<void*>(o)},    {kDO, const_cast<void*>(dout)}, {kStats, const_cast<float*>(stats)},
      {kDQ, dq},                     {kDK, dk},                   {kDV, dv}};
  run(*impl_->at(d).bwd, impl_->handle, pack, workspace, "backward", d);
}

}  // namespace fp8moe::cuda
