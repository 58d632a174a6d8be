#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace ddp::detail {

// The one place where gradients enter and leave a bucket. A bucket is a contiguous 1-D tensor holding its tensors
// back to back in list order, without padding (the layout of Note [bucket layout] in kernels/flatten.h).

/// bucket[offset_i : offset_i + numel_i] = tensors[i] * scale, converting to the bucket's dtype.
/// bucket: contiguous 1-D, numel >= the sum of the tensors' numels; tensors: contiguous, on the bucket's device.
/// Host syncs: none.
void copy_into_bucket(const at::Tensor& bucket, at::TensorList tensors, double scale);

/// tensors[i] = bucket[offset_i : offset_i + numel_i] * scale, converting to each tensor's dtype. Same
/// requirements as copy_into_bucket. Host syncs: none.
void copy_from_bucket(const at::Tensor& bucket, at::TensorList tensors, double scale);

}  // namespace ddp::detail
