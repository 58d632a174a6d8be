#pragma once

// Helpers shared by the scaled-copy, axpby and flatten tests.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <kernels/pointer_lists.h>

#include "test_util.h"

namespace copy_test {

/// Sizes that exercise the chunking: empty, single element, odd, one chunk (65536) plus or minus one, several.
inline const std::vector<int64_t> kSizes = {0, 1, 7, 1001, 65535, 65536, 65537, 3 * 65536 + 5};

/// Many tensors of 1..64 elements (more than one CUDA launch's table holds).
inline std::vector<int64_t> tiny_sizes(int count) {
  std::vector<int64_t> sizes;
  for (int i = 0; i < count; ++i) sizes.push_back(1 + (i * 37) % 64);
  return sizes;
}

template <typename T>
torch::ScalarType dtype_of() {
  return c10::CppTypeToScalarType<T>::value;
}

/// Fresh random values (never zeros), stored in `dtype`.
inline torch::Tensor random_tensor(int64_t n, torch::ScalarType dtype, torch::Generator& gen,
                                   const torch::Device& device = torch::kCPU) {
  return torch::randn({n}, gen).to(dtype).to(device);
}

inline std::vector<torch::Tensor> random_list(const std::vector<int64_t>& sizes, torch::ScalarType dtype,
                                              torch::Generator& gen, const torch::Device& device = torch::kCPU) {
  std::vector<torch::Tensor> list;
  for (int64_t n : sizes) list.push_back(random_tensor(n, dtype, gen, device));
  return list;
}

inline std::vector<torch::Tensor> to_device(const std::vector<torch::Tensor>& list, const torch::Device& device) {
  std::vector<torch::Tensor> out;
  for (const auto& t : list) out.push_back(t.to(device));
  return out;
}

inline std::vector<torch::Tensor> clones(const std::vector<torch::Tensor>& list) {
  std::vector<torch::Tensor> out;
  for (const auto& t : list) out.push_back(t.clone());
  return out;
}

/// Expects |actual - expected| <= atol + rtol * |expected| element-wise (compared in fp64).
inline void expect_close(const torch::Tensor& actual, const torch::Tensor& expected, double rtol,
                         const std::string& what, double atol = 0.0) {
  ASSERT_EQ(actual.numel(), expected.numel()) << what;
  const auto a = actual.cpu().to(torch::kFloat64).reshape({-1});
  const auto e = expected.cpu().to(torch::kFloat64).reshape({-1});
  EXPECT_TRUE(torch::allclose(a, e, rtol, atol))
      << what << ": " << actual.numel() << " elements of " << actual.scalar_type() << ", max abs error "
      << (a - e).abs().max().item<double>();
}

/// fp16's smallest subnormal, 2^-24: values that pass through fp16 can be off by it where they are tiny.
constexpr double kHalfSmallestSubnormal = 5.960464477539063e-08;

/// Tensors compare bit for bit (CUDA vs CPU twin).
inline void expect_identical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i].cpu(), b[i].cpu())) << "tensor " << i << " differs between CUDA and CPU";
  }
}

/// A clean found_inf flag and first-non-finite index on `device`.
inline torch::Tensor zero_flag(const torch::Device& device = torch::kCPU) {
  return torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat32).device(device));
}
inline torch::Tensor no_index(const torch::Device& device = torch::kCPU) {
  return torch::full({1}, kernels::kNoNonFiniteIndex, torch::TensorOptions().dtype(torch::kInt32).device(device));
}

using test_util::expect_error;

}  // namespace copy_test
