#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace kernels {

/// Multiplies every element of every tensor in `tensors` by `scale`, in place, computing in fp32.
///
/// tensors: float32, float16 or bfloat16 (mixed dtypes allowed: grouped and launched once per dtype), any
///          shapes including empty, contiguous, all on one device (CPU or CUDA). An empty list is a no-op.
/// scale:   any finite or non-finite value; it is rounded to fp32 first.
/// CUDA: one fused launch per dtype (per 32 KB chunk table) on the current stream; never syncs the host.
/// CPU:  vectorized (at::vec) and threaded (at::parallel_for) over 64 Ki-element chunks.
void multi_tensor_scale_(at::TensorList tensors, double scale);

}  // namespace kernels
