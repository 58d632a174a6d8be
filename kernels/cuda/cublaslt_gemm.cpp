#include <kernels/cuda/cublaslt_gemm.h>

#include <map>
#include <memory>
#include <mutex>

#include <cublasLt.h>

namespace kernels::cuda {
namespace {

cudaDataType_t data_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return CUDA_R_16F;
    case DType::kBFloat16:
      return CUDA_R_16BF;
    case DType::kFloat32:
      break;
  }
  return CUDA_R_32F;
}

// fp16/bf16 accumulate in fp32; fp32 inputs run on the tensor cores as TF32 when the caller allows it (LibTorch's
// switch, as for its own matmuls), in full fp32 otherwise.
cublasComputeType_t compute_type(DType dtype, bool tf32) {
  return dtype == DType::kFloat32 && tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

cublasLtEpilogue_t lt_epilogue(LtEpilogue epilogue) {
  switch (epilogue) {
    case LtEpilogue::kDefault:
      return CUBLASLT_EPILOGUE_DEFAULT;
    case LtEpilogue::kBias:
      return CUBLASLT_EPILOGUE_BIAS;
    case LtEpilogue::kRelu:
      return CUBLASLT_EPILOGUE_RELU;
    case LtEpilogue::kReluBias:
      return CUBLASLT_EPILOGUE_RELU_BIAS;
    case LtEpilogue::kGelu:
      return CUBLASLT_EPILOGUE_GELU;
    case LtEpilogue::kGeluBias:
      return CUBLASLT_EPILOGUE_GELU_BIAS;
    case LtEpilogue::kGeluAux:
      return CUBLASLT_EPILOGUE_GELU_AUX;
    case LtEpilogue::kGeluAuxBias:
      return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case LtEpilogue::kDGelu:
      return CUBLASLT_EPILOGUE_DGELU;
    case LtEpilogue::kDGeluBGrad:
      return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case LtEpilogue::kBGradB:
      return CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

bool uses_bias_pointer(LtEpilogue e) {
  return e == LtEpilogue::kBias || e == LtEpilogue::kReluBias || e == LtEpilogue::kGeluBias ||
         e == LtEpilogue::kGeluAuxBias || e == LtEpilogue::kDGeluBGrad || e == LtEpilogue::kBGradB;
}

bool uses_aux(LtEpilogue e) {
  return e == LtEpilogue::kGeluAux || e == LtEpilogue::kGeluAuxBias || e == LtEpilogue::kDGelu ||
         e == LtEpilogue::kDGeluBGrad;
}

}  // namespace

// Cached plans stay alive for the process (the cache is never destroyed: tearing descriptors down during static
// destruction could run after the CUDA libraries were unloaded); a plan that is not kept (no algorithm, or a failed
// build) releases its descriptors at once. The matmul descriptor carries the per-call bias and aux pointers, so a
// call holds `mutex` while it sets them and enqueues the matmul (host work only).
struct LtPlan {
  LtProblem problem;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a_layout = nullptr, b_layout = nullptr, d_layout = nullptr;
  cublasLtMatmulHeuristicResult_t heuristic{};
  std::mutex mutex;

  LtPlan() = default;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan() {
    for (cublasLtMatrixLayout_t layout : {a_layout, b_layout, d_layout}) {
      if (layout != nullptr) cublasLtMatrixLayoutDestroy(layout);
    }
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

namespace {

#define LTA_LT_TRY(expr)                                                                     \
  do {                                                                                       \
    const cublasStatus_t lta_status_ = (expr);                                               \
    if (lta_status_ != CUBLAS_STATUS_SUCCESS) return {#expr, static_cast<int>(lta_status_)}; \
  } while (0)

template <typename T>
cublasStatus_t set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  return cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value));
}

template <typename T>
cublasStatus_t set_pref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
  return cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value));
}

cublasStatus_t create_layout(cublasLtMatrixLayout_t* layout, DType dtype, const LtMatrix& m) {
  return cublasLtMatrixLayoutCreate(layout, data_type(dtype), static_cast<uint64_t>(m.rows),
                                    static_cast<uint64_t>(m.cols), m.ld);
}

// Preference handle released on every return path of build().
struct PreferenceGuard {
  cublasLtMatmulPreference_t pref = nullptr;
  ~PreferenceGuard() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
  }
};

