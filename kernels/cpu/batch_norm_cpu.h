#pragma once

#include <cstdint>

#include <kernels/dtype.h>

namespace kernels::cpu {

/// The layout the batch-norm twins read and write: a contiguous (samples, channels, inner) tensor, each channel's
/// values in `samples` runs of `inner` consecutive elements.
struct ChannelLayout {
  int64_t samples = 0;
  int64_t channels = 0;
  int64_t inner = 0;
};

/// CPU twins of SyncBatchNorm's per-channel passes (kernels/batch_norm.h has the contract; host pointers, fp32
/// per-channel arguments, fp64 per-channel results).
void batch_norm_stats(const void* x, DType dtype, ChannelLayout layout, double* mean, double* var);
void batch_norm_grad_sums(const void* dy, const void* x, DType dtype, ChannelLayout layout, const float* mean,
                          double* sum_dy, double* sum_dy_xmu);
void batch_norm_normalize(const void* x, void* y, DType dtype, ChannelLayout layout, const float* mean,
                          const float* scale, const float* shift);
void batch_norm_input_grad(const void* dy, const void* x, void* dx, DType dtype, ChannelLayout layout,
                           const float* mean, const float* mean_dy, const float* k, const float* scale);

}  // namespace kernels::cpu
