#pragma once

namespace kernels {

/// An fp32 scalar that a kernel reads either from memory on its device (a 1-element tensor that changes every
/// step, e.g. a loss scale: read on device, so no host sync) or by value (fixed for the call). Framework-free,
/// so it crosses into CUDA kernels and CPU twins alike.
struct ScalarArg {
  const float* device_value = nullptr;  ///< read by the kernel when not null (device memory; host memory on CPU)
  float value = 1.0f;                   ///< used when device_value is null

  /// A scalar the kernel reads from `p` (one fp32 in device memory; host memory on CPU) when it runs.
  static ScalarArg from_device(const float* p) { return ScalarArg{p, 0.0f}; }
  /// A scalar passed by value, `v`.
  static ScalarArg from_value(float v) { return ScalarArg{nullptr, v}; }
};

}  // namespace kernels
