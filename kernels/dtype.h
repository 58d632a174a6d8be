#pragma once

#include <cstdint>

namespace kernels {

/// The floating dtypes every kernel accepts. Device code and CPU twins are written against this enum, not
/// against at::ScalarType, so they stay free of ATen.
enum class DType : int8_t { kFloat32, kFloat16, kBFloat16 };

/// "float32", "float16" or "bfloat16".
const char* dtype_name(DType dtype);

}  // namespace kernels
