// CpuBackend: the reference implementation of the Backend interface. Host memory, one thread per
// rank (no threads inside an operation), exact-product double-accumulation math (docs/NUMERICS.md).
#include <cstdlib>
#include <cstring>

#include "core/backend.h"
#include "cpu/cpu_ops.h"
#include "cpu/routing.h"
#include "latentmoe/error.h"

namespace latentmoe::detail {
namespace {

constexpr size_t kAlignment = 64;

class CpuBackend final : public Backend {
 public:
  Device device() const override { return Device::cpu; }

  DeviceBuffer allocate(size_t bytes) override {
    const size_t rounded = bytes == 0 ? kAlignment : (bytes + kAlignment - 1) / kAlignment * kAlignment;
    void* pointer = std::aligned_alloc(kAlignment, rounded);
    LATENTMOE_CHECK(pointer != nullptr, "CPU backend: out of host memory allocating ", bytes, " bytes");
    std::memset(pointer, 0, rounded);
    return DeviceBuffer(pointer, bytes, [](void* p) { std::free(p); });
  }

  void copy(const TensorView& src, const TensorView& dst) override { cpu::copy(src, dst); }

  void router_logits(const TensorView& x, const TensorView& gate, const TensorView& logits) override {
    cpu::router_logits(x, gate, logits);
  }

  void route(const RoutingParams& params, const TensorView& logits, const TensorView& bias, const TensorView& topk_ids,
             const TensorView& topk_weights, const TensorView& zero_weight_sum) override {
    cpu::route(params, logits, bias, topk_ids, topk_weights, zero_weight_sum);
  }

  void linear(const TensorView& x, const TensorView& w, const TensorView& y, bool accumulate) override {
    cpu::linear(x, w, y, accumulate);
  }

  void routed_experts(const ActivationParams& activation, const TensorView& z, const TensorView& topk_ids,
                      const TensorView& topk_weights, const MlpWeights& experts, const TensorView& out) override {
    cpu::routed_experts(activation, z, topk_ids, topk_weights, experts, out);
  }

  void dense_mlp(const ActivationParams& activation, const TensorView& x, const MlpWeights& mlp,
                 const TensorView& out) override {
    cpu::dense_mlp(activation, x, mlp, out);
  }

  void rms_norm(const TensorView& in, const TensorView& gamma, float eps, const TensorView& out) override {
    cpu::rms_norm(in, gamma, eps, out);
  }

  void add(const TensorView& a, const TensorView& b, const TensorView& out) override { cpu::add(a, b, out); }

  void add_scaled_rows(const TensorView& x, const TensorView& scale, const TensorView& out) override {
    cpu::add_scaled_rows(x, scale, out);
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace latentmoe::detail
