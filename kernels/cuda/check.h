#pragma once

#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

namespace kernels::cuda {

/// Throws std::runtime_error naming the failed call, the CUDA error and the source line. Used after every
/// launch (cudaGetLastError) and every runtime call in device-side code, which knows nothing of ATen.
inline void throw_on_error(cudaError_t status, const char* what, const char* file, int line) {
  if (status == cudaSuccess) return;
  throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(status) + " (" + file +
                           ":" + std::to_string(line) + ")");
}

}  // namespace kernels::cuda

#define LTA_CUDA_CHECK(expr) ::kernels::cuda::throw_on_error((expr), #expr, __FILE__, __LINE__)
#define LTA_CUDA_CHECK_LAUNCH(kernel_name) \
  ::kernels::cuda::throw_on_error(cudaGetLastError(), "launch of " kernel_name, __FILE__, __LINE__)
