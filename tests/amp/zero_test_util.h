#pragma once

// What the ZeRO tests (zero_test.cpp, zero_publish_test.cpp, zero_cuda_test.cpp) read from a trained run and compare.

#include <vector>

#include <torch/torch.h>

#include <amp/amp.h>
#include <amp/zero/zero_shard.h>

namespace zero_test {

/// Every parameter's fp32 master in slot order: gathered from all ranks' shards under ZeRO (collective), the
/// replicated masters otherwise.
inline std::vector<torch::Tensor> full_masters(amp::Optimizer& optimizer) {
  if (amp::detail::ZeroShard* zero = optimizer.state().zero()) return zero->full_masters();
  std::vector<torch::Tensor> masters;
  for (const auto& slot : optimizer.state().slots()) masters.push_back(slot.master.detach().clone());
  return masters;
}

/// Copies of the module's parameters.
inline std::vector<torch::Tensor> parameters_of(const torch::nn::Module& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net.parameters()) out.push_back(p.detach().clone());
  return out;
}

/// Same count, and each tensor equal to its counterpart bit for bit (dtype and shape included).
inline bool bit_identical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

}  // namespace zero_test
