#pragma once

#include <kernels/scalar_arg.h>

namespace kernels::cuda {

/// The value of `arg` as seen by a kernel: read from device memory when given there, else by value.
__device__ __forceinline__ float read_scalar(const ScalarArg& arg) {
  return arg.device_value != nullptr ? *arg.device_value : arg.value;
}

}  // namespace kernels::cuda
