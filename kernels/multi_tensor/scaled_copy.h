#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace kernels {

/// Copies and scales, converting dtype: dst[i] = src[i] * scale for every element of every pair of tensors,
/// computed in fp32 and rounded once to dst[i]'s dtype (fp16/bf16 grads into fp32 master grads, fp32 masters
/// into fp16/bf16 model params, or fp32 into fp32).
///
/// src, dst:    parallel lists of equal length; src[i] and dst[i] have the same number of elements (shapes may
///              differ). Each float32/float16/bfloat16 (mixed allowed, per list and per entry: grouped by the
///              (src, dst) dtype pair, one fused launch per pair), contiguous, all on one device (CPU or CUDA).
///              dst[i] may be src[i] itself (an in-place scale); other overlaps are not supported. Empty lists
///              are a no-op.
/// scale:       1-element float32 tensor on that device, read on device (no host sync).
/// found_inf:   optional 1-element float32 tensor on that device, set to 1.0 when any src element or stored
///              result (including one that overflows dst's dtype) is inf or NaN; never cleared here: the caller
///              zeroes it. Undefined: nothing is checked (unless first_nonfinite_index is given).
/// first_nonfinite_index, index_offset: as in unscale_and_check_, see Note [first non-finite index] in
///              kernels/multi_tensor/unscale.h; positions are those of the src list. Recorded whether or not found_inf is given.
/// CUDA: 16-byte vector access where both addresses of an entry are 16-byte aligned, element-wise otherwise; runs
/// on the current stream, never syncs the host. CPU: at::vec, threaded over 64 Ki-element chunks.
void scaled_copy_(at::TensorList src, at::TensorList dst, const at::Tensor& scale, const at::Tensor& found_inf = {},
                  const at::Tensor& first_nonfinite_index = {}, int64_t index_offset = 0);

/// The same with a scale fixed for the call (rounded to fp32 first), passed to the kernel by value.
void scaled_copy_(at::TensorList src, at::TensorList dst, double scale, const at::Tensor& found_inf = {},
                  const at::Tensor& first_nonfinite_index = {}, int64_t index_offset = 0);

/// The tensor-scale form recording indices[i] (instead of index_offset + i) for src[i] in
/// first_nonfinite_index: for callers whose tensors are not consecutive in the index space they report in
/// (see kernels/multi_tensor/unscale.h). indices.size() must equal src.size().
void scaled_copy_(at::TensorList src, at::TensorList dst, const at::Tensor& scale, const at::Tensor& found_inf,
                  const at::Tensor& first_nonfinite_index, c10::ArrayRef<int64_t> indices);

}  // namespace kernels
