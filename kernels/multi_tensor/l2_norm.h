#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace kernels {

// Note [deterministic two-stage norm]
// Float atomics would make a gradient norm depend on the order in which blocks finish, so a resumed run could
// clip differently from the original. Instead every 64 Ki-element chunk of every tensor owns one slot of a
// workspace: stage 1 (one block per chunk, multi_tensor_apply) writes its chunk's sum of squares there, and
// stage 2 sums the slots in a fixed order, per tensor and in total. Slots are laid out in the caller's list
// order (tensor i owns ceil(numel_i / 65536) consecutive slots), so the result does not depend on how the
// tensors are grouped by dtype or split into launches: same inputs, same bits. Squares are formed and summed
// per thread in fp32 (a square above FLT_MAX is inf, as in torch.linalg.vector_norm on fp32), block and stage-2
// sums are fp64, and the square root is rounded to fp32 once at the end.

/// The result of l2_norm: both on the tensors' device.
struct L2NormResult {
  /// 0-dim float32: sqrt of the sum of squares of every element of every tensor.
  at::Tensor total;
  /// float32 of shape [number of tensors], the L2 norm of each tensor (0 for an empty one), in list order;
  /// undefined unless asked for.
  at::Tensor per_tensor;
};

/// L2 norm of all elements of all `tensors` (and of each tensor when `per_tensor`), computed with the
/// deterministic two-stage reduction of Note [deterministic two-stage norm]: no float atomics, bit-identical
/// results for identical inputs.
///
/// tensors:    float32/float16/bfloat16 (mixed allowed), any sizes including empty, contiguous, all on one
///             device (CPU or CUDA). An empty list gives total = 0 (a CPU tensor) and an empty per_tensor.
/// per_tensor: also return each tensor's norm.
/// inv_scale:  optional 1-element float32 tensor on the tensors' device, read on device: the norm is that of
///             tensors * inv_scale (multiplied in fp32, element by element, before squaring), e.g. the norm of
///             loss-scaled gradients as if they had been unscaled. The tensors are never modified.
/// CUDA: stage 1 is one fused launch per dtype (per chunk table), stage 2 one launch, on the current stream;
///       the workspace comes from the caching allocator and the slot table is written on the device by a launch
///       that carries it in its parameters. Never syncs the host and reads no host memory from the device, so it
///       can be captured in a CUDA graph (Note [capture-safe step] in kernels/capture.h; untested on a GPU so far).
///       Each element goes to the same thread whatever the tensor's alignment: a tensor and a misaligned view with
///       the same values give the same bits.
L2NormResult l2_norm(at::TensorList tensors, bool per_tensor = false, const at::Tensor& inv_scale = {});

/// Clips gradients in place like torch::nn::utils::clip_grad_norm_ (L2 norm), without a host sync: computes
/// the total norm on device with l2_norm, then multiplies every gradient by clip_coef = max_norm / (total + 1e-6)
/// (fp32 arithmetic) only when clip_coef < 1, decided on device. When the total norm is inf or NaN the
/// gradients are left untouched and found_inf (if given) is set to 1.
///
/// grads:     float32/float16/bfloat16 (mixed allowed), contiguous, all on one device (CPU or CUDA).
/// max_norm:  > 0 (+inf allowed: never clips); NaN, 0 and negative values are errors.
/// found_inf: optional 1-element float32 tensor on the grads' device. Set to 1.0 when the total norm is not
///            finite; never cleared here: the caller zeroes it (so it can share the flag of unscale_and_check_).
/// Returns the total norm before clipping, a 0-dim float32 tensor on the grads' device (CPU for an empty list).
/// CUDA: the l2_norm launches plus one fused scaling launch per dtype, on the current stream; never syncs the
/// host (the coefficient is read by the scaling kernel from device memory); capturable like l2_norm.
at::Tensor clip_grad_norm_(at::TensorList grads, double max_norm, const at::Tensor& found_inf = {});

}  // namespace kernels
