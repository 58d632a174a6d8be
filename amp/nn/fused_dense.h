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
  /// Sizes of the layer; checked (> 0) by FusedDenseImpl's constructor.
  FusedDenseOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  /// Size of each input sample (> 0).
  TORCH_ARG(int64_t, in_features);
  /// Size of each output sample (> 0).
  TORCH_ARG(int64_t, out_features);
  /// Learn an additive bias (default true).
  TORCH_ARG(bool, bias) = true;
  /// How the layer picks its implementation (default DensePath::kAuto).
  TORCH_ARG(DensePath, path) = DensePath::kAuto;
};

/// Which path the last forward and backward of a layer took (kAten until the first call).
struct DensePathsTaken {
  kernels::GemmPath forward = kernels::GemmPath::kAten;   ///< kCublasLt when every GEMM of the forward ran there
  kernels::GemmPath backward = kernels::GemmPath::kAten;  ///< kCublasLt when every GEMM of the backward ran there
};

/// y = x W^T + b, like torch::nn::Linear: parameters `weight` [out, in] and `bias` [out] (absent with
/// bias(false)), initialized exactly as Linear (same random draws), so state dicts and checkpoints move between
/// the two. Input [*, in] in any floating dtype matching the parameters; under autocast (amp O1) input and
/// parameters are cast to the autocast dtype first, as for Linear. Backward: grad_input = dy W (GEMM), grad_weight
/// and grad_bias = dy^T x with the bias gradient in the same GEMM (BGRADB) on the cuBLASLt path, addmm/mm + sum on
/// the ATen path. Host syncs: none, except the one-time measurement of DensePath::kAuto per new shape on CUDA.
/// Used through its module holder, FusedDense.
class FusedDenseImpl : public torch::nn::Cloneable<FusedDenseImpl> {
 public:
  /// A layer of `in_features` -> `out_features` with a bias and DensePath::kAuto (FusedDenseOptions' defaults).
  FusedDenseImpl(int64_t in_features, int64_t out_features)
      : FusedDenseImpl(FusedDenseOptions(in_features, out_features)) {}
  /// Registers and initializes `weight` and `bias` as torch::nn::Linear does. Throws (c10::Error) unless
  /// in_features and out_features are > 0.
  explicit FusedDenseImpl(const FusedDenseOptions& options);

  /// Registers `weight` [out, in] and `bias` [out] (registered undefined with bias(false)), draws them as
  /// torch::nn::Linear::reset does, and resets paths_taken() to kAten; called by the constructor and by clone().
  void reset() override;
  /// Re-draws the parameters as torch::nn::Linear does (kaiming_uniform(a=sqrt(5)), bias U(+-1/sqrt(in))).
  void reset_parameters();
  /// Prints `amp::FusedDense(in_features=I, out_features=O, bias=B, path=P)`, P from dense_path_name().
  void pretty_print(std::ostream& stream) const override;

  /// [*, in] -> [*, out]. Errors name the input's sizes and the layer's features.
  at::Tensor forward(const at::Tensor& input);

  /// The paths of the last forward and of the last backward through this layer.
  DensePathsTaken paths_taken() const;

  FusedDenseOptions options;  ///< the options the layer was built with
  at::Tensor weight;          ///< [out, in], registered as "weight"
  at::Tensor bias;            ///< [out], registered as "bias" (undefined with bias(false))

 private:
  at::Tensor paths_;  ///< int8 [2] on the CPU, written by forward and by the autograd backward
};
TORCH_MODULE(FusedDense);

/// Options of FusedDenseGeluDense: in -> hidden -> out, biases on both layers (or neither).
struct FusedDenseGeluDenseOptions {
  /// Sizes of the block; checked (> 0) by FusedDenseGeluDenseImpl's constructor.
  FusedDenseGeluDenseOptions(int64_t in_features, int64_t hidden_features, int64_t out_features)
      : in_features_(in_features), hidden_features_(hidden_features), out_features_(out_features) {}
  /// Size of each input sample (> 0).
  TORCH_ARG(int64_t, in_features);
  /// Size of the hidden layer, dense1's output and dense2's input (> 0).
  TORCH_ARG(int64_t, hidden_features);
  /// Size of each output sample (> 0).
  TORCH_ARG(int64_t, out_features);
  /// Learn an additive bias in both layers (default true).
  TORCH_ARG(bool, bias) = true;
  /// How the block picks its implementation, passed on to both layers (default DensePath::kAuto).
  TORCH_ARG(DensePath, path) = DensePath::kAuto;
};

/// y = dense2(gelu_tanh(dense1(x))), the transformer MLP. Parameters `dense1.weight` [hidden, in], `dense1.bias`,
/// `dense2.weight` [out, hidden], `dense2.bias`, each layer initialized as torch::nn::Linear; a
/// torch::nn::Sequential(Linear, GELU("tanh"), Linear) names the same tensors `0.*` and `2.*`.
/// Forward: GELU_AUX_BIAS (keeps the pre-activation for backward) then BIAS. Backward: BGRADB for dense2's weight and
/// bias gradients, DGELU_BGRAD for the GELU gradient and dense1's bias gradient in the same GEMM, then plain GEMMs
/// for dense1's weight gradient and the input gradient. Same dtype, autocast and path rules as FusedDense; under
/// DensePath::kAuto the measured choice covers forward + backward of the whole block.
/// Used through its module holder, FusedDenseGeluDense.
class FusedDenseGeluDenseImpl : public torch::nn::Cloneable<FusedDenseGeluDenseImpl> {
 public:
  /// A block of `in_features` -> `hidden_features` -> `out_features` with biases and DensePath::kAuto
  /// (FusedDenseGeluDenseOptions' defaults).
  FusedDenseGeluDenseImpl(int64_t in_features, int64_t hidden_features, int64_t out_features)
      : FusedDenseGeluDenseImpl(FusedDenseGeluDenseOptions(in_features, hidden_features, out_features)) {}
  /// Registers and initializes `dense1` and `dense2`. Throws (c10::Error) unless in_features, hidden_features and
  /// out_features are > 0.
  explicit FusedDenseGeluDenseImpl(const FusedDenseGeluDenseOptions& options);

  /// Registers fresh `dense1` (in -> hidden) and `dense2` (hidden -> out), FusedDense layers with this block's
  /// bias and path, each initialized as torch::nn::Linear, and resets paths_taken() to kAten; called by the
  /// constructor and by clone().
  void reset() override;
  /// Prints `amp::FusedDenseGeluDense(in_features=I, hidden_features=H, out_features=O, bias=B, path=P)`, P from
  /// dense_path_name().
  void pretty_print(std::ostream& stream) const override;

  /// [*, in] -> [*, out].
  at::Tensor forward(const at::Tensor& input);

  /// The paths of the last forward and of the last backward through this block.
  DensePathsTaken paths_taken() const;

  FusedDenseGeluDenseOptions options;  ///< the options the block was built with
  FusedDense dense1{nullptr};          ///< in -> hidden, registered as "dense1"
  FusedDense dense2{nullptr};          ///< hidden -> out, registered as "dense2"

 private:
  at::Tensor paths_;
};
TORCH_MODULE(FusedDenseGeluDense);

}  // namespace amp
