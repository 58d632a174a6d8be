#pragma once

// A transformer-shaped stack of blocks for the memory benchmarks (bench_zero, bench_fsdp): per block the qkv and
// output projections, a 4x MLP and two LayerNorms, 12 d^2 + 13 d parameters; no attention scores, which hold no
// parameters. With `sharded_units`, each block is a ddp::ShardedUnit (full sharding's unit).

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <ddp/fsdp/sharded_unit.h>

namespace bench {

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d) : d(d) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
    out = register_module("out", torch::nn::Linear(d, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", torch::nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", torch::nn::Linear(4 * d, d));
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto h = qkv(ln1(x));
    x = x + out(h.narrow(-1, 0, d) * torch::sigmoid(h.narrow(-1, d, d)) + h.narrow(-1, 2 * d, d));
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
  int64_t d;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, out{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
  StackImpl(int64_t d, int layers, bool sharded_units = false) {
    for (int i = 0; i < layers; ++i) {
      const std::string name = "block" + std::to_string(i);
      if (sharded_units) {
        auto unit = register_module(name, ddp::ShardedUnit(Block(d)));
        blocks.emplace_back([unit](const torch::Tensor& x) { return unit->forward(x); });
      } else {
        auto block = register_module(name, Block(d));
        blocks.emplace_back([block](const torch::Tensor& x) { return block->forward(x); });
      }
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks) x = b(x);
    return x;
  }
  std::vector<std::function<torch::Tensor(const torch::Tensor&)>> blocks;
};
TORCH_MODULE(Stack);

}  // namespace bench
