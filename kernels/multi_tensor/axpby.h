#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace kernels {

/// Which inputs of axpby_ are checked for inf/NaN.
enum class CheckInputs { kNone, kX, kY, kBoth };

/// out[i] = a*x[i] + b*y[i] for every element of every entry, computed in fp32 as fma(a, x, b*y) and rounded
/// once to out's dtype (gradient accumulation across different scales, e.g. an fp32 accumulator plus fp16
/// grads unscaled on the fly).
///
/// out, x, y: parallel lists of equal length; entry i has the same number of elements in all three. Each
///            float32/float16/bfloat16 (mixed allowed: grouped by the (x, y, out) dtype triple, one fused launch
///            per triple), contiguous, all on one device (CPU or CUDA). out[i] may be x[i] or y[i] itself; other
///            overlaps are not supported. Empty lists are a no-op.
/// a, b:      rounded to fp32 first.
/// found_inf: optional 1-element float32 tensor on that device, set to 1.0 when a checked input holds an inf or
///            NaN; never cleared here: the caller zeroes it. Only inputs are checked (as Apex's axpby): a finite
///            result that overflows out's dtype is not flagged.
/// check:     which inputs are checked when found_inf is given. Without found_inf nothing is checked, and kX or
///            kY (a request that could not be honoured) is an error.
/// CUDA: 16-byte vector access where all three addresses of an entry are 16-byte aligned, element-wise otherwise;
/// runs on the current stream, never syncs the host. CPU: at::vec, threaded over 64 Ki-element chunks.
void axpby_(at::TensorList out, at::TensorList x, at::TensorList y, double a, double b,
            const at::Tensor& found_inf = {}, CheckInputs check = CheckInputs::kBoth);

}  // namespace kernels
