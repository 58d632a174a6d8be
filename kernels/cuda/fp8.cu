#include <kernels/cuda/check.h>
#include <kernels/cuda/fp8_cuda.h>
#include <kernels/gemm/fp8_rule.h>

#include <algorithm>
#include <stdexcept>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

namespace kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

// Grid-stride cast with a block-wide amax: one atomicMax per block on the amax slot's bits (Note [FP8 scaling
// rules]: the bits of |x| order as the floats, NaN above +inf). The conversion is c10's, as the CPU twin's.
template <typename In, typename Out>
__global__ void fp8_quantize_kernel(const In* x, Out* q, int64_t n, const float* scale, float fp8_max, float* amax) {
  __shared__ uint32_t block_key[kThreads];
  const float s = scale != nullptr ? *scale : 1.0f;
  uint32_t key = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = static_cast<float>(x[i]);
    key = max(key, fp8_amax_key(v));
    if (q != nullptr) q[i] = Out(fp8_saturate(v * s, fp8_max));
  }
  if (amax == nullptr) return;
  block_key[threadIdx.x] = key;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) block_key[threadIdx.x] = max(block_key[threadIdx.x], block_key[threadIdx.x + stride]);
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), block_key[0]);
}

template <typename In>
void launch_quantize(const void* x, void* q, bool e4m3, int64_t n, const float* scale, float fp8_max, float* amax,
                     cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
  const In* in = static_cast<const In*>(x);
  if (e4m3) {
    fp8_quantize_kernel<In, c10::Float8_e4m3fn>
        <<<blocks, kThreads, 0, stream>>>(in, static_cast<c10::Float8_e4m3fn*>(q), n, scale, fp8_max, amax);
  } else {
    fp8_quantize_kernel<In, c10::Float8_e5m2>
        <<<blocks, kThreads, 0, stream>>>(in, static_cast<c10::Float8_e5m2*>(q), n, scale, fp8_max, amax);
  }
  LTA_CUDA_CHECK_LAUNCH("fp8_quantize_kernel");
}

constexpr int kTile = 32;
constexpr int kTileRows = 8;  // a 32 x 8 block walks its 32 x 32 tile in 4 passes

// One 32 x 32 tile of x per block: read coalesced along rows, written to q along rows and, through shared memory,
// to qt along its rows (the columns of x).
template <typename In, typename Out>
__global__ void fp8_cast_transpose_kernel(const In* x, Out* q, uint8_t* qt, int64_t rows, int64_t cols,
                                          int64_t padded_rows, const float* scale, float fp8_max, float* amax) {
  __shared__ uint8_t tile[kTile][kTile + 1];
  __shared__ uint32_t block_key[kTile * kTileRows];
  const float s = *scale;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  uint32_t key = 0;
  for (int64_t tile_row = blockIdx.y; tile_row < row_tiles; tile_row += gridDim.y) {  // grids stop at 65535 in y
    const int64_t r0 = tile_row * kTile;
    for (int j = threadIdx.y; j < kTile; j += kTileRows) {
      const int64_t r = r0 + j, c = c0 + threadIdx.x;
      if (r < rows && c < cols) {
        const float v = static_cast<float>(x[r * cols + c]);
        key = max(key, fp8_amax_key(v));
        const Out o(fp8_saturate(v * s, fp8_max));
        if (q != nullptr) q[r * cols + c] = o;
        tile[j][threadIdx.x] = o.x;
      }
    }
    if (qt != nullptr) {
      __syncthreads();
      for (int j = threadIdx.y; j < kTile; j += kTileRows) {
        const int64_t c = c0 + j, r = r0 + threadIdx.x;
        if (r < rows && c < cols) qt[c * padded_rows + r] = tile[threadIdx.x][j];
      }
      __syncthreads();  // the tile is rewritten by the next row of tiles
    }
  }
  if (amax == nullptr) return;
  const int t = threadIdx.y * kTile + threadIdx.x;
  block_key[t] = key;
  __syncthreads();
  for (int stride = kTile * kTileRows / 2; stride > 0; stride /= 2) {
    if (t < stride) block_key[t] = max(block_key[t], block_key[t + stride]);
    __syncthreads();
  }
  if (t == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), block_key[0]);
}

template <typename In>
void launch_cast_transpose(const void* x, void* q, void* qt, bool e4m3, int64_t rows, int64_t cols, int64_t padded_rows,
                           const float* scale, float fp8_max, float* amax, cudaStream_t stream) {
  constexpr int64_t kMaxGridY = 65535;
  const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile),
                  static_cast<unsigned>(std::min<int64_t>((rows + kTile - 1) / kTile, kMaxGridY)));
  const dim3 block(kTile, kTileRows);
  const In* in = static_cast<const In*>(x);
  uint8_t* t = static_cast<uint8_t*>(qt);
  if (e4m3) {
    fp8_cast_transpose_kernel<In, c10::Float8_e4m3fn><<<grid, block, 0, stream>>>(
        in, static_cast<c10::Float8_e4m3fn*>(q), t, rows, cols, padded_rows, scale, fp8_max, amax);
  } else {
    fp8_cast_transpose_kernel<In, c10::Float8_e5m2><<<grid, block, 0, stream>>>(
        in, static_cast<c10::Float8_e5m2*>(q), t, rows, cols, padded_rows, scale, fp8_max, amax);
  }
  LTA_CUDA_CHECK_LAUNCH("fp8_cast_transpose_kernel");
}

