#pragma once

// The model and data most DistributedDataParallel tests use (a small tanh MLP, a full batch split over the ranks),
// and the single-process reference they compare against: shared by distributed_data_parallel_test.cpp,
// reducer_test.cpp and model_sync_test.cpp.

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <ddp/distributed_data_parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"

namespace ddp_mlp {

using ddp_test::contains_all;
using ddp_test::error_of;
using ddp_test::grads_of;
using ddp_test::kTestTimeout;
using Clock = std::chrono::steady_clock;

constexpr int kWorld = 2;
constexpr int64_t kBatch = 16;  // the full batch; each rank takes kBatch / kWorld samples
constexpr int64_t kIn = 8;
constexpr int64_t kOut = 4;

/// A tanh MLP with named layers (layers.0.weight, ...); widths {8, 16, 4} is two Linear layers.
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const std::vector<int64_t>& widths) {
    for (size_t i = 0; i + 1 < widths.size(); ++i) layers->push_back(torch::nn::Linear(widths[i], widths[i + 1]));
    register_module("layers", layers);
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < layers->size(); ++i) {
      x = layers[i]->as<torch::nn::Linear>()->forward(x);
      if (i + 1 < layers->size()) x = torch::tanh(x);
    }
    return x;
  }
  torch::nn::ModuleList layers;
};
TORCH_MODULE(Mlp);

inline const std::vector<int64_t> kWidths = {kIn, 32, 32, 32, kOut};

/// The model rank `rank` starts from: a different initialization on every rank (DDP must broadcast rank 0's).
inline Mlp make_model(uint64_t seed, int rank, const std::vector<int64_t>& widths = kWidths) {
  torch::manual_seed(seed + 1 + static_cast<uint64_t>(rank));
  return Mlp(widths);
}

struct Data {
  torch::Tensor x, y;
};
/// The same full batch on every rank (same seed).
inline Data make_data(uint64_t seed, int64_t batch = kBatch) {
  torch::manual_seed(seed);
  return {torch::randn({batch, kIn}), torch::randn({batch, kOut})};
}
inline Data shard(const Data& d, int rank, int world) {
  const int64_t per = d.x.size(0) / world;
  return {d.x.narrow(0, rank * per, per), d.y.narrow(0, rank * per, per)};
}

/// Full-batch gradients of the single-process reference (rank 0's initialization).
inline std::vector<torch::Tensor> reference_grads(uint64_t seed, const Data& data) {
  Mlp ref = make_model(seed, 0);
  torch::mse_loss(ref->forward(data.x), data.y).backward();
  return grads_of(*ref);
}

/// Throws unless every tensor is allclose(rtol, atol). The fp32 bounds (1e-5, atol 1e-6): sharded and full-batch
/// gradients are fp32 GEMM sums over the batch in another order (per shard, then the allreduce), whose error is a few
/// 2^-24 of sum |terms| on any kernel path (Note [bounds on every CPU kernel path], tests/test_util.h): ~1e-7 for
/// these small sums, bounded a hundred times higher; a gradient lost or counted twice is off by O(1).
inline void check_close(const std::vector<torch::Tensor>& actual, const std::vector<torch::Tensor>& expected,
                        double rtol, double atol, const std::string& what) {
  TORCH_CHECK(actual.size() == expected.size(), what, ": ", actual.size(), " tensors vs ", expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    TORCH_CHECK(torch::allclose(actual[i], expected[i], rtol, atol), what, ": tensor ", i, " differs, max abs diff ",
                (actual[i] - expected[i]).abs().max().item<double>());
  }
}

/// Runs fn(rank, process group) on kWorld (or `world`) forked ranks with Gloo on loopback.
inline void run_ranks(const std::function<void(int, const ddp::ProcessGroup&)>& fn, int world = kWorld,
                      std::chrono::milliseconds timeout = kTestTimeout) {
  ddp_test::run_ranks(fn, world, timeout);
}

inline void save(const std::vector<torch::Tensor>& tensors, const std::string& path) { torch::save(tensors, path); }
inline std::vector<torch::Tensor> load(const std::string& path) {
  std::vector<torch::Tensor> tensors;
  torch::load(tensors, path);
  return tensors;
}

// Bucket settings under which the gradient path is checked: defaults (one bucket for this small model), one
// bucket per parameter or so, and every bucket after backward.
inline std::vector<ddp::DistributedDataParallelOptions> bucket_variants() {
  return {ddp::DistributedDataParallelOptions(),
          ddp::DistributedDataParallelOptions().first_bucket_mb(0.001).bucket_cap_mb(0.002),
          ddp::DistributedDataParallelOptions().bucket_cap_mb(0.002).delay_allreduce(true)};
}

}  // namespace ddp_mlp
