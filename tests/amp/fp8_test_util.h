#pragma once

// What the FP8 tests share: whether this machine has a GPU that runs FP8 GEMMs.

#ifdef LIBTORCH_AMP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif
#include <gtest/gtest.h>

#include "test_util.h"

namespace fp8_test {

/// A CUDA device with FP8 tensor cores (sm_89 or newer).
inline bool fp8_gpu() {
#ifdef LIBTORCH_AMP_WITH_CUDA
  if (!test_util::cuda_available()) return false;
  const auto* props = at::cuda::getCurrentDeviceProperties();
  return props->major > 8 || (props->major == 8 && props->minor >= 9);
#else
  return false;
#endif
}

}  // namespace fp8_test

#define LTA_REQUIRE_FP8_GPU()                                                                                          \
  do {                                                                                                                 \
    LTA_REQUIRE_CUDA();                                                                                                \
    if (!fp8_test::fp8_gpu()) GTEST_SKIP() << "needs a GPU with FP8 tensor cores (sm_89 or newer); this one has none"; \
  } while (0)
