#pragma once

// Helpers shared by the test binaries: dtype tolerances, GPU presence, fresh random inputs.

#include <functional>
#include <random>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace test_util {

/// True when a CUDA device can run kernels (the CUDA build of LibTorch is loaded and a GPU is present).
inline bool cuda_available() { return torch::cuda::is_available(); }

/// Skips the current test, with the reason, when no GPU is present.
#define LTA_REQUIRE_CUDA()                                                                   \
  do {                                                                                       \
    if (!::test_util::cuda_available()) GTEST_SKIP() << "needs a CUDA GPU; none is present"; \
  } while (0)

/// Relative tolerance for results stored in `dtype` after fp32 arithmetic: a couple of ulps of the type.
inline double rtol_for(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kHalf:
      return 2e-3;
    case torch::kBFloat16:
      return 1.6e-2;
    default:
      return 2e-6;
  }
}

/// A seed that differs on every run (inputs are fresh random data), printed so a failure can be replayed.
inline uint64_t fresh_seed() {
  const uint64_t seed = std::random_device{}();
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return seed;
}

/// Runs `call`, which must throw a c10::Error whose message contains `fragment`; records a failure otherwise.
inline void expect_error(const std::function<void()>& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "expected an error containing: " << fragment;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

}  // namespace test_util
