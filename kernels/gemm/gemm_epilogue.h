#pragma once

// A matrix product with a fused epilogue (bias, ReLU, GELU, their gradients), on cuBLASLt when it can take the
// call and on plain ATen ops otherwise. See docs/fused_dense.md.

#include <cstdint>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

namespace kernels {

/// What happens after the product, in row-major terms: out = a . b with a [M, K], b [K, N], out [M, N].
/// GELU is the tanh approximation (cuBLASLt's), i.e. torch::gelu(x, "tanh"). The names are cuBLASLt's.
enum class Epilogue : int8_t {
  kNone,         ///< out = a.b
  kBias,         ///< out = a.b + bias[N]
  kReluBias,     ///< out = relu(a.b + bias)
  kGeluBias,     ///< out = gelu(a.b + bias)
  kGeluAuxBias,  ///< pre = a.b + bias, out = gelu(pre); pre is returned too (for the backward pass)
  kDGelu,        ///< out = (a.b) * gelu'(gelu_input[M, N])
  kDGeluBGrad,   ///< kDGelu, and bias_grad[N] = out summed over its M rows
  kBGradB,       ///< out = a.b, and bias_grad[M] = a summed over its K columns (cuBLASLt's B is our a)
};

/// "NONE", "BIAS", ..., "BGRADB".
const char* epilogue_name(Epilogue epilogue);

/// Which implementation computed a call.
enum class GemmPath : int8_t { kCublasLt, kAten };

/// "cublaslt" or "aten".
const char* gemm_path_name(GemmPath path);

/// The outputs of gemm_epilogue. Tensors are row-major contiguous, in the inputs' dtype and on their device.
struct GemmResult {
  at::Tensor out;                   ///< [M, N]
  at::Tensor pre_activation;        ///< kGeluAuxBias: [M, N]; undefined otherwise
  at::Tensor bias_grad;             ///< kDGeluBGrad: [N]; kBGradB: [M]; undefined otherwise
  GemmPath path = GemmPath::kAten;  ///< which implementation computed the outputs
  std::string fallback_reason;      ///< why the ATen path ran (empty on the cuBLASLt path)
};

/// out = epilogue(a . b), see Epilogue.
///
/// a:          [M, K] and b: [K, N], float32, float16 or bfloat16 (the same dtype), on one device (CPU or CUDA).
///             Each may be row-major or column-major (a transposed view) with any leading dimension; other
///             strides are an error naming sizes and strides.
/// bias:       kBias/kReluBias/kGeluBias/kGeluAuxBias: [N] contiguous, same dtype, or undefined for no bias.
///             Must be undefined for the other epilogues.
/// gelu_input: kDGelu/kDGeluBGrad: [M, N] contiguous, same dtype (the pre_activation of kGeluAuxBias).
/// allow_cublaslt: false forces the ATen path (the equivalence tests and DensePath::kAten use it).
/// Path: cuBLASLt (LibTorch's handle, the current stream, fp32 accumulation; fp32 inputs run as TF32 when LibTorch's
/// switch allows TF32 for cuBLAS, at::globalContext().allowTF32CuBLAS(), as its own matmuls do) when the
/// tensors are CUDA, 16-byte aligned, non-empty, the auxiliary matrix's leading dimension N is a multiple of 8
/// (kGeluAuxBias, kDGelu*), and cuBLASLt's heuristic has an algorithm (a NOT_SUPPORTED or INVALID_VALUE answer
/// counts as none); otherwise the ATen ops (addmm, relu,
/// gelu(approximate="tanh"), gelu_backward, sum), which compute the same outputs. Autocast does not apply
/// inside: everything runs in the inputs' dtype. Host syncs: none. Errors name the shapes; a cuBLASLt failure
/// names the call, the status and the shapes.
GemmResult gemm_epilogue(const at::Tensor& a, const at::Tensor& b, Epilogue epilogue, const at::Tensor& bias = {},
                         const at::Tensor& gelu_input = {}, bool allow_cublaslt = true);

/// Why the cuBLASLt path cannot take this (valid) call, or "" when it can, subject to the heuristic finding an
/// algorithm. Shape, alignment and dtype reasons are reported before the device, so they can be checked on CPUs.
std::string cublaslt_unsupported_reason(const at::Tensor& a, const at::Tensor& b, Epilogue epilogue,
                                        const at::Tensor& bias = {}, const at::Tensor& gelu_input = {});

/// The cuBLASLt workspace, in bytes, for a device of compute capability `major`.x: the value given to
/// set_cublaslt_workspace_bytes if any, else LIBTORCH_AMP_CUBLASLT_WORKSPACE_MB (MiB, read once), else 32 MiB
/// on Hopper (9.x) and 4 MiB elsewhere. The heuristic only considers algorithms that fit.
int64_t cublaslt_workspace_bytes(int compute_capability_major);

/// Overrides the workspace size for later calls (bytes >= 0; 0 = no workspace); std::nullopt restores the
/// default. Plans are cached per workspace size, so changing it does not invalidate earlier ones.
void set_cublaslt_workspace_bytes(std::optional<int64_t> bytes);

/// Parses a LIBTORCH_AMP_CUBLASLT_WORKSPACE_MB value (a non-negative integer of MiB); throws naming the text.
int64_t parse_workspace_mb(const std::string& text);

}  // namespace kernels