LtStatus build(LtPlan& plan, cublasLtHandle_t handle, bool* found, int* rejection) {
  const LtProblem& p = plan.problem;
  LTA_LT_TRY(cublasLtMatmulDescCreate(&plan.desc, compute_type(p.dtype, p.tf32), CUDA_R_32F));
  const cublasOperation_t trans_a = p.a.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t trans_b = p.b.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
  LTA_LT_TRY(set_desc(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, trans_a));
  LTA_LT_TRY(set_desc(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, trans_b));
  LTA_LT_TRY(set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, lt_epilogue(p.epilogue)));
  if (uses_aux(p.epilogue)) LTA_LT_TRY(set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, p.aux_ld));
  LTA_LT_TRY(create_layout(&plan.a_layout, p.dtype, p.a));
  LTA_LT_TRY(create_layout(&plan.b_layout, p.dtype, p.b));
  LTA_LT_TRY(create_layout(&plan.d_layout, p.dtype, LtMatrix{p.m, p.n, p.m, false}));

  // The heuristic reads the bias/aux pointers only for their alignment: give it addresses with exactly the
  // alignments of this problem, so the algorithm it picks is valid for every call with the same key.
  if (uses_bias_pointer(p.epilogue)) {
    LTA_LT_TRY(set_desc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, reinterpret_cast<void*>(p.align_bias)));
  }
  if (uses_aux(p.epilogue)) {
    LTA_LT_TRY(set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, reinterpret_cast<void*>(p.align_aux)));
  }
  PreferenceGuard pref;
  LTA_LT_TRY(cublasLtMatmulPreferenceCreate(&pref.pref));
  LTA_LT_TRY(
      set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(p.max_workspace_bytes)));
  LTA_LT_TRY(set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, static_cast<uint32_t>(p.align_a)));
  LTA_LT_TRY(set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, static_cast<uint32_t>(p.align_b)));
  LTA_LT_TRY(set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, static_cast<uint32_t>(p.align_d)));
  LTA_LT_TRY(set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, static_cast<uint32_t>(p.align_d)));

  int returned = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.a_layout, plan.b_layout, plan.d_layout, plan.d_layout,
                                     pref.pref, 1, &plan.heuristic, &returned);
  // NOT_SUPPORTED / INVALID_VALUE from the heuristic: this cuBLASLt has no algorithm for (or does not accept) the
  // configuration: the caller falls back, it is not an error.
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE) {
    *found = false;
    *rejection = static_cast<int>(status);
    return {};
  }
  LTA_LT_TRY(status);
  *found = returned > 0 && plan.heuristic.state == CUBLAS_STATUS_SUCCESS;
  return {};
}

struct PlanCache {
  std::mutex mutex;
  std::map<LtProblem, std::unique_ptr<LtPlan>> plans;  // a null entry: the heuristic found nothing
  std::map<LtProblem, int> rejections;                 // for null entries: the heuristic's status (0: none)
};

PlanCache& plan_cache() {
  static auto* cache = new PlanCache();  // leaked on purpose, see LtPlan
  return *cache;
}

}  // namespace

LtStatus cublaslt_plan(const LtProblem& problem, void* handle, LtPlan** plan, int* rejection) {
  PlanCache& cache = plan_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  auto it = cache.plans.find(problem);
  if (it == cache.plans.end()) {
    auto created = std::make_unique<LtPlan>();
    created->problem = problem;
    bool found = false;
    int rejected = 0;
    const LtStatus status = build(*created, static_cast<cublasLtHandle_t>(handle), &found, &rejected);
    if (!status.ok()) return status;  // not cached: a transient failure may succeed next time
    if (!found) cache.rejections[problem] = rejected;
    it = cache.plans.emplace(problem, found ? std::move(created) : nullptr).first;
  }
  *plan = it->second.get();
  if (rejection != nullptr) *rejection = *plan == nullptr ? cache.rejections[problem] : 0;
  return {};
}

int64_t cublaslt_plan_workspace_bytes(const LtPlan& plan) { return static_cast<int64_t>(plan.heuristic.workspaceSize); }

LtStatus cublaslt_run(LtPlan& plan, const LtPointers& ptr, void* handle, cudaStream_t stream) {
  const float alpha = 1.0f;
  const float beta = 0.0f;
  const std::lock_guard<std::mutex> lock(plan.mutex);
  const LtEpilogue epilogue = plan.problem.epilogue;
  if (uses_bias_pointer(epilogue)) LTA_LT_TRY(set_desc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, ptr.bias));
  if (uses_aux(epilogue)) LTA_LT_TRY(set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, ptr.aux));
  LTA_LT_TRY(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle), plan.desc, &alpha, ptr.a, plan.a_layout, ptr.b,
                            plan.b_layout, &beta, ptr.d, plan.d_layout, ptr.d, plan.d_layout, &plan.heuristic.algo,
                            ptr.workspace, plan.heuristic.workspaceSize, stream));
  return {};
}

const char* cublaslt_status_name(int status) { return cublasLtGetStatusName(static_cast<cublasStatus_t>(status)); }

int64_t cublaslt_plan_count() {
  PlanCache& cache = plan_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  return static_cast<int64_t>(cache.plans.size());
}

}  // namespace kernels::cuda
