#include <kernels/gemm/fp8.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <kernels/cpu/parallel.h>
#include <kernels/device_call.h>
#include <kernels/gemm/fp8_rule.h>
#include <kernels/tensor_lists.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>

#include <kernels/cuda/fp8_cuda.h>
#endif

namespace kernels {
namespace {

constexpr int64_t kGrain = 1 << 15;

void check_input(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.defined(), what, ": the tensor to cast is undefined");
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16, what,
              ": can cast fp32, fp16 or bf16 tensors to FP8, got ", t);
}

void raise_amax(std::atomic<uint32_t>& key, uint32_t local) {
  uint32_t seen = key.load();
  while (local > seen && !key.compare_exchange_weak(seen, local)) {
  }
}

/// The CPU twin of the cast: q[i] = saturate(x[i] * scale); returns max key of |x|.
template <typename In, typename Out>
uint32_t quantize_cpu(const In* x, Out* q, int64_t n, float scale, float fp8_max) {
  std::atomic<uint32_t> key{0};
  ::kernels::cpu::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    uint32_t local = 0;
    for (int64_t i = begin; i < end; ++i) {
      const float v = static_cast<float>(x[i]);
      const uint32_t k = fp8_amax_key(v);
      if (k > local) local = k;
      if (q != nullptr) q[i] = Out(fp8_saturate(v * scale, fp8_max));
    }
    raise_amax(key, local);
  });
  return key.load();
}

template <typename In>
uint32_t quantize_cpu_to(const In* x, void* q, c10::ScalarType fp8_dtype, int64_t n, float scale) {
  if (fp8_dtype == at::kFloat8_e4m3fn)
    return quantize_cpu(x, static_cast<c10::Float8_e4m3fn*>(q), n, scale, kFp8E4M3Max);
  return quantize_cpu(x, static_cast<c10::Float8_e5m2*>(q), n, scale, kFp8E5M2Max);
}

uint32_t quantize_cpu_any(const at::Tensor& x, void* q, c10::ScalarType fp8_dtype, float scale) {
  const int64_t n = x.numel();
  switch (x.scalar_type()) {
    case at::kFloat:
      return quantize_cpu_to(x.const_data_ptr<float>(), q, fp8_dtype, n, scale);
    case at::kHalf:
      return quantize_cpu_to(x.const_data_ptr<c10::Half>(), q, fp8_dtype, n, scale);
    default:
      return quantize_cpu_to(x.const_data_ptr<c10::BFloat16>(), q, fp8_dtype, n, scale);
  }
}

constexpr int64_t kTile = 32;

/// The CPU twin of the cast-transpose: row tiles in parallel, kTile x kTile blocks so that both writes stay local.
template <typename In, typename Out>
uint32_t cast_transpose_cpu(const In* x, Out* q, Out* qt, int64_t rows, int64_t cols, int64_t padded_rows, float scale,
                            float fp8_max) {
  std::atomic<uint32_t> key{0};
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  ::kernels::cpu::parallel_for(0, row_tiles, std::max<int64_t>(1, kGrain / (kTile * std::max<int64_t>(cols, 1))),
                               [&](int64_t first, int64_t last) {
                                 uint32_t local = 0;
                                 for (int64_t tile = first; tile < last; ++tile) {
                                   const int64_t r0 = tile * kTile, r1 = std::min(rows, r0 + kTile);
                                   for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
                                     const int64_t c1 = std::min(cols, c0 + kTile);
                                     for (int64_t r = r0; r < r1; ++r) {
                                       for (int64_t c = c0; c < c1; ++c) {
                                         const float v = static_cast<float>(x[r * cols + c]);
                                         const uint32_t k = fp8_amax_key(v);
                                         if (k > local) local = k;
                                         const Out o(fp8_saturate(v * scale, fp8_max));
                                         if (q != nullptr) q[r * cols + c] = o;
                                         if (qt != nullptr) qt[c * padded_rows + r] = o;
                                       }
                                     }
                                   }
                                 }
                                 raise_amax(key, local);
                               });
  return key.load();
}

template <typename In>
uint32_t cast_transpose_cpu_to(const In* x, void* q, void* qt, c10::ScalarType fp8_dtype, int64_t rows, int64_t cols,
                               int64_t padded_rows, float scale) {
  if (fp8_dtype == at::kFloat8_e4m3fn) {
    return cast_transpose_cpu(x, static_cast<c10::Float8_e4m3fn*>(q), static_cast<c10::Float8_e4m3fn*>(qt), rows, cols,
                              padded_rows, scale, kFp8E4M3Max);
  }
  return cast_transpose_cpu(x, static_cast<c10::Float8_e5m2*>(q), static_cast<c10::Float8_e5m2*>(qt), rows, cols,
                            padded_rows, scale, kFp8E5M2Max);
}

