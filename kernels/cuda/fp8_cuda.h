#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace kernels::cuda {

enum class Fp8In { kFloat, kHalf, kBFloat16 };

/// q[i] = saturate(x[i] * *scale) (q null: only the amax), *amax = max(*amax, max|x|) when amax is non-null.
/// e4m3: the output is Float8_e4m3fn, else Float8_e5m2.
void fp8_quantize(Fp8In in, const void* x, void* q, bool e4m3, int64_t n, const float* scale, float fp8_max,
                  float* amax, cudaStream_t stream);

/// q [rows, cols] (null: not wanted) and qt [cols, padded_rows] (null: not wanted) of x [rows, cols], tiled
/// through shared memory so that every read and write is coalesced; padding rows are left as they are (zeroed by the
/// caller). amax as fp8_quantize.
void fp8_cast_transpose(Fp8In in, const void* x, void* q, void* qt, bool e4m3, int64_t rows, int64_t cols,
                        int64_t padded_rows, const float* scale, float fp8_max, float* amax, cudaStream_t stream);

/// One thread: scale = rule(amax), scale_inv = 1 / scale (Note [FP8 scaling rules]).
void fp8_current_scale(const float* amax, float* scale, float* scale_inv, float scaled_max, cudaStream_t stream);

/// One block per tensor row: the delayed-scaling update of every row, one launch.
void fp8_update_scales(float* history, int64_t n, int64_t length, float* scale, float* scale_inv, const float* fp8_max,
                       const float* found_inf, float margin_factor, bool use_max, cudaStream_t stream);

}  // namespace kernels::cuda
