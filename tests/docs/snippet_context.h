// What the C++ snippets of README.md and docs/*.md take as given: a user's model, their batches, the objects an
// earlier snippet of the same page made. tests/docs/compile_snippets.cmake includes this after a page's own #include
// lines and compiles each snippet as a function body against it (compile only: nothing here is defined).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>

namespace docs {

/// The user's module, defined the LibTorch way: NetImpl holds the layers, Net is its holder. Cloneable, as
/// ddp::DataParallel's replicas need.
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
};
TORCH_MODULE(Net);

extern Net net;
extern torch::Device device;                                          // where the model lives
extern std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;  // (input, target) pairs
extern torch::Tensor x;
extern torch::Tensor y;
extern int nprocs;

// What amp::initialize made in an earlier snippet, and what it was given.
extern torch::optim::SGD sgd;
extern amp::FusedAdamW adamw;
extern amp::Options same_options;
extern amp::Model<Net> model;
extern amp::Optimizer optimizer;
extern std::string bytes;  // a caller's own checkpoint extra

// A loop of the user's own (docs/run.md, README): its sizes, where it runs, and its own step and evaluation.
extern int64_t dataset_size;
extern int rank;
extern int world_size;
extern int64_t epochs;
extern int64_t save_every;
torch::Tensor train_step(const torch::Tensor& inputs, const torch::Tensor& targets);  // returns the loss
std::optional<double> evaluate();                                                     // test accuracy, 0..1

// Data parallel: made in an earlier snippet.
extern ddp::DistributedDataParallelOptions ddp_options;
extern ddp::DistributedDataParallel ddp_net;

}  // namespace docs