void store_amax_cpu(const at::Tensor& amax, uint32_t key) {
  float* slot = amax.data_ptr<float>();
  if (key > fp8_amax_key(*slot) || std::isnan(fp8_amax_value(key))) *slot = fp8_amax_value(key);
}

#ifdef LIBTORCH_AMP_WITH_CUDA
cuda::Fp8In cuda_input(c10::ScalarType t) {
  return t == at::kFloat ? cuda::Fp8In::kFloat : t == at::kHalf ? cuda::Fp8In::kHalf : cuda::Fp8In::kBFloat16;
}
#endif

}  // namespace

float fp8_max(c10::ScalarType fp8_dtype) {
  if (fp8_dtype == at::kFloat8_e4m3fn) return kFp8E4M3Max;
  if (fp8_dtype == at::kFloat8_e5m2) return kFp8E5M2Max;
  TORCH_CHECK(false, "FP8 dtype must be Float8_e4m3fn or Float8_e5m2, got ", fp8_dtype);
}

at::Tensor fp8_quantize(const at::Tensor& x_in, const at::Tensor& scale, c10::ScalarType fp8_dtype,
                        const at::Tensor& amax) {
  check_input(x_in, "fp8_quantize");
  const float max = fp8_max(fp8_dtype);
  const c10::Device device = x_in.device();
  check_scalar_tensor(scale, "scale", device, at::kFloat);
  if (amax.defined()) check_scalar_tensor(amax, "amax", device, at::kFloat);
  const at::Tensor x = x_in.contiguous();
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(fp8_dtype));
  if (x.numel() == 0) return q;
  on_device(
      device,
      [&] {
        const uint32_t key = quantize_cpu_any(x, q.data_ptr(), fp8_dtype, *scale.const_data_ptr<float>());
        if (amax.defined()) store_amax_cpu(amax, key);
      },
      [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
        cuda::fp8_quantize(cuda_input(x.scalar_type()), x.const_data_ptr(), q.data_ptr(),
                           fp8_dtype == at::kFloat8_e4m3fn, x.numel(), scale.const_data_ptr<float>(), max,
                           amax.defined() ? amax.data_ptr<float>() : nullptr, stream);
#endif
      });
  (void)max;
  return q;
}

Fp8Cast fp8_cast_transpose(const at::Tensor& x, const at::Tensor& scale, c10::ScalarType fp8_dtype,
                           const at::Tensor& amax, int64_t padded_rows, bool want_q, bool want_qt) {
  check_input(x, "fp8_cast_transpose");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "fp8_cast_transpose: x must be a contiguous 2-D tensor, got sizes ",
              x.sizes(), x.is_contiguous() ? "" : " (not contiguous)");
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(padded_rows >= rows, "fp8_cast_transpose: padded_rows ", padded_rows, " < rows ", rows);
  const float max = fp8_max(fp8_dtype);
  const c10::Device device = x.device();
  check_scalar_tensor(scale, "scale", device, at::kFloat);
  if (amax.defined()) check_scalar_tensor(amax, "amax", device, at::kFloat);
  // qt's padding is zero-filled here (one memset); the kernels write the rows of x only.
  const auto opts = x.options().dtype(fp8_dtype);
  Fp8Cast out;
  if (want_q) out.q = at::empty({rows, cols}, opts);
  if (want_qt) {
    out.qt = padded_rows == rows ? at::empty({cols, padded_rows}, opts)
                                 : at::zeros({cols, padded_rows}, opts.dtype(at::kByte)).view(fp8_dtype);
  }
  if (x.numel() == 0) return out;
  void* q = want_q ? out.q.data_ptr() : nullptr;
  void* qt = want_qt ? out.qt.data_ptr() : nullptr;
  on_device(
      device,
      [&] {
        const float s = *scale.const_data_ptr<float>();
        uint32_t key = 0;
        switch (x.scalar_type()) {
          case at::kFloat:
            key = cast_transpose_cpu_to(x.const_data_ptr<float>(), q, qt, fp8_dtype, rows, cols, padded_rows, s);
            break;
          case at::kHalf:
            key = cast_transpose_cpu_to(x.const_data_ptr<c10::Half>(), q, qt, fp8_dtype, rows, cols, padded_rows, s);
            break;
          default:
            key =
                cast_transpose_cpu_to(x.const_data_ptr<c10::BFloat16>(), q, qt, fp8_dtype, rows, cols, padded_rows, s);
        }
        if (amax.defined()) store_amax_cpu(amax, key);
      },
      [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
        cuda::fp8_cast_transpose(
            cuda_input(x.scalar_type()), x.const_data_ptr(), q, qt, fp8_dtype == at::kFloat8_e4m3fn, rows, cols,
            padded_rows, scale.const_data_ptr<float>(), max, amax.defined() ? amax.data_ptr<float>() : nullptr, stream);
#endif
      });
  (void)max;
  return out;
}

