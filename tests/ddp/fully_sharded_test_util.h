#pragma once

// The model, data and training loops of the full sharding tests (fully_sharded_test.cpp on the CPU,
// fully_sharded_cuda_test.cpp over NCCL): a residual MLP whose blocks are the units, trained the same way through
// DistributedDataParallel and FullyShardedDataParallel.

#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fsdp/fully_sharded.h>
#include <torch/torch.h>

namespace fsdp_test {

constexpr int64_t kIn = 12;
constexpr int64_t kWidth = 24;
constexpr int64_t kOut = 5;
constexpr int64_t kBlocks = 3;

/// A residual MLP block: the unit of sharding.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kWidth, 2 * kWidth));
    fc2 = register_module("fc2", torch::nn::Linear(2 * kWidth, kWidth));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

/// embed -> kBlocks blocks -> head; with `sharded`, each block in a ddp::ShardedUnit (the names stay the same).
struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool sharded) {
    embed = register_module("embed", torch::nn::Linear(kIn, kWidth));
    for (int64_t b = 0; b < kBlocks; ++b) {
      if (sharded) {
        blocks->push_back(ddp::ShardedUnit(Block()));
      } else {
        blocks->push_back(Block());
      }
    }
    register_module("blocks", blocks);
    head = register_module("head", torch::nn::Linear(kWidth, kOut));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(blocks->forward(embed(x))); }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  torch::nn::Sequential blocks;
};
TORCH_MODULE(Net);

/// The model every rank builds (a different initialization per rank: construction must start all from rank 0's).
/// Under a lock: thread ranks share the global generator that initializes the layers.
inline Net make_net(uint64_t seed, int rank, bool sharded, const torch::Device& device = torch::kCPU) {
  static std::mutex generator;
  std::lock_guard<std::mutex> lock(generator);
  torch::manual_seed(seed + 1 + static_cast<uint64_t>(rank));
  Net net(sharded);
  net->to(device);
  return net;
}

struct Batch {
  torch::Tensor x, y;
};
/// Rank `rank`'s part of step `step`'s batch (8 samples per rank), drawn on the CPU from a generator of its own and
/// moved to `device`.
inline Batch batch(uint64_t seed, int rank, int step, const torch::Device& device = torch::kCPU) {
  at::Generator generator =
      at::detail::createCPUGenerator(seed + 7919 * static_cast<uint64_t>(step + 1) + static_cast<uint64_t>(rank));
  torch::Tensor x = torch::randn({8, kIn}, generator);
  torch::Tensor y = torch::randn({8, kOut}, generator);
  return {x.to(device), y.to(device)};
}

inline torch::optim::SGDOptions sgd() { return torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3); }

struct Trained {
  std::vector<double> losses;
  std::vector<std::pair<std::string, torch::Tensor>> params;
};

/// `steps` steps through `wrapper` (DDP or full sharding) with `micro` micro-batches per step, all but the last
/// under no_sync.
template <typename Wrapper>
Trained train(Wrapper& wrapper, torch::optim::Optimizer& opt, uint64_t seed, int rank, int steps, int micro,
              const torch::Device& device) {
  Trained out;
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    for (int m = 0; m < micro; ++m) {
      const Batch b = batch(seed, rank, step * micro + m, device);
      std::optional<typename Wrapper::NoSyncGuard> accumulate;
      if (m + 1 < micro) accumulate.emplace(wrapper);
      torch::Tensor loss = torch::mse_loss(wrapper.forward(b.x), b.y);
      loss.backward();
      out.losses.push_back(loss.item<double>());
    }
    opt.step();
  }
  return out;
}

inline Trained train_ddp(uint64_t seed, int rank, const ddp::ProcessGroup& pg, int steps, int micro = 1,
                         const torch::Device& device = torch::kCPU, ddp::DistributedDataParallelOptions options = {}) {
  Net model = make_net(seed, rank, /*sharded=*/false, device);
  ddp::DistributedDataParallel ddp(model, pg, options);
  torch::optim::SGD opt(model->parameters(), sgd());
  Trained out = train(ddp, opt, seed, rank, steps, micro, device);
  for (const auto& p : model->named_parameters()) out.params.emplace_back(p.key(), p.value().detach().cpu());
  return out;
}

inline Trained train_fsdp(uint64_t seed, int rank, const ddp::ProcessGroup& pg, int steps, int micro = 1,
                          ddp::FullyShardOptions options = {}, const torch::Device& device = torch::kCPU) {
  Net model = make_net(seed, rank, /*sharded=*/true, device);
  ddp::FullyShardedDataParallel fsdp(model, pg, options);
  torch::optim::SGD opt(fsdp.parameters(), sgd());
  Trained out = train(fsdp, opt, seed, rank, steps, micro, device);
  out.params = fsdp.full_parameters();
  for (auto& [name, value] : out.params) value = value.cpu();
  return out;
}

/// Throws from the rank unless both runs agree: bit for bit (tolerance 0), or within `tolerance` relative to the
/// largest value of each tensor.
inline void check_same(const Trained& fsdp, const Trained& ddp, double tolerance, const std::string& what) {
  TORCH_CHECK(fsdp.losses.size() == ddp.losses.size(), what, ": step counts differ");
  for (size_t i = 0; i < ddp.losses.size(); ++i) {
    const double bound = tolerance * std::abs(ddp.losses[i]);
    TORCH_CHECK(std::abs(fsdp.losses[i] - ddp.losses[i]) <= bound, what, ": loss ", i, " is ", fsdp.losses[i],
                ", DDP's ", ddp.losses[i]);
  }
  TORCH_CHECK(fsdp.params.size() == ddp.params.size(), what, ": ", fsdp.params.size(), " parameters, DDP has ",
              ddp.params.size());
  for (size_t i = 0; i < ddp.params.size(); ++i) {
    TORCH_CHECK(fsdp.params[i].first == ddp.params[i].first, what, ": parameter ", i, " is ", fsdp.params[i].first,
                ", DDP's ", ddp.params[i].first);
    const torch::Tensor& a = fsdp.params[i].second;
    const torch::Tensor& e = ddp.params[i].second;
    TORCH_CHECK(a.sizes() == e.sizes(), what, ": ", ddp.params[i].first, " has shape ", a.sizes());
    const double diff = (a - e).abs().max().item<double>();
    const double bound = tolerance * e.abs().max().item<double>();
    TORCH_CHECK(diff <= bound, what, ": ", ddp.params[i].first, " differs from DDP's by ", diff, " (bound ", bound,
                ")");
  }
}

}  // namespace fsdp_test
