#include <functional>
#include <unordered_map>

#include "cuda/common/cuda_check.h"
#include "cuda/common/dtype_dispatch.cuh"
#include "cuda/gemm/blas.h"

namespace latentmoe::cuda {
namespace {

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      ::latentmoe::detail::throw_error("CUDA GEMM: dtype ", dtype_name(dtype), " is not a compute dtype");
  }
}

// The largest power of two up to 16 that divides the address.
uint8_t alignment_of(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  uint8_t alignment = 16;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

struct PlanKey {
  DType x_dtype, w_dtype, y_dtype;
  int64_t rows, cols, inner, ldx, ldw, ldy;
  bool accumulate;
  uint8_t align_x, align_w, align_y;
  bool operator==(const PlanKey&) const = default;
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    size_t seed = 0;
    auto mix = [&seed](uint64_t value) {
      seed ^= std::hash<uint64_t>{}(value) + 0x9e3779b97f4a7c15ull + (seed << 6) + (seed >> 2);
    };
    mix(static_cast<uint64_t>(key.x_dtype) | static_cast<uint64_t>(key.w_dtype) << 8 |
        static_cast<uint64_t>(key.y_dtype) << 16 | static_cast<uint64_t>(key.accumulate) << 24 |
        static_cast<uint64_t>(key.align_x) << 32 | static_cast<uint64_t>(key.align_w) << 40 |
        static_cast<uint64_t>(key.align_y) << 48);
    for (int64_t value : {key.rows, key.cols, key.inner, key.ldx, key.ldw, key.ldy}) mix(static_cast<uint64_t>(value));
    return seed;
  }
};

// cuBLASLt sees the row-major problem transposed, in column-major terms:
// D [cols x rows] = op(A)^T B with A = w (inner x cols, ld ldw, transposed) and B = x (inner x
// rows, ld ldx), C = D = y (cols x rows, ld ldy): the "TN" layout cuBLAS favours.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool supported = false;  // false: the heuristic found no algorithm; use the fallback kernel

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

std::unique_ptr<Plan> make_plan(cublasLtHandle_t handle, const PlanKey& key, size_t workspace_bytes) {
  auto plan = std::make_unique<Plan>();
  LATENTMOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, no_transpose = CUBLAS_OP_N;
  LATENTMOE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)));
  LATENTMOE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &no_transpose, sizeof(no_transpose)));
  LATENTMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, cuda_type(key.w_dtype), key.inner, key.cols, key.ldw));
  LATENTMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, cuda_type(key.x_dtype), key.inner, key.rows, key.ldx));
  LATENTMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, cuda_type(key.y_dtype), key.cols, key.rows, key.ldy));

  cublasLtMatmulPreference_t preference = nullptr;
  LATENTMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  const uint64_t max_workspace = workspace_bytes;
  const uint32_t align_a = key.align_w, align_b = key.align_x, align_c = key.align_y;
  cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                               &max_workspace, sizeof(max_workspace));
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                                  sizeof(align_a));
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                                  sizeof(align_b));
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                                  sizeof(align_c));
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c,
                                                  sizeof(align_c));
  }
  cublasLtMatmulHeuristicResult_t result{};
  int num_results = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->c, plan->c, preference, 1,
                                            &result, &num_results);
  }
  cublasLtMatmulPreferenceDestroy(preference);
  // "Not supported" is an answer (the fallback runs the problem); any other failure is an error.
  if (status == CUBLAS_STATUS_NOT_SUPPORTED)
    num_results = 0;
  else
    LATENTMOE_CUBLAS_CHECK(status);
  if (num_results > 0 && result.state == CUBLAS_STATUS_SUCCESS && result.workspaceSize <= workspace_bytes) {
    plan->algo = result.algo;
    plan->supported = true;
  }
  return plan;
}

// --- fallback: a 64x64-tiled fp32 GEMM over run-time dtypes ---------------------------------------

constexpr int kTile = 64;
constexpr int kTileK = 16;

