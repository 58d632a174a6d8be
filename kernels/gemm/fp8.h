#pragma once

// FP8 casts and scale updates (Note [FP8 scaling rules] in kernels/gemm/fp8_rule.h), CUDA kernels with CPU twins.
// Nothing here reads a value back to the host.

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

namespace kernels {

/// Largest finite value of an FP8 dtype (kFloat8_e4m3fn: 448, kFloat8_e5m2: 57344); other dtypes are an error.
float fp8_max(c10::ScalarType fp8_dtype);

/// One pass over x (fp32, fp16 or bf16; any shape, made contiguous): returns saturate(x * scale) as `fp8_dtype`
/// in x's shape, and, when `amax` is defined, raises amax to max(amax, max|x|) (a NaN in x makes it NaN).
/// scale and amax: 1-element fp32 tensors on x's device (amax may be a view into an amax history).
at::Tensor fp8_quantize(const at::Tensor& x, const at::Tensor& scale, c10::ScalarType fp8_dtype,
                        const at::Tensor& amax);

/// The cast of a 2-D tensor for FP8 GEMMs, in one pass over x [rows, cols] (fp32, fp16 or bf16, contiguous):
///   q  [rows, cols]:        saturate(x * scale)                                                   (when want_q)
///   qt [cols, padded_rows]: its transpose, zero columns appended up to padded_rows (when want_qt): the layout
///                           cuBLASLt wants for the GEMM that contracts over the rows (the weight gradient), whose
///                           inner dimension must be a multiple of 16; zeros add nothing to a product
/// and amax raised as fp8_quantize does. padded_rows >= rows. Tensors not asked for are undefined.
struct Fp8Cast {
  at::Tensor q;   ///< [rows, cols] in fp8_dtype; undefined unless want_q
  at::Tensor qt;  ///< [cols, padded_rows] in fp8_dtype, zero-padded; undefined unless want_qt
};
Fp8Cast fp8_cast_transpose(const at::Tensor& x, const at::Tensor& scale, c10::ScalarType fp8_dtype,
                           const at::Tensor& amax, int64_t padded_rows, bool want_q, bool want_qt);

/// Empty when `device` can run FP8 GEMMs (the CPU, or a CUDA GPU of compute capability 8.9 or newer), else why not.
std::string fp8_gemm_unsupported_reason(const c10::Device& device);

/// amax = max(amax, max|x|): the first pass of current scaling.
void fp8_amax_(const at::Tensor& x, const at::Tensor& amax);

/// Current scaling: scale = fp8_max * 2^-margin / amax (1 when amax is 0 or not finite), scale_inv = 1 / scale.
/// All three 1-element fp32 tensors on one device.
void fp8_current_scale_(const at::Tensor& amax, const at::Tensor& scale, const at::Tensor& scale_inv, float fp8_max,
                        int64_t margin);

/// Delayed scaling's once-per-step update of every tensor at once: history [n, L] fp32 (row i is tensor i's amax
/// history, column 0 the current step's amax), scale and scale_inv [n] fp32, fp8_max [n] fp32 (each tensor's
/// format), found_inf a 1-element fp32 flag (nonzero: the step was skipped; rows and scales stay, column 0 is
/// cleared). use_max: amax = max of the row (else its column 0). All contiguous, on one device; one launch.
void fp8_update_scales_(const at::Tensor& history, const at::Tensor& scale, const at::Tensor& scale_inv,
                        const at::Tensor& fp8_max, const at::Tensor& found_inf, int64_t margin, bool use_max);

}  // namespace kernels
