#pragma once

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

namespace amp {

/// Casts `module`'s floating parameters and buffers to `dtype` in place (recursively), except those of
/// BatchNorm modules when keep_batchnorm_fp32 and of LayerNorm/GroupNorm modules when keep_layernorm_fp32.
/// Those norm layers then see half inputs with fp32 weights, which ATen's norm kernels accept on CPU and CUDA.
/// Integer buffers (e.g. BatchNorm's num_batches_tracked) are left alone. Parameters keep their identity
/// (set_data), so optimizers and hooks that hold them stay valid.
void cast_model_(torch::nn::Module& module, c10::ScalarType dtype, bool keep_batchnorm_fp32, bool keep_layernorm_fp32);

/// True for BatchNorm1d/2d/3d and ddp::SyncBatchNorm modules.
bool is_batch_norm(const torch::nn::Module& module);
/// True for LayerNorm and GroupNorm modules.
bool is_layer_or_group_norm(const torch::nn::Module& module);

}  // namespace amp
