#pragma once

// Dtype dispatch for the CPU twins: the c10 storage type matching a kernels::DType.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <kernels/dtype.h>

namespace kernels::cpu {

/// Calls f(T{}) with the c10 storage type of `dtype` (float, c10::Half or c10::BFloat16).
template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat16:
      return f(c10::Half{});
    case DType::kBFloat16:
      return f(c10::BFloat16{});
  }
}

}  // namespace kernels::cpu
