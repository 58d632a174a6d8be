#pragma once

#include <utility>

#include <ATen/core/Tensor.h>

namespace kernels {

// SyncBatchNorm's per-channel passes on the CPU (ddp/sync_batch_norm.cpp; ATen has no batch_norm_stats family
// there). `x` and `dy` are CPU tensors of shape (N, C, *) in fp32, fp16, bf16 or fp64 (made contiguous if they are
// not); per-channel arguments are (C) tensors of any floating dtype, results are (C) fp64. fp32 / fp16 / bf16 run
// on CPU twins compiled per instruction set (at::vec; values read as fp32, results rounded once), summed as
// Note [batch-norm twin sums] in kernels/cpu/batch_norm_cpu.cpp says; fp64 runs plain fp64 loops. Threaded over
// channels (sums) or (sample, channel) runs (elementwise). No temporaries of the input's size.

/// Per-channel mean and biased variance of x, in two passes (the mean, then the mean squared deviation from it).
/// N must be > 0.
std::pair<at::Tensor, at::Tensor> batch_norm_stats_cpu(const at::Tensor& x);

/// Per-channel sum(dy) and sum(dy * (x - mean)); zeros when N is 0.
std::pair<at::Tensor, at::Tensor> batch_norm_grad_sums_cpu(const at::Tensor& dy, const at::Tensor& x,
                                                           const at::Tensor& mean);

/// y = (x - mean) * scale + shift per channel (shift may be undefined: 0), in x's dtype.
at::Tensor batch_norm_normalize_cpu(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& scale,
                                    const at::Tensor& shift);

/// dx = (dy - mean_dy - (x - mean) * k) * scale per channel, in x's dtype (dy is converted to it).
at::Tensor batch_norm_input_grad_cpu(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                     const at::Tensor& mean_dy, const at::Tensor& k, const at::Tensor& scale);

}  // namespace kernels
