#pragma once

// FP8 training for LibTorch: amp::Float8Linear, a drop-in torch::nn::Linear whose three GEMMs (forward, input
// gradient, weight gradient) run in FP8 through at::_scaled_mm, with Transformer Engine's delayed scaling or
// current scaling per tensor. See docs/fp8.md; the scaling rules are Note [FP8 scaling rules]
// (kernels/gemm/fp8_rule.h).

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <amp/fp8/fp8_recipe.h>

namespace amp {

/// A layer's FP8 scaling state: one row per tensor (kFp8Input, kFp8Weight, kFp8GradOutput). Under amp these are
/// views into amp's state (one buffer for every layer, updated by one kernel per step, saved in amp checkpoints).
struct Fp8Meta {
  Fp8Recipe recipe;      ///< the recipe the layer casts with
  at::Tensor history;    ///< [3, L] fp32; column 0 collects this step's amax (see kernels/gemm/fp8_rule.h)
  at::Tensor scale;      ///< [3] fp32: the scale each tensor is cast with (delayed scaling)
  at::Tensor scale_inv;  ///< [3] fp32: 1 / scale
};

/// Options of Float8Linear, as torch::nn::LinearOptions.
struct Float8LinearOptions {
  /// Sizes of the layer; checked (> 0) by Float8LinearImpl's constructor.
  Float8LinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  /// Size of each input sample (> 0; a multiple of 16 to run in FP8).
  TORCH_ARG(int64_t, in_features);
  /// Size of each output sample (> 0; a multiple of 16 to run in FP8).
  TORCH_ARG(int64_t, out_features);
  /// Learn an additive bias (default true).
  TORCH_ARG(bool, bias) = true;
};

/// y = x W^T + b like torch::nn::Linear (parameters `weight` [out, in] and `bias` [out], the same initialization
/// draws, so state dicts and checkpoints move between the two). Until FP8 is enabled (amp::Options::fp8, or
/// enable_fp8) it runs exactly as Linear. With FP8:
///   forward  y  = _scaled_mm(x8 E4M3, W8 E4M3) (+ bias in the GEMM for bf16/fp16 outputs)
///   backward dx = _scaled_mm(dy8, W8^T), dW = _scaled_mm(dy8^T, x8) (dy8 E5M2 under kHybrid), db = sum(dy)
/// Outputs are in the autocast dtype under autocast (amp O1), else the input's dtype (bf16 under O2); dx has x's
/// dtype, dW the weight's. The cast FP8 input and weight are what backward keeps (half the bytes of bf16). Rows
/// are padded with zeros to a multiple of 16 where they are a GEMM's inner dimension (the weight gradient; cuBLASLt's
/// FP8 rule); in and out features must be multiples of 16 (see fp8_ineligibility). Host syncs: none.
/// Used through its module holder, Float8Linear.
class Float8LinearImpl : public torch::nn::Cloneable<Float8LinearImpl> {
 public:
  /// A layer of `in_features` -> `out_features` with a bias (Float8LinearOptions' defaults).
  Float8LinearImpl(int64_t in_features, int64_t out_features)
      : Float8LinearImpl(Float8LinearOptions(in_features, out_features)) {}
  /// Registers and initializes `weight` and `bias` as torch::nn::Linear does; FP8 starts disabled. Throws
  /// (c10::Error) unless in_features and out_features are > 0.
  explicit Float8LinearImpl(const Float8LinearOptions& options);

  /// Registers `weight` [out, in] and `bias` [out] (registered undefined with bias(false)) and draws them as
  /// torch::nn::Linear::reset does; called by the constructor and by clone(). Leaves the FP8 state as it is.
  void reset() override;
  /// Re-draws the parameters as torch::nn::Linear does (kaiming_uniform(a=sqrt(5)), bias U(+-1/sqrt(in))).
  void reset_parameters();
  /// Prints `amp::Float8Linear(in_features=I, out_features=O, bias=B)`, with `, fp8=` and
  /// Fp8Recipe::to_string() before the `)` while FP8 is enabled.
  void pretty_print(std::ostream& stream) const override;

  /// [*, in] -> [*, out].
  at::Tensor forward(const at::Tensor& input);

  /// Empty when the FP8 GEMMs can take this layer on `device` (default: the CPU), else why not: a dimension that is
  /// not a multiple of 16, or a GPU without FP8 tensor cores (before sm_89).
  std::string fp8_ineligibility(const c10::Device& device = c10::kCPU) const;
  /// Runs the GEMMs in FP8 with `recipe` and a fresh scaling state of its own (scales 1, histories 0) on the
  /// weight's device. Call update_fp8_scales() once per optimizer step (amp does both for you). Throws (c10::Error)
  /// when `recipe` fails Fp8Recipe::check() or fp8_ineligibility(weight's device) is not empty.
  void enable_fp8(const Fp8Recipe& recipe);
  /// Runs the GEMMs in FP8 with the scaling state in `meta` (views into amp's state), which update_fp8_scales()
  /// then refuses to update. Throws (c10::Error) when the layer is ineligible on the weight's device, the recipe
  /// fails check(), or the history is not fp32 [3, amax_history_len] and the scales fp32 [3].
  void enable_fp8(Fp8Meta meta);
  /// Runs the layer as plain torch::nn::Linear again and drops its FP8 scaling state (fp8_meta() becomes empty).
  void disable_fp8() {
    meta_ = Fp8Meta();
    owns_state_ = false;
  }
  /// Whether the GEMMs run in FP8 (enable_fp8 called, disable_fp8 not since).
  bool fp8_enabled() const { return meta_.history.defined(); }
  /// The layer's FP8 scaling state; its tensors are undefined while FP8 is disabled.
  const Fp8Meta& fp8_meta() const { return meta_; }
  /// Standalone use (without amp): delayed scaling's once-per-step update of this layer's three scales from their
  /// histories (found_inf: a 1-element fp32 flag; nonzero leaves everything but the current amaxes as it was).
  /// Throws (c10::Error) when FP8 is disabled or the state came from enable_fp8(Fp8Meta) (amp updates that one).
  void update_fp8_scales(const at::Tensor& found_inf = at::Tensor());

  Float8LinearOptions options;  ///< the options the layer was built with
  at::Tensor weight;            ///< [out, in], registered as "weight"
  at::Tensor bias;              ///< [out], registered as "bias" (undefined with bias(false))

 private:
  Fp8Meta meta_;
  at::Tensor fp8_max_;       ///< [3] on the state's device, for update_fp8_scales (made once: no copy per step)
  bool owns_state_ = false;  ///< enable_fp8(recipe): the layer's own state, which update_fp8_scales updates
};
TORCH_MODULE(Float8Linear);

namespace detail {
/// The FP8 GEMM (a_scale * a) @ (b_scale * b) (+ bias) in `out_dtype`, a [M, K] row-major, b [K, N] column-major,
/// fp32 accumulation. CUDA: at::_scaled_mm (cuBLASLt). CPU: the exact upcast of both operands to fp32 and an fp32
/// GEMM, because LibTorch 2.11's CPU _scaled_mm is a slow reference path (docs/fp8.md); the results agree within
/// fp32 accumulation error (tested).
at::Tensor fp8_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale, const at::Tensor& b_scale,
                  const std::optional<at::Tensor>& bias, c10::ScalarType out_dtype);
/// The fp32 [rows] tensor of each row's FP8 maximum for `layers` layers under `recipe` (for fp8_update_scales_).
at::Tensor fp8_max_per_row(const Fp8Recipe& recipe, int64_t layers, const c10::Device& device);
}  // namespace detail

}  // namespace amp
