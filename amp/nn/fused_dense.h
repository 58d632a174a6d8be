#pragma once

// Fused dense layers for mixed-precision training: drop-in replacements for torch::nn::Linear (FusedDense) and
// for Linear -> GELU(tanh) -> Linear (FusedDenseGeluDense) whose forward and backward fold bias, GELU and the
// bias gradients into cuBLASLt GEMM epilogues (kernels/gemm/gemm_epilogue.h). See docs/fused_dense.md.

#include <cstdint>
#include <ostream>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <kernels/gemm/gemm_epilogue.h>

namespace amp {

/// How a fused dense layer picks its implementation.
enum class DensePath : int8_t {
  kAuto,      ///< CUDA: time both paths (forward + backward) on first use of a shape, cache the faster; CPU: ATen
  kCublasLt,  ///< every GEMM on cuBLASLt whenever it can take it (else ATen, reported), never measured
  kAten,      ///< plain ATen ops (addmm, gelu, sum): the fallback, forced
};

/// "auto", "cublaslt" or "aten".
const char* dense_path_name(DensePath path);

/// Options of FusedDense, as torch::nn::LinearOptions plus the path policy. Checked at construction.
struct FusedDenseOptions {
  FusedDenseOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  /// Learn an additive bias (default true).
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(DensePath, path) = DensePath::kAuto;
};

/// Which path the last forward and backward of a layer took (kAten until the first call).
struct DensePathsTaken {
  kernels::GemmPath forward = kernels::GemmPath::kAten;
  kernels::GemmPath backward = kernels::GemmPath::kAten;
};

/// y = x W^T + b, like torch::nn::Linear: parameters `weight` [out, in] and `bias` [out] (absent with
/// bias(false)), initialized exactly as Linear (same random draws), so state dicts and checkpoints move between
/// the two. Input [*, in] in any floating dtype matching the parameters; under autocast (amp O1) input and
/// parameters are cast to the autocast dtype first, as for Linear. Backward: grad_input = dy W (GEMM), grad_weight
/// and grad_bias = dy^T x with the bias gradient in the same GEMM (BGRADB) on the cuBLASLt path, addmm/mm + sum on
/// the ATen path. Host syncs: none, except the one-time measurement of DensePath::kAuto per new shape on CUDA.
class FusedDenseImpl : public torch::nn::Cloneable<FusedDenseImpl> {
 public:
  FusedDenseImpl(int64_t in_features, int64_t out_features)
      : FusedDenseImpl(FusedDenseOptions(in_features, out_features)) {}
  explicit FusedDenseImpl(const FusedDenseOptions& options);

  void reset() override;
  /// Re-draws the parameters as torch::nn::Linear does (kaiming_uniform(a=sqrt(5)), bias U(+-1/sqrt(in))).
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  /// [*, in] -> [*, out]. Errors name the input's sizes and the layer's features.
  at::Tensor forward(const at::Tensor& input);

  /// The paths of the last forward and of the last backward through this layer.
  DensePathsTaken paths_taken() const;

  FusedDenseOptions options;
  at::Tensor weight;
  at::Tensor bias;

 private:
  at::Tensor paths_;  // int8 [2] on the CPU, written by forward and by the autograd backward
};
TORCH_MODULE(FusedDense);

/// Options of FusedDenseGeluDense: in -> hidden -> out, biases on both layers (or neither).
struct FusedDenseGeluDenseOptions {
  FusedDenseGeluDenseOptions(int64_t in_features, int64_t hidden_features, int64_t out_features)
      : in_features_(in_features), hidden_features_(hidden_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, hidden_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(DensePath, path) = DensePath::kAuto;
};

/// y = dense2(gelu_tanh(dense1(x))), the transformer MLP. Parameters `dense1.weight` [hidden, in], `dense1.bias`,
/// `dense2.weight` [out, hidden], `dense2.bias`, each layer initialized as torch::nn::Linear; a
/// torch::nn::Sequential(Linear, GELU("tanh"), Linear) names the same tensors `0.*` and `2.*`.
/// Forward: GELU_AUX_BIAS (keeps the pre-activation for backward) then BIAS. Backward: BGRADB for dense2's weight and
/// bias gradients, DGELU_BGRAD for the GELU gradient and dense1's bias gradient in the same GEMM, then plain GEMMs
/// for dense1's weight gradient and the input gradient. Same dtype, autocast and path rules as FusedDense; under
/// DensePath::kAuto the measured choice covers forward + backward of the whole block.
class FusedDenseGeluDenseImpl : public torch::nn::Cloneable<FusedDenseGeluDenseImpl> {
 public:
  FusedDenseGeluDenseImpl(int64_t in_features, int64_t hidden_features, int64_t out_features)
      : FusedDenseGeluDenseImpl(FusedDenseGeluDenseOptions(in_features, hidden_features, out_features)) {}
  explicit FusedDenseGeluDenseImpl(const FusedDenseGeluDenseOptions& options);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  /// [*, in] -> [*, out].
  at::Tensor forward(const at::Tensor& input);

  /// The paths of the last forward and of the last backward through this block.
  DensePathsTaken paths_taken() const;

  FusedDenseGeluDenseOptions options;
  FusedDense dense1{nullptr};
  FusedDense dense2{nullptr};

 private:
  at::Tensor paths_;
};
TORCH_MODULE(FusedDenseGeluDense);

}  // namespace amp