std::string fp8_gemm_unsupported_reason(const c10::Device& device) {
  if (device.is_cpu()) return "";
#ifdef LIBTORCH_AMP_WITH_CUDA
  if (device.is_cuda()) {
    const cudaDeviceProp* props =
        at::cuda::getDeviceProperties(device.has_index() ? device.index() : c10::cuda::current_device());
    if (props->major > 8 || (props->major == 8 && props->minor >= 9)) return "";
    return "this GPU (" + std::string(props->name) + ", sm_" + std::to_string(props->major) +
           std::to_string(props->minor) + ") has no FP8 tensor cores; FP8 GEMMs need sm_89 (Ada) or newer";
  }
#endif
  return "FP8 GEMMs run on the CPU or on CUDA GPUs, not on " + device.str();
}

void fp8_amax_(const at::Tensor& x_in, const at::Tensor& amax) {
  check_input(x_in, "fp8_amax_");
  const c10::Device device = x_in.device();
  check_scalar_tensor(amax, "amax", device, at::kFloat);
  const at::Tensor x = x_in.contiguous();
  if (x.numel() == 0) return;
  on_device(
      device, [&] { store_amax_cpu(amax, quantize_cpu_any(x, nullptr, at::kFloat8_e4m3fn, 1.0f)); },
      [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
        cuda::fp8_quantize(cuda_input(x.scalar_type()), x.const_data_ptr(), nullptr, true, x.numel(), nullptr,
                           kFp8E4M3Max, amax.data_ptr<float>(), stream);
#endif
      });
}

void fp8_current_scale_(const at::Tensor& amax, const at::Tensor& scale, const at::Tensor& scale_inv, float fp8_max,
                        int64_t margin) {
  TORCH_CHECK(amax.defined(), "fp8_current_scale_: amax is undefined");
  const c10::Device device = amax.device();
  check_scalar_tensor(amax, "amax", device, at::kFloat);
  check_scalar_tensor(scale, "scale", device, at::kFloat);
  check_scalar_tensor(scale_inv, "scale_inv", device, at::kFloat);
  TORCH_CHECK(margin >= 0 && margin < 64, "FP8 margin must be in [0, 63], got ", margin);
  const float scaled_max = std::ldexp(fp8_max, -static_cast<int>(margin));
  on_device(
      device,
      [&] {
        const float s = fp8_scale_from_amax(*amax.const_data_ptr<float>(), scaled_max, 1.0f);
        *scale.data_ptr<float>() = s;
        *scale_inv.data_ptr<float>() = 1.0f / s;
      },
      [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
        cuda::fp8_current_scale(amax.const_data_ptr<float>(), scale.data_ptr<float>(), scale_inv.data_ptr<float>(),
                                scaled_max, stream);
#endif
      });
}

void fp8_update_scales_(const at::Tensor& history, const at::Tensor& scale, const at::Tensor& scale_inv,
                        const at::Tensor& fp8_max, const at::Tensor& found_inf, int64_t margin, bool use_max) {
  TORCH_CHECK(history.defined() && history.dim() == 2 && history.scalar_type() == at::kFloat &&
                  history.is_contiguous() && history.size(1) >= 1,
              "fp8_update_scales_: history must be a contiguous [n, L] fp32 tensor with L >= 1");
  const c10::Device device = history.device();
  const int64_t n = history.size(0);
  const int64_t length = history.size(1);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>(scale, "scale"),
                                std::pair<const at::Tensor&, const char*>(scale_inv, "scale_inv"),
                                std::pair<const at::Tensor&, const char*>(fp8_max, "fp8_max")}) {
    TORCH_CHECK(
        t.defined() && t.numel() == n && t.scalar_type() == at::kFloat && t.is_contiguous() && t.device() == device,
        "fp8_update_scales_: ", name, " must be a contiguous fp32 tensor of ", n, " elements on ", device);
  }
  check_flag_tensor(found_inf, "found_inf", device);
  TORCH_CHECK(margin >= 0 && margin < 64, "FP8 margin must be in [0, 63], got ", margin);
  const float factor = std::ldexp(1.0f, -static_cast<int>(margin));
  if (n == 0) return;
  on_device(
      device,
      [&] {
        float* h = history.data_ptr<float>();
        float* s = scale.data_ptr<float>();
        float* si = scale_inv.data_ptr<float>();
        const float* m = fp8_max.const_data_ptr<float>();
        const bool skip = *found_inf.const_data_ptr<float>() != 0.0f;
        for (int64_t i = 0; i < n; ++i)
          fp8_update_row(h + i * length, length, s + i, si + i, m[i] * factor, use_max, skip);
      },
      [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
        cuda::fp8_update_scales(history.data_ptr<float>(), n, length, scale.data_ptr<float>(),
                                scale_inv.data_ptr<float>(), fp8_max.const_data_ptr<float>(),
                                found_inf.const_data_ptr<float>(), factor, use_max, stream);
#endif
      });
}

}  // namespace kernels