__global__ void fp8_current_scale_kernel(const float* amax, float* scale, float* scale_inv, float scaled_max) {
  const float s = fp8_scale_from_amax(*amax, scaled_max, 1.0f);
  *scale = s;
  *scale_inv = 1.0f / s;
}

// One block per tensor row (Note [FP8 scaling rules]): the row is rolled in chunks of the block's width, each
// thread reading old[i + 1] and, after the barrier, writing new[i] (chunk k reads indices above those chunk k
// writes, and those chunk k + 1 writes were read in chunk k), while the block reduces the amax; thread 0 then
// computes the scale. The arithmetic is the CPU twin's (fp8_update_row), so both give the same bits.
constexpr int kRowThreads = 256;

__global__ void fp8_update_scales_kernel(float* history, int64_t length, float* scale, float* scale_inv,
                                         const float* fp8_max, const float* found_inf, float margin_factor,
                                         bool use_max) {
  __shared__ float block_max[kRowThreads];
  float* row = history + blockIdx.x * length;
  const float current = row[0];
  if (*found_inf != 0.0f) {  // a skipped step: only the current slot is cleared
    if (threadIdx.x == 0) row[0] = 0.0f;
    return;
  }
  __syncthreads();  // every thread has read row[0] before chunk 0 rewrites it
  float amax = current;
  for (int64_t offset = 0; offset < length; offset += kRowThreads) {
    const int64_t i = offset + threadIdx.x;
    float value = 0.0f;
    if (i < length) {
      value = i + 1 < length ? row[i + 1] : current;
      if (value > amax) amax = value;
    }
    __syncthreads();
    if (i < length) row[i] = i > 0 ? value : 0.0f;
  }
  block_max[threadIdx.x] = amax;
  __syncthreads();
  for (int stride = kRowThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride && block_max[threadIdx.x + stride] > block_max[threadIdx.x]) {
      block_max[threadIdx.x] = block_max[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const float s =
        fp8_scale_from_amax(use_max ? block_max[0] : current, fp8_max[blockIdx.x] * margin_factor, scale[blockIdx.x]);
    scale[blockIdx.x] = s;
    scale_inv[blockIdx.x] = 1.0f / s;
  }
}

}  // namespace

void fp8_quantize(Fp8In in, const void* x, void* q, bool e4m3, int64_t n, const float* scale, float fp8_max,
                  float* amax, cudaStream_t stream) {
  switch (in) {
    case Fp8In::kFloat:
      launch_quantize<float>(x, q, e4m3, n, scale, fp8_max, amax, stream);
      break;
    case Fp8In::kHalf:
      launch_quantize<c10::Half>(x, q, e4m3, n, scale, fp8_max, amax, stream);
      break;
    case Fp8In::kBFloat16:
      launch_quantize<c10::BFloat16>(x, q, e4m3, n, scale, fp8_max, amax, stream);
      break;
  }
}

void fp8_cast_transpose(Fp8In in, const void* x, void* q, void* qt, bool e4m3, int64_t rows, int64_t cols,
                        int64_t padded_rows, const float* scale, float fp8_max, float* amax, cudaStream_t stream) {
  switch (in) {
    case Fp8In::kFloat:
      launch_cast_transpose<float>(x, q, qt, e4m3, rows, cols, padded_rows, scale, fp8_max, amax, stream);
      break;
    case Fp8In::kHalf:
      launch_cast_transpose<c10::Half>(x, q, qt, e4m3, rows, cols, padded_rows, scale, fp8_max, amax, stream);
      break;
    case Fp8In::kBFloat16:
      launch_cast_transpose<c10::BFloat16>(x, q, qt, e4m3, rows, cols, padded_rows, scale, fp8_max, amax, stream);
      break;
  }
}

void fp8_current_scale(const float* amax, float* scale, float* scale_inv, float scaled_max, cudaStream_t stream) {
  fp8_current_scale_kernel<<<1, 1, 0, stream>>>(amax, scale, scale_inv, scaled_max);
  LTA_CUDA_CHECK_LAUNCH("fp8_current_scale_kernel");
}

void fp8_update_scales(float* history, int64_t n, int64_t length, float* scale, float* scale_inv, const float* fp8_max,
                       const float* found_inf, float margin_factor, bool use_max, cudaStream_t stream) {
  constexpr int64_t kMaxBlocks = 2147483647;  // grid x limit: far more tensors than any model has
  if (n > kMaxBlocks) throw std::runtime_error("fp8_update_scales: too many tensors for one launch");
  fp8_update_scales_kernel<<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(
      history, length, scale, scale_inv, fp8_max, found_inf, margin_factor, use_max);
  LTA_CUDA_CHECK_LAUNCH("fp8_update_scales_kernel");
}

}  // namespace kernels::cuda