__global__ void __launch_bounds__(256) fallback_gemm_kernel(GemmProblem p) {
  __shared__ float xs[kTileK][kTile + 1];
  __shared__ float ws[kTileK][kTile + 1];
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < p.inner; k0 += kTileK) {
    for (int i = 0; i < 4; ++i) {
      const int index = threadIdx.x + i * 256;
      const int r = index / kTileK, kk = index % kTileK;
      const int64_t k = k0 + kk;
      const int64_t xr = row0 + r, wr = col0 + r;
      xs[kk][r] = xr < p.rows && k < p.inner ? load_as_float_dev(p.x, p.x_dtype, xr * p.ldx + k) : 0.0f;
      ws[kk][r] = wr < p.cols && k < p.inner ? load_as_float_dev(p.w, p.w_dtype, wr * p.ldw + k) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = xs[kk][ty + 16 * i];
        b[i] = ws[kk][tx + 16 * i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i) {
    const int64_t r = row0 + ty + 16 * i;
    if (r >= p.rows) continue;
    for (int j = 0; j < 4; ++j) {
      const int64_t c = col0 + tx + 16 * j;
      if (c >= p.cols) continue;
      float value = acc[i][j];
      if (p.accumulate) value += load_as_float_dev(p.y, p.y_dtype, r * p.ldy + c);
      store_from_float_dev(p.y, p.y_dtype, r * p.ldy + c, value);
    }
  }
}

}  // namespace

struct Blas::Cache {
  std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash> plans;
};

Blas::Blas() : cache_(std::make_unique<Cache>()) { LATENTMOE_CUBLAS_CHECK(cublasLtCreate(&handle_)); }

Blas::~Blas() {
  cache_.reset();
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

size_t Blas::num_plans() const { return cache_->plans.size(); }

bool Blas::uses_cublaslt(const GemmProblem& problem) {
  if (problem.x_dtype != problem.w_dtype || !is_compute_dtype(problem.x_dtype)) return false;
  return problem.y_dtype == problem.x_dtype || problem.y_dtype == DType::f32;
}

void Blas::gemm(const GemmProblem& problem, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (problem.rows == 0 || problem.cols == 0) return;
  for (DType dtype : {problem.x_dtype, problem.w_dtype, problem.y_dtype}) {
    LATENTMOE_CHECK(is_compute_dtype(dtype), "CUDA linear: dtype ", dtype_name(dtype),
                    " is not a compute dtype (F32, BF16, F16)");
  }
  if (problem.inner == 0) {
    // An empty sum: y = 0, or y unchanged when accumulating.
    if (!problem.accumulate) {
      const size_t element = dtype_size(problem.y_dtype);
      LATENTMOE_CUDA_CHECK(
          cudaMemset2DAsync(problem.y, problem.ldy * element, 0, problem.cols * element, problem.rows, stream));
    }
    return;
  }
  if (uses_cublaslt(problem)) {
    const PlanKey key{problem.x_dtype,
                      problem.w_dtype,
                      problem.y_dtype,
                      problem.rows,
                      problem.cols,
                      problem.inner,
                      problem.ldx,
                      problem.ldw,
                      problem.ldy,
                      problem.accumulate,
                      alignment_of(problem.x),
                      alignment_of(problem.w),
                      alignment_of(problem.y)};
    auto found = cache_->plans.find(key);
    if (found == cache_->plans.end()) {
      found = cache_->plans.emplace(key, make_plan(handle_, key, workspace_bytes)).first;
    }
    const Plan& plan = *found->second;
    if (plan.supported) {
      const float alpha = 1.0f, beta = problem.accumulate ? 1.0f : 0.0f;
      LATENTMOE_CUBLAS_CHECK(cublasLtMatmul(handle_, plan.desc, &alpha, problem.w, plan.a, problem.x, plan.b, &beta,
                                            problem.y, plan.c, problem.y, plan.c, &plan.algo, workspace,
                                            workspace_bytes, stream));
      return;
    }
  }
  launch_fallback_gemm(problem, stream);
}

void launch_fallback_gemm(const GemmProblem& problem, cudaStream_t stream) {
  if (problem.rows == 0 || problem.cols == 0) return;
  const dim3 grid(static_cast<unsigned>((problem.cols + kTile - 1) / kTile),
                  static_cast<unsigned>((problem.rows + kTile - 1) / kTile));
  fallback_gemm_kernel<<<grid, 256, 0, stream>>>(problem);
  LATENTMOE_CUDA_CHECK_LAUNCH("fallback_gemm_kernel");
}

}  // namespace latentmoe::cuda
