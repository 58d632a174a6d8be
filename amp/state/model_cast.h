#pragma once

#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

namespace amp {

/// Casts `module`'s floating parameters and buffers to `dtype` in place (recursively), except those of
/// BatchNorm modules when keep_batchnorm_fp32 and of LayerNorm/GroupNorm modules when keep_layernorm_fp32.
/// BatchNorm then sees half inputs with fp32 weights, which ATen's batch norm accepts on CPU and CUDA; CUDA's
/// layer_norm and group_norm do not (the weight dtype must match a half input), so amp::Model's forward runs the
/// kept LayerNorm/GroupNorm modules under a KeptNormCast.
/// Integer buffers (e.g. BatchNorm's num_batches_tracked) are left alone. Parameters keep their identity
/// (set_data), so optimizers and hooks that hold them stay valid.
void cast_model_(torch::nn::Module& module, c10::ScalarType dtype, bool keep_batchnorm_fp32, bool keep_layernorm_fp32);

/// True for BatchNorm1d/2d/3d and ddp::SyncBatchNorm modules.
bool is_batch_norm(const torch::nn::Module& module);
/// True for LayerNorm and GroupNorm modules.
bool is_layer_or_group_norm(const torch::nn::Module& module);

/// The LayerNorm and GroupNorm modules under `module` (itself included).
std::vector<std::shared_ptr<torch::nn::Module>> layer_and_group_norms(torch::nn::Module& module);

/// Note [kept norms under a model cast]
/// keep_layernorm_fp32: the LayerNorm/GroupNorm parameters stay fp32 (they, their gradients and the optimizer's
/// update), but the norm ops get a half input. LibTorch modules have no forward hooks and call the op with their
/// `weight` and `bias` members, so for the duration of a forward those members are replaced by differentiable
/// casts of the fp32 parameters to the input's half dtype: the op then gets matching dtypes on every device,
/// computes its statistics and affine in fp32 (ATen accumulates half norms in fp32) and returns half; backward
/// sends fp32 gradients to the fp32 parameters through the casts. The registered parameters are never replaced.
/// Scope guard: replaces the `weight`/`bias` members of `norms` (LayerNorm/GroupNorm modules) by casts to `dtype`
/// and restores them when it ends, also on an exception. Not thread-safe per module: one forward at a time.
class KeptNormCast {
 public:
  /// Replaces each defined `weight`/`bias` member of the LayerNorm/GroupNorm modules in `norms` that is not already
  /// `dtype` by a differentiable cast to `dtype`; other modules in `norms` are left alone. If a cast throws, restores
  /// what it replaced and rethrows.
  KeptNormCast(const std::vector<std::shared_ptr<torch::nn::Module>>& norms, c10::ScalarType dtype);
  ~KeptNormCast();
  KeptNormCast(const KeptNormCast&) = delete;
  KeptNormCast& operator=(const KeptNormCast&) = delete;

 private:
  struct Saved {
    at::Tensor* member;
    at::Tensor original;
  };
  std::vector<Saved> saved_;
};

}  // namespace amp
