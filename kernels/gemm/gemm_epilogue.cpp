#include <kernels/gemm/gemm_epilogue.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <kernels/tensor_lists.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <kernels/cuda/cublaslt_gemm.h>
#endif

namespace kernels {

const char* epilogue_name(Epilogue epilogue) {
  switch (epilogue) {
    case Epilogue::kNone:
      return "NONE";
    case Epilogue::kBias:
      return "BIAS";
    case Epilogue::kReluBias:
      return "RELU_BIAS";
    case Epilogue::kGeluBias:
      return "GELU_BIAS";
    case Epilogue::kGeluAuxBias:
      return "GELU_AUX_BIAS";
    case Epilogue::kDGelu:
      return "DGELU";
    case Epilogue::kDGeluBGrad:
      return "DGELU_BGRAD";
    case Epilogue::kBGradB:
      return "BGRADB";
  }
  return "unknown";
}

const char* gemm_path_name(GemmPath path) { return path == GemmPath::kCublasLt ? "cublaslt" : "aten"; }

namespace {

// cuBLASLt's documented constraint on the GELU auxiliary matrix: its leading dimension is a multiple of 8.
constexpr int64_t kAuxLdMultiple = 8;
// The pointer alignment the cuBLASLt path requires; less aligned views take the ATen path.
constexpr int64_t kMinLtAlignmentBytes = 16;
// Alignments above this change nothing in cuBLASLt's choice; capping keeps the plan cache small.
constexpr int64_t kMaxTrackedAlignmentBytes = 256;
constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kHopperWorkspaceBytes = 32 * kMiB;
constexpr int64_t kDefaultWorkspaceBytes = 4 * kMiB;
constexpr int kHopperMajor = 9;
constexpr const char* kTanh = "tanh";

bool takes_bias(Epilogue e) {
  return e == Epilogue::kBias || e == Epilogue::kReluBias || e == Epilogue::kGeluBias || e == Epilogue::kGeluAuxBias;
}
bool takes_gelu_input(Epilogue e) { return e == Epilogue::kDGelu || e == Epilogue::kDGeluBGrad; }
bool uses_aux(Epilogue e) { return e == Epilogue::kGeluAuxBias || takes_gelu_input(e); }

std::string describe(const at::Tensor& a, const at::Tensor& b, Epilogue epilogue) {
  std::ostringstream s;
  s << "a " << a.sizes() << " and b " << b.sizes() << " (" << a.scalar_type() << "), epilogue "
    << epilogue_name(epilogue);
  return s.str();
}

// A 2-D matrix that cuBLASLt can express: row-major or column-major (a transposed view) with a leading dimension.
struct MatrixLayout {
  bool row_major = true;
  int64_t ld = 1;
};

std::optional<MatrixLayout> layout_of(const at::Tensor& t) {
  const int64_t rows = t.size(0);
  const int64_t cols = t.size(1);
  const int64_t s0 = t.stride(0);
  const int64_t s1 = t.stride(1);
  // A dimension of size 1 has no meaningful stride.
  if ((cols <= 1 || s1 == 1) && (rows <= 1 || s0 >= cols)) {
    return MatrixLayout{true, rows <= 1 ? std::max<int64_t>(cols, 1) : s0};
  }
  if ((rows <= 1 || s0 == 1) && (cols <= 1 || s1 >= rows)) {
    return MatrixLayout{false, cols <= 1 ? std::max<int64_t>(rows, 1) : s1};
  }
  return std::nullopt;
}

void check_matrix(const at::Tensor& t, const char* name, const at::Tensor& a, const at::Tensor& b, Epilogue e) {
  TORCH_CHECK(t.defined(), "gemm_epilogue: ", name, " is an undefined tensor");
  TORCH_CHECK(t.dim() == 2, "gemm_epilogue: ", name, " must be a 2-D matrix, got sizes ", t.sizes(), " (",
              describe(a, b, e), ")");
  to_kernel_dtype(t.scalar_type(), name);
  TORCH_CHECK(t.numel() == 0 || layout_of(t).has_value(), "gemm_epilogue: ", name, " has sizes ", t.sizes(),
              " and strides ", t.strides(),
              ": a layout cuBLASLt cannot express (it needs a unit stride in one dimension and a leading dimension "
              "in the other); call .contiguous() first");
}

void check_same(const at::Tensor& t, const char* name, const at::Tensor& a, const at::Tensor& b, Epilogue e) {
  TORCH_CHECK(t.scalar_type() == a.scalar_type(), "gemm_epilogue: mixed dtypes: ", name, " ", t.sizes(), " is ",
              t.scalar_type(), " but a ", a.sizes(), " is ", a.scalar_type(), " (", describe(a, b, e), ")");
  TORCH_CHECK(t.device() == a.device(), "gemm_epilogue: ", name, " is on ", t.device(), " but a is on ", a.device());
}

void check_args(const at::Tensor& a, const at::Tensor& b, Epilogue e, const at::Tensor& bias,
                const at::Tensor& gelu_input) {
  TORCH_CHECK(a.defined() && b.defined(), "gemm_epilogue: a and b must be defined tensors");
  check_matrix(a, "a", a, b, e);
  check_matrix(b, "b", a, b, e);
  check_same(b, "b", a, b, e);
  TORCH_CHECK(a.size(1) == b.size(0), "gemm_epilogue: inner dimensions differ: a is ", a.sizes(), " and b is ",
              b.sizes(), " (a's columns must equal b's rows)");
  const int64_t m = a.size(0);
  const int64_t n = b.size(1);
  if (bias.defined()) {
    TORCH_CHECK(takes_bias(e), "gemm_epilogue: epilogue ", epilogue_name(e), " takes no bias, got one of sizes ",
                bias.sizes());
    check_same(bias, "bias", a, b, e);
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n && bias.is_contiguous(), "gemm_epilogue: bias must be a ",
                "contiguous vector of N=", n, " elements for ", describe(a, b, e), ", got sizes ", bias.sizes(),
                " strides ", bias.strides());
  }
  if (takes_gelu_input(e)) {
    TORCH_CHECK(gelu_input.defined(), "gemm_epilogue: epilogue ", epilogue_name(e), " needs gelu_input [M, N] = [", m,
                ", ", n, "]");
    check_same(gelu_input, "gelu_input", a, b, e);
    TORCH_CHECK(
        gelu_input.dim() == 2 && gelu_input.size(0) == m && gelu_input.size(1) == n && gelu_input.is_contiguous(),
        "gemm_epilogue: gelu_input must be a contiguous [M, N] = [", m, ", ", n, "] matrix for ", describe(a, b, e),
        ", got sizes ", gelu_input.sizes(), " strides ", gelu_input.strides());
  } else {
    TORCH_CHECK(!gelu_input.defined(), "gemm_epilogue: epilogue ", epilogue_name(e),
                " takes no gelu_input, got one of sizes ", gelu_input.sizes());
  }
}

int64_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  if (address == 0) return kMaxTrackedAlignmentBytes;
  return std::min<int64_t>(kMaxTrackedAlignmentBytes, static_cast<int64_t>(address & (~address + 1)));
}

