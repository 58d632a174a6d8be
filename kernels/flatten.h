#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace kernels {

// Note [bucket layout]
// A gradient bucket is one contiguous 1-D tensor holding its tensors back to back in list order, with no
// padding: tensor i occupies bucket[offset_i, offset_i + numel_i) where offset_i is the sum of the numels
// before it. Offsets need not be 16-byte aligned; misaligned entries take the element-wise path (slower).
// Elements of the bucket past the last tensor are left untouched.

/// Copies `tensors` into `bucket` as laid out in Note [bucket layout]: bucket[offset_i + k] =
/// tensors[i][k] * scale, computed in fp32 and rounded once to the bucket's dtype. One fused launch per tensor
/// dtype present.
///
/// bucket:  contiguous 1-D float32/float16/bfloat16 tensor; numel() >= the sum of the tensors' numels.
/// tensors: float32/float16/bfloat16 (mixed allowed), contiguous, any shapes, on the bucket's device (CPU or
///          CUDA); must not overlap the bucket. An empty list is a no-op.
/// scale:   rounded to fp32 first (e.g. 1/world_size to pre-divide an allreduce sum).
/// No non-finite check; CUDA: on the current stream, never syncs the host.
void flatten_into_(const at::Tensor& bucket, at::TensorList tensors, double scale = 1.0);

/// The inverse of flatten_into_: tensors[i] = bucket[offset_i : offset_i + numel_i] * scale (reshaped to
/// tensors[i]'s shape), converting to each tensor's dtype. Same requirements as flatten_into_.
void unflatten_from_(const at::Tensor& bucket, at::TensorList tensors, double scale = 1.0);

}  // namespace kernels
