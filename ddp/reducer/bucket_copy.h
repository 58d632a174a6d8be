#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace ddp::detail {

// The one place where gradients enter and leave a bucket. A bucket is a contiguous 1-D tensor holding its tensors
// back to back in list order, without padding (the layout of Note [bucket layout] in kernels/flatten.h).

/// Whether the bucket and its tensors take the fused kernels (kernels::flatten_into_ / unflatten_from_ and the
/// multi-tensor family: fp32/fp16/bf16, contiguous): one launch per dtype group for the whole bucket. Anything else
/// (integer buffers such as BatchNorm's num_batches_tracked, non-contiguous gradients) is copied tensor by tensor.
bool fusable(const at::Tensor& bucket, at::TensorList tensors);

/// bucket[offset_i : offset_i + numel_i] = tensors[i] * scale, converting to the bucket's dtype.
/// bucket: contiguous 1-D, numel >= the sum of the tensors' numels; tensors: contiguous, on the bucket's device.
/// Host syncs: none.
void copy_into_bucket(const at::Tensor& bucket, at::TensorList tensors, double scale);

/// tensors[i] = bucket[offset_i : offset_i + numel_i] * scale, converting to each tensor's dtype. Same
/// requirements as copy_into_bucket. Host syncs: none.
void copy_from_bucket(const at::Tensor& bucket, at::TensorList tensors, double scale);

}  // namespace ddp::detail
