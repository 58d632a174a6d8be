#pragma once

// cuBLASLt matmul with an epilogue, in cuBLASLt's own column-major terms. Knows nothing of ATen: the caller
// passes LibTorch's cuBLASLt handle, the stream, device pointers and a workspace.

#include <cstdint>
#include <tuple>

#include <cuda_runtime_api.h>

#include <kernels/dtype.h>

namespace kernels::cuda {

/// cuBLASLt epilogues we use (the BIAS bit dropped when there is no bias).
enum class LtEpilogue : int8_t {
  kDefault,
  kBias,
  kRelu,
  kReluBias,
  kGelu,
  kGeluBias,
  kGeluAux,
  kGeluAuxBias,
  kDGelu,
  kDGeluBGrad,
  kBGradB
};

/// A stored column-major matrix: rows x cols with leading dimension ld, used transposed when `transpose`.
struct LtMatrix {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
  bool transpose = false;
};

/// Everything that selects descriptors and an algorithm: D[m x n] = epilogue(op(A)[m x k] . op(B)[k x n]), D with
/// leading dimension m (packed), the auxiliary matrix (GELU input) m x n with leading dimension aux_ld.
/// Alignments are the byte alignments of the pointers (capped at 256), which the heuristic depends on.
struct LtProblem {
  int device = 0;
  DType dtype = DType::kFloat32;
  bool tf32 = false;  // fp32 only: compute in TF32 (CUBLAS_COMPUTE_32F_FAST_TF32) instead of full fp32
  LtEpilogue epilogue = LtEpilogue::kDefault;
  int64_t m = 0, n = 0, k = 0;
  LtMatrix a, b;
  int64_t aux_ld = 0;
  int64_t max_workspace_bytes = 0;
  int64_t align_a = 0, align_b = 0, align_d = 0, align_bias = 0, align_aux = 0;
  auto key() const {
    return std::tie(device, dtype, tf32, epilogue, m, n, k, a.rows, a.cols, a.ld, a.transpose, b.rows, b.cols, b.ld,
                    b.transpose, aux_ld, max_workspace_bytes, align_a, align_b, align_d, align_bias, align_aux);
  }
  bool operator<(const LtProblem& other) const { return key() < other.key(); }
};

/// Device pointers of one call. bias: the bias (read) or the bias gradient (written); aux: the GELU input
/// (written by kGeluAux*, read by kDGelu*).
struct LtPointers {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  void* bias = nullptr;
  void* aux = nullptr;
  void* workspace = nullptr;
};

/// The outcome of a cuBLASLt call: `call` is null on success, else the failing function's name and its status.
struct LtStatus {
  const char* call = nullptr;
  int status = 0;
  bool ok() const { return call == nullptr; }
};

/// Descriptors and the heuristic's algorithm for one LtProblem (opaque; cached for the life of the process).
struct LtPlan;

/// Finds the cached plan of `problem` or creates it (descriptors + cublasLtMatmulAlgoGetHeuristic) with
/// `handle` (a cublasLtHandle_t). *plan is set to null when the heuristic has no algorithm or rejects the
/// configuration (NOT_SUPPORTED, INVALID_VALUE: an epilogue / layout / dtype combination this cuBLASLt does not
/// take); that answer is cached too, and *rejection receives the status (0 when it simply found nothing).
/// Thread-safe (one mutex-guarded map). Host only: no device work, no sync.
LtStatus cublaslt_plan(const LtProblem& problem, void* handle, LtPlan** plan, int* rejection = nullptr);

/// Workspace bytes the plan's algorithm needs (<= problem.max_workspace_bytes).
int64_t cublaslt_plan_workspace_bytes(const LtPlan& plan);

/// Enqueues D = epilogue(op(A) . op(B)) on `stream` with `plan`. Pointers must have the alignments the plan was
/// made for; workspace must hold cublaslt_plan_workspace_bytes(plan). Never syncs the host.
LtStatus cublaslt_run(LtPlan& plan, const LtPointers& pointers, void* handle, cudaStream_t stream);

/// cuBLAS's name of a status code, e.g. "CUBLAS_STATUS_NOT_SUPPORTED".
const char* cublaslt_status_name(int status);

/// How many plans the cache holds (for tests of the caching).
int64_t cublaslt_plan_count();

}  // namespace kernels::cuda
