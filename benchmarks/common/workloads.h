#pragma once

// The tensor lists the multi-tensor benchmarks run on, shared so every program measures the same shapes.

#include <string>
#include <vector>

#include <torch/torch.h>

namespace bench {

struct Workload {
  std::string name;
  std::vector<int64_t> sizes;  // elements per tensor
};

/// "large": a few big tensors (full: 64 x 4 Mi elements = 1 GiB in fp32); "many-small": a transformer-like
/// parameter list (full: 5000 tensors of 1-64 Ki elements). Quick mode shrinks both to run in seconds on a CPU.
inline std::vector<Workload> standard_workloads(bool full) {
  Workload large{"large", {}};
  Workload small{"many-small", {}};
  const int64_t large_count = full ? 64 : 8;
  const int64_t large_elements = full ? (int64_t{1} << 22) : (int64_t{1} << 20);
  for (int64_t i = 0; i < large_count; ++i) large.sizes.push_back(large_elements);
  const int64_t small_count = full ? 5000 : 2000;
  const int64_t small_max_kib = full ? 64 : 8;
  constexpr int64_t kSpread = 7919;  // a prime: sizes cycle through 1..max KiB without a pattern
  for (int64_t i = 0; i < small_count; ++i) small.sizes.push_back(1024 * (1 + (i * kSpread) % small_max_kib));
  return {large, small};
}

/// Fresh random tensors of `sizes` with `dtype` on `device`; `bytes` gets their total size in bytes.
inline std::vector<torch::Tensor> make_list(const std::vector<int64_t>& sizes, torch::ScalarType dtype,
                                            const torch::Device& device, int64_t* bytes) {
  std::vector<torch::Tensor> list;
  *bytes = 0;
  for (int64_t n : sizes) {
    list.push_back(torch::randn({n}, torch::TensorOptions().dtype(dtype).device(device)));
    *bytes += n * static_cast<int64_t>(list.back().element_size());
  }
  return list;
}

inline torch::Device parse_device(const std::string& name) {
  if (name == "auto") return torch::cuda::is_available() ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  return torch::Device(name);
}

}  // namespace bench