std::string lt_reason(const at::Tensor& a, const at::Tensor& b, Epilogue e, const at::Tensor& bias,
                      const at::Tensor& gelu_input) {
  const int64_t m = a.size(0);
  const int64_t k = a.size(1);
  const int64_t n = b.size(1);
  if (m == 0 || n == 0 || k == 0) {
    return c10::str("an empty dimension (M, N, K) = (", m, ", ", n, ", ", k, ")");
  }
  if (uses_aux(e) && n % kAuxLdMultiple != 0) {
    return c10::str("the GELU auxiliary matrix's leading dimension N=", n, " is not a multiple of ", kAuxLdMultiple);
  }
  const std::pair<const char*, const at::Tensor*> operands[] = {
      {"a", &a}, {"b", &b}, {"bias", &bias}, {"gelu_input", &gelu_input}};
  for (const auto& [name, t] : operands) {
    if (t->defined() && alignment_of(t->data_ptr()) < kMinLtAlignmentBytes) {
      return c10::str(name, "'s data is not ", kMinLtAlignmentBytes, "-byte aligned (a view at an odd offset)");
    }
  }
  if (!a.is_cuda()) {
    return c10::str("the tensors are on ", a.device(), " (cuBLASLt is CUDA-only)");
  }
#ifndef LIBTORCH_AMP_WITH_CUDA
  return "libtorch_amp was built without CUDA";
#else
  return {};
#endif
}

GemmResult aten_path(const at::Tensor& a, const at::Tensor& b, Epilogue e, const at::Tensor& bias,
                     const at::Tensor& gelu_input) {
  // The contract is "runs in the inputs' dtype": autocast must not recast (e.g. gelu to fp32) in here.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  GemmResult r;
  auto product = [&] { return bias.defined() ? at::addmm(bias, a, b) : at::mm(a, b); };
  switch (e) {
    case Epilogue::kNone:
    case Epilogue::kBias:
      r.out = product();
      break;
    case Epilogue::kReluBias:
      r.out = at::relu(product());
      break;
    case Epilogue::kGeluBias:
      r.out = at::gelu(product(), kTanh);
      break;
    case Epilogue::kGeluAuxBias:
      r.pre_activation = product();
      r.out = at::gelu(r.pre_activation, kTanh);
      break;
    case Epilogue::kDGelu:
    case Epilogue::kDGeluBGrad:
      r.out = at::gelu_backward(at::mm(a, b), gelu_input, kTanh);
      if (e == Epilogue::kDGeluBGrad) r.bias_grad = r.out.sum(0);
      break;
    case Epilogue::kBGradB:
      r.out = at::mm(a, b);
      r.bias_grad = a.sum(1);
      break;
  }
  r.out = r.out.contiguous();
  r.path = GemmPath::kAten;
  return r;
}

