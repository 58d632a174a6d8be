#pragma once

// Where an ATen-facing entry point hands over to a CPU twin or a CUDA implementation.

#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace kernels {

#ifdef LIBTORCH_AMP_WITH_CUDA
using CudaStreamHandle = cudaStream_t;
#else
using CudaStreamHandle = void*;
#endif

/// Runs cpu_fn() when `device` is the CPU; for a CUDA device makes it current and runs cuda_fn(stream) with
/// the caller's current stream of that device. Any other device, or CUDA in a CPU-only build, is an error
/// naming the device. Wrap the CUDA call in `#ifdef LIBTORCH_AMP_WITH_CUDA` inside cuda_fn.
template <typename CpuFn, typename CudaFn>
void on_device(const c10::Device& device, CpuFn&& cpu_fn, CudaFn&& cuda_fn) {
  if (device.is_cpu()) {
    cpu_fn();
    return;
  }
#ifdef LIBTORCH_AMP_WITH_CUDA
  TORCH_CHECK(device.is_cuda(), "tensors must be on CPU or CUDA, got ", device);
  const c10::cuda::CUDAGuard guard(device);
  cuda_fn(c10::cuda::getCurrentCUDAStream(device.index()).stream());
#else
  (void)cuda_fn;
  TORCH_CHECK(false, "tensors are on ", device, " but libtorch_amp was built without CUDA (LIBTORCH_AMP_CUDA=OFF)");
#endif
}

}  // namespace kernels
