#pragma once

// Note [FP8 scaling rules]: the per-tensor rules of FP8 training, compiled into the CPU twins and the CUDA kernels
// from one definition (kernels/gemm/fp8.h is the ATen-facing side).
//
// A tensor x is stored in FP8 as q = saturate(x * scale) and read back as q * scale_inv (scale_inv = 1 / scale).
// saturate clamps to +-fp8_max (E4M3: 448, E5M2: 57344) and keeps NaN, as Transformer Engine's "satfinite" casts.
//
// Delayed scaling (Transformer Engine's DelayedScaling): each tensor has an amax history of length L (a row of
// L floats). Column 0 holds the current step's amax (the casts max their |x| into it); once per step
//   amax   = max(row)            (kMax, the default)  or  row[0]  (kMostRecent)
//   row    = roll(row, -1); row[0] = 0     (the current amax becomes the newest entry, at L-1; the oldest goes)
//   scale  = fp8_max * 2^-margin / amax   when amax is finite and > 0, else the previous scale
//            (an amax so small that this overflows fp32 gives the largest finite float)
// A skipped step (found_inf) leaves the row and the scale as they were and clears only column 0: a non-finite
// amax never enters the history.
//
// Current scaling: scale = fp8_max * 2^-margin / amax(x) of the tensor being cast (one extra pass), 1 when that
// amax is 0 or not finite.

#include <cstdint>
#include <cstring>

#include <kernels/host_device.h>

namespace kernels {

inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr float kFp8E5M2Max = 57344.0f;
inline constexpr float kFloatMax = 3.402823466e+38f;

/// |x| as an ordered key: for non-negative floats (and +NaN, whose key exceeds +inf's) the integer order of the
/// bits is the float order, so an amax is a max over keys and a NaN anywhere wins.
LTA_HOST_DEVICE inline uint32_t fp8_amax_key(float x) {
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
#endif
  return bits & 0x7fffffffu;
}

LTA_HOST_DEVICE inline float fp8_amax_value(uint32_t key) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(key);
#else
  float x;
  std::memcpy(&x, &key, sizeof(x));
  return x;
#endif
}

/// x clamped to [-fp8_max, fp8_max]; NaN stays NaN.
LTA_HOST_DEVICE inline float fp8_saturate(float x, float fp8_max) {
  if (x > fp8_max) return fp8_max;
  if (x < -fp8_max) return -fp8_max;
  return x;
}

/// scale = scaled_max / amax for a finite amax > 0, else `fallback`; an fp32 overflow gives the largest float.
LTA_HOST_DEVICE inline float fp8_scale_from_amax(float amax, float scaled_max, float fallback) {
  if (!(amax > 0.0f && amax <= kFloatMax)) return fallback;  // 0, negative, inf or NaN
  const float scale = scaled_max / amax;
  return scale > kFloatMax ? kFloatMax : scale;
}

/// Delayed scaling's once-per-step update of one tensor (see the Note): `row` has `length` entries.
LTA_HOST_DEVICE inline void fp8_update_row(float* row, int64_t length, float* scale, float* scale_inv, float scaled_max,
                                           bool use_max, bool skip) {
  const float current = row[0];
  if (skip) {
    row[0] = 0.0f;
    return;
  }
  float amax = current;
  for (int64_t i = 0; i + 1 < length; ++i) {
    const float next = row[i + 1];
    if (next > amax) amax = next;
    row[i] = next;
  }
  row[length - 1] = current;
  row[0] = 0.0f;  ///< the oldest entry (length > 1) or the current one (length 1) leaves
  if (!use_max) amax = current;
  const float s = fp8_scale_from_amax(amax, scaled_max, *scale);
  *scale = s;
  *scale_inv = 1.0f / s;
}

}  // namespace kernels