#ifdef LIBTORCH_AMP_WITH_CUDA
cuda::LtEpilogue lt_epilogue(Epilogue e, bool has_bias) {
  switch (e) {
    case Epilogue::kNone:
      return cuda::LtEpilogue::kDefault;
    case Epilogue::kBias:
      return has_bias ? cuda::LtEpilogue::kBias : cuda::LtEpilogue::kDefault;
    case Epilogue::kReluBias:
      return has_bias ? cuda::LtEpilogue::kReluBias : cuda::LtEpilogue::kRelu;
    case Epilogue::kGeluBias:
      return has_bias ? cuda::LtEpilogue::kGeluBias : cuda::LtEpilogue::kGelu;
    case Epilogue::kGeluAuxBias:
      return has_bias ? cuda::LtEpilogue::kGeluAuxBias : cuda::LtEpilogue::kGeluAux;
    case Epilogue::kDGelu:
      return cuda::LtEpilogue::kDGelu;
    case Epilogue::kDGeluBGrad:
      return cuda::LtEpilogue::kDGeluBGrad;
    case Epilogue::kBGradB:
      return cuda::LtEpilogue::kBGradB;
  }
  return cuda::LtEpilogue::kDefault;
}

// Row-major X [r, c] is column-major X^T [c, r]: a row-major operand is used as stored, a column-major one
// (a transposed view) transposed. See Note [row-major product in column-major cuBLASLt].
cuda::LtMatrix lt_operand(const at::Tensor& t) {
  const MatrixLayout layout = *layout_of(t);
  if (layout.row_major) return {t.size(1), t.size(0), layout.ld, false};
  return {t.size(0), t.size(1), layout.ld, true};
}

void check_lt(const cuda::LtStatus& status, const at::Tensor& a, const at::Tensor& b, Epilogue e) {
  TORCH_CHECK(status.ok(), "gemm_epilogue: cuBLASLt failed in ", status.call, ": ",
              cuda::cublaslt_status_name(status.status), " (", describe(a, b, e), ")");
}

// Note [row-major product in column-major cuBLASLt]
// cuBLASLt is column-major; our tensors are row-major. out[M, N] = a[M, K] . b[K, N] is, read column-major,
// out^T[N, M] = b^T[N, K] . a^T[K, M]: cuBLASLt's A is our b, its B is our a, m = N, n = M. Its bias (length m,
// broadcast over columns) is then our per-output-feature bias[N]; DGELU_BGRAD's bias gradient (summed over
// columns) is our out summed over rows; BGRADB's (B summed over k) is our a summed over its columns; the aux
// matrix (m x n, ld m) is our row-major [M, N] with ld N.
bool run_cublaslt(const at::Tensor& a, const at::Tensor& b, Epilogue e, const at::Tensor& bias,
                  const at::Tensor& gelu_input, GemmResult& r, std::string& no_algorithm) {
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t m = a.size(0);
  const int64_t n = b.size(1);
  // The outputs (out, and pre_activation / bias_grad where the epilogue writes them) come fresh from the caching
  // allocator, whose blocks are aligned far beyond what the key tracks: they are allocated only once a plan exists.
  const bool writes_aux = e == Epilogue::kGeluAuxBias;
  const bool writes_bias = e == Epilogue::kDGeluBGrad || e == Epilogue::kBGradB;
  const void* in_bias = writes_bias || !bias.defined() ? nullptr : bias.data_ptr();
  const void* in_aux = writes_aux || !gelu_input.defined() ? nullptr : gelu_input.data_ptr();

  cuda::LtProblem p;
  p.device = a.get_device();
  p.dtype = to_kernel_dtype(a.scalar_type(), "a");
  // fp32 follows LibTorch's TF32 switch for cuBLAS (off by default), so both paths compute alike.
  p.tf32 = a.scalar_type() == at::kFloat && at::globalContext().allowTF32CuBLAS();
  p.epilogue = lt_epilogue(e, bias.defined());
  p.m = n;
  p.n = m;
  p.k = a.size(1);
  p.a = lt_operand(b);
  p.b = lt_operand(a);
  p.aux_ld = n;
  p.max_workspace_bytes = cublaslt_workspace_bytes(at::cuda::getDeviceProperties(p.device)->major);
  p.align_a = alignment_of(b.data_ptr());
  p.align_b = alignment_of(a.data_ptr());
  p.align_d = kMaxTrackedAlignmentBytes;
  p.align_bias = writes_bias ? kMaxTrackedAlignmentBytes : in_bias != nullptr ? alignment_of(in_bias) : 0;
  p.align_aux = writes_aux ? kMaxTrackedAlignmentBytes : in_aux != nullptr ? alignment_of(in_aux) : 0;

  void* handle = at::cuda::getCurrentCUDABlasLtHandle();
  cuda::LtPlan* plan = nullptr;
  int rejection = 0;
  check_lt(cuda::cublaslt_plan(p, handle, &plan, &rejection), a, b, e);
  if (plan == nullptr) {
    no_algorithm = rejection != 0 ? c10::str("cuBLASLt's heuristic rejected this shape, dtype and epilogue (",
                                             cuda::cublaslt_status_name(rejection), ")")
                                  : "cuBLASLt's heuristic has no algorithm for this shape, dtype and epilogue";
    return false;
  }
  r.out = at::empty({m, n}, a.options());
  void* bias_ptr = const_cast<void*>(in_bias);
  void* aux_ptr = const_cast<void*>(in_aux);
  if (writes_aux) {
    r.pre_activation = at::empty({m, n}, a.options());
    aux_ptr = r.pre_activation.data_ptr();
  }
  if (writes_bias) {
    r.bias_grad = at::empty({e == Epilogue::kDGeluBGrad ? n : m}, a.options());
    bias_ptr = r.bias_grad.data_ptr();
  }
  // The caching allocator ties the block to the current stream, so freeing it when this call returns is safe:
  // the next user of the block is ordered after this matmul on the same stream.
  const c10::DataPtr workspace =
      c10::cuda::CUDACachingAllocator::get()->allocate(static_cast<size_t>(cuda::cublaslt_plan_workspace_bytes(*plan)));
  cuda::LtPointers ptr;
  ptr.a = b.data_ptr();
  ptr.b = a.data_ptr();
  ptr.d = r.out.data_ptr();
  ptr.bias = bias_ptr;
  ptr.aux = aux_ptr;
  ptr.workspace = workspace.get();
  check_lt(cuda::cublaslt_run(*plan, ptr, handle, at::cuda::getCurrentCUDAStream(p.device).stream()), a, b, e);
  r.path = GemmPath::kCublasLt;
  return true;
}
#endif

