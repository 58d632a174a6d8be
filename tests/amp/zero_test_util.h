#pragma once

// What the ZeRO tests (zero_test.cpp, zero_checkpoint_test.cpp, zero_publish_test.cpp, zero_cuda_test.cpp) share: a
// small model and its optimizers, and what they read from a trained run and compare.

#include <memory>
#include <vector>

#include <torch/torch.h>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <amp/zero/zero_shard.h>

namespace zero_test {

/// Two Linear layers whose sizes do not divide by 2, 3 or 4 (so parameters straddle slices), and a branch the
/// forward never uses.
struct ZNetImpl : torch::nn::Module {
  ZNetImpl() {
    a = register_module("a", torch::nn::Linear(7, 13));
    b = register_module("b", torch::nn::Linear(13, 5));
    unused = register_module("unused", torch::nn::Linear(3, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return b(torch::tanh(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr}, unused{nullptr};
};
TORCH_MODULE(ZNet);

enum class Opt { kAdamW, kSgd };

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt opt, ZNet& net) {
  if (opt == Opt::kSgd) {
    return std::make_unique<amp::FusedSGD>(net->parameters(),
                                           amp::FusedSgdOptions(0.05).momentum(0.9).weight_decay(1e-3).nesterov(true));
  }
  // Two groups (AdamW), with their own learning rates.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(net->a->parameters());
  std::vector<torch::Tensor> rest = net->b->parameters();
  for (const auto& p : net->unused->parameters()) rest.push_back(p);
  groups.emplace_back(rest, std::make_unique<amp::FusedAdamOptions>(
                                amp::FusedAdamOptions(3e-3).weight_decay(1e-2).decoupled_weight_decay(true)));
  return std::make_unique<amp::FusedAdam>(groups,
                                          amp::FusedAdamOptions(1e-2).weight_decay(1e-2).decoupled_weight_decay(true));
}

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