std::atomic<int64_t> g_workspace_override{-1};  // -1: none

std::optional<int64_t> env_workspace_bytes() {
  static const std::optional<int64_t> value = []() -> std::optional<int64_t> {
    const char* text = std::getenv("LIBTORCH_AMP_CUBLASLT_WORKSPACE_MB");
    if (text == nullptr || *text == '\0') return std::nullopt;
    return parse_workspace_mb(text) * kMiB;
  }();
  return value;
}

}  // namespace

int64_t parse_workspace_mb(const std::string& text) {
  size_t used = 0;
  long long value = -1;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == text.size() && value >= 0 && value <= (int64_t{1} << 20),
              "LIBTORCH_AMP_CUBLASLT_WORKSPACE_MB must be a whole number of MiB between 0 and 1048576, got '", text,
              "'");
  return value;
}

int64_t cublaslt_workspace_bytes(int compute_capability_major) {
  const int64_t override_bytes = g_workspace_override.load();
  if (override_bytes >= 0) return override_bytes;
  if (const auto env = env_workspace_bytes()) return *env;
  return compute_capability_major == kHopperMajor ? kHopperWorkspaceBytes : kDefaultWorkspaceBytes;
}

void set_cublaslt_workspace_bytes(std::optional<int64_t> bytes) {
  TORCH_CHECK(!bytes || *bytes >= 0, "cuBLASLt workspace bytes must be >= 0, got ", *bytes);
  g_workspace_override.store(bytes ? *bytes : -1);
}

std::string cublaslt_unsupported_reason(const at::Tensor& a, const at::Tensor& b, Epilogue epilogue,
                                        const at::Tensor& bias, const at::Tensor& gelu_input) {
  check_args(a, b, epilogue, bias, gelu_input);
  return lt_reason(a, b, epilogue, bias, gelu_input);
}

GemmResult gemm_epilogue(const at::Tensor& a, const at::Tensor& b, Epilogue epilogue, const at::Tensor& bias,
                         const at::Tensor& gelu_input, bool allow_cublaslt) {
  check_args(a, b, epilogue, bias, gelu_input);
  std::string reason =
      allow_cublaslt ? lt_reason(a, b, epilogue, bias, gelu_input) : "the cuBLASLt path was switched off";
#ifdef LIBTORCH_AMP_WITH_CUDA
  if (reason.empty()) {
    GemmResult r;
    if (run_cublaslt(a, b, epilogue, bias, gelu_input, r, reason)) return r;
  }
#endif
  GemmResult r = aten_path(a, b, epilogue, bias, gelu_input);
  r.fallback_reason = std::move(reason);
  return r;
}

}  // namespace kernels
