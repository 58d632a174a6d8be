// amp + DDP + SyncBatchNorm (the seed's Apex recipe with convert_syncbn_model): training a small CNN on 2 ranks, each
// with half of every batch, equals training the same amp setup in one process on the whole batch with BatchNorm.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include <amp/amp.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/launch/spawn.h>
#include <ddp/process_group.h>
#include <ddp/sync_batch_norm.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

constexpr int kWorld = 2;
constexpr int kSteps = 20;
constexpr int64_t kFullBatch = 16;
constexpr int64_t kSide = 6;
constexpr int64_t kClasses = 3;  // make_bn_cnn's outputs
// A small step keeps the two runs' trajectories close: at lr 0.1 a bf16 rounding that flips a ReLU early was amplified
// over 20 steps to twice the bound below in about 1 run of 100 (seeds 135235959, 1695769 under ATen's default vectors);
// at 0.03 the same seeds stay at a tenth of it.
constexpr double kLr = 0.03;

/// The model: ddp_test::make_bn_cnn (two conv + BatchNorm2d + ReLU blocks, mean over space, linear to kClasses).
using ddp_test::make_bn_cnn;

/// The full batch of `step`, the same on every rank. Rank 0's half is centred at +1.5 and rank 1's at -1.5, so that
/// each half's own batch statistics are far from the whole batch's: a SyncBatchNorm that normalized with local
/// statistics would train to visibly different weights.
std::pair<torch::Tensor, torch::Tensor> batch_of(uint64_t seed, int step) {
  torch::manual_seed(seed + 1000 + static_cast<uint64_t>(step));
  auto x = torch::randn({kFullBatch, 1, kSide, kSide});
  x.narrow(0, 0, kFullBatch / 2).add_(1.5);
  x.narrow(0, kFullBatch / 2, kFullBatch / 2).sub_(1.5);
  return {x, torch::randint(0, kClasses, {kFullBatch})};
}

amp::Options amp_options(amp::OptLevel level) { return amp::Options().opt_level(level).half_dtype(torch::kBFloat16); }

/// What the optimizer updates (fp32: the parameters under O1, the masters under O2), in the optimizer's order.
std::vector<torch::Tensor> optimizer_params(amp::Optimizer& optimizer) {
  std::vector<torch::Tensor> params;
  for (const auto& g : optimizer.inner().param_groups()) {
    for (const auto& p : g.params()) params.push_back(p.detach().clone());
  }
  return params;
}

struct Trained {
  std::vector<std::string> names;              // the module's parameter names, in the same order
  std::vector<torch::Tensor> initial;          // the optimizer's parameters before the first step
  std::vector<torch::Tensor> final;            // and after the last
  std::vector<torch::Tensor> initial_buffers;  // running means and variances, num_batches_tracked
  std::vector<torch::Tensor> buffers;
};

std::vector<torch::Tensor> buffers_of(const torch::nn::Module& module) {
  std::vector<torch::Tensor> buffers;
  for (const auto& b : module.buffers()) buffers.push_back(b.detach().clone());
  return buffers;
}

/// Trains `net` (already under amp as `model`/`optimizer`) for kSteps on rows [offset, offset + count) of every
/// batch, `forward` running the model; records parameters and buffers before and after.
Trained train_steps(torch::nn::Module& net, amp::Optimizer& optimizer, uint64_t seed, int64_t offset, int64_t count,
                    const std::function<torch::Tensor(const torch::Tensor&)>& forward) {
  Trained t;
  t.names = net.named_parameters().keys();
  t.initial = optimizer_params(optimizer);
  t.initial_buffers = buffers_of(net);
  for (int step = 0; step < kSteps; ++step) {
    const auto [x, y] = batch_of(seed, step);
    optimizer.zero_grad();
    const auto loss = torch::cross_entropy_loss(forward(x.narrow(0, offset, count)), y.narrow(0, offset, count));
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
  }
  t.final = optimizer_params(optimizer);
  t.buffers = buffers_of(net);
  return t;
}

/// The reference: BatchNorm2d, the whole batch, one process, the same amp setup.
Trained train_single_process(amp::OptLevel level, uint64_t seed) {
  auto net = make_bn_cnn(seed);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(kLr));
  auto initialized = amp::initialize(net, sgd, amp_options(level));  // named: the lambdas capture its parts
  auto& model = initialized.model;
  auto& optimizer = initialized.optimizer;
  return train_steps(*net, optimizer, seed, 0, kFullBatch, [&](const torch::Tensor& x) { return model.forward(x); });
}

/// One rank of the DDP run: the BatchNorms converted to SyncBatchNorm over `group` (unless `sync` is false: then they
/// normalize with local statistics), then amp, then DDP with amp attached to its buckets (the order amp_ddp uses);
/// each rank trains on its half of every batch.
Trained train_rank(amp::OptLevel level, uint64_t seed, const ddp::ProcessGroup& group, bool sync = true) {
  auto net = make_bn_cnn(seed);
  if (sync) ddp::convert_sync_batch_norm(net.ptr(), group, [](const std::string&) {});
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(kLr));
  auto initialized = amp::initialize(net, sgd, amp_options(level));  // named: the lambdas capture its parts
  auto& model = initialized.model;
  auto& optimizer = initialized.optimizer;
  ddp::DistributedDataParallel ddp_net(net, group);
  optimizer.attach(ddp_net);
  const int64_t per_rank = kFullBatch / group.size();
  return train_steps(*net, optimizer, seed, per_rank * group.rank(), per_rank, [&](const torch::Tensor& x) {
    return model.call([&](const torch::Tensor& in) { return ddp_net.forward(in); }, x);
  });
}

// Tolerance (bf16). The two runs do not round alike: autocast (O1) and the bf16 model (O2) round every conv and
// linear output and the gradients flowing back through them to bf16 (at most 2^-8 relative), each rank's half-batch
// weight gradient is rounded before the allreduce sums it while the reference rounds the full batch's once, and
// SyncBatchNorm's fp32 statistics differ from ATen's in summation order, which moves a bf16 rounding now and then.
// Each step's update thus differs by about 2^-8 of itself, and training amplifies that (a ReLU decision that flips
// changes a whole gradient entry). Both sides run the same kernels on the same machine; another kernel path (Note
// [bounds on every CPU kernel path], tests/test_util.h) or thread count only draws these roundings again, and CI
// reruns the test under ATen's default vectors with oneDNN capped at AVX2 (numerics.amp_under_other_kernels), fresh
// seeds every run. Two checks:
// - Every tensor: 1/3 of its largest movement plus 2^-7 of its largest value (for tensors that hardly move, such as
//   the conv biases before BatchNorm, whose gradient is zero in exact arithmetic), plus an absolute floor: a
//   BatchNorm bias's gradient is a sum over the batch of the upstream gradient, which nearly cancels, so what is left
//   of its movement may be mostly the rounding of its bf16 gradients. The floor is lr x 20 steps x 2^-10, a per-step
//   update of a unit-scale gradient rounded differently every step. Measured 2026-12-04 on this 2-core AMD EPYC VM
//   over 1360 runs (O1 and O2; this machine's kernels and ATen's default vectors with oneDNN at AVX2; fresh seeds):
//   the largest difference of any tensor reached 0.28 of this bound, 99th percentile 0.20.
// - The conv and linear weights together (weight_distance): DDP + SyncBatchNorm ended at most 0.134 from the
//   reference in those runs (median 0.02); BatchNorm's local statistics instead of global ones (each half normalized
//   with its own mean, the halves sit +-1.5 apart: what a SyncBatchNorm that skipped its collective, or a forgotten
//   convert_sync_batch_norm, computes) ended 0.53-1.64 from it. The bound 0.25 sits between, and every run shows
//   that it separates the two: it trains the local-statistics run too and requires that to end beyond the bound.
constexpr double kMovementFraction = 1.0 / 3;
constexpr double kValueFraction = 1.0 / 128;
constexpr double kAbsoluteFloor = kLr * kSteps * (1.0 / 1024);
constexpr double kDistanceBound = 0.25;

/// How far `a` ended from `ref` in the conv and linear weights (dim >= 2): per tensor the L2 distance over the L2 norm
/// of how far the reference moved, then the root mean square over those tensors. 0: the same training; about 1: as
/// far from it as the reference moved.
double weight_distance(const Trained& a, const Trained& ref, const std::string& what) {
  double sum = 0;
  int n = 0;
  for (size_t i = 0; i < ref.final.size(); ++i) {
    if (ref.final[i].dim() < 2) continue;
    const double moved = (ref.final[i] - ref.initial[i]).norm().item<double>();
    TORCH_CHECK(moved > 0, what, ": ", ref.names[i], " did not move in ", kSteps, " steps");
    const double d = (a.final[i] - ref.final[i]).norm().item<double>() / moved;
    sum += d * d;
    ++n;
  }
  return std::sqrt(sum / n);
}

/// `mine` (DDP + SyncBatchNorm) against `ref` (single process, whole batch); `local` (DDP with BatchNorm's local
/// statistics) shows that the comparison tells the two apart.
void check_against_reference(const Trained& mine, const Trained& ref, const Trained& local, const std::string& what) {
  TORCH_CHECK(mine.final.size() == ref.final.size() && ref.names.size() == ref.final.size(), what, ": ",
              mine.final.size(), " parameters vs ", ref.final.size());
  std::string failures;
  double worst = 0;  // the largest difference as a fraction of its tolerance, printed: the margin on this machine
  for (size_t i = 0; i < ref.final.size(); ++i) {
    const std::string& name = ref.names[i];
    TORCH_CHECK(torch::equal(mine.initial[i], ref.initial[i]), what, ": ", name, " started elsewhere");
    const double movement = (ref.final[i] - ref.initial[i]).abs().max().item<double>();
    const double tolerance =
        kMovementFraction * movement + kValueFraction * ref.final[i].abs().max().item<double>() + kAbsoluteFloor;
    const double diff = (mine.final[i] - ref.final[i]).abs().max().item<double>();
    worst = std::max(worst, diff / tolerance);
    if (diff > tolerance) {
      failures +=
          c10::str("; ", name, " ", ref.final[i].sizes(), " by ", diff, " > ", tolerance, " (it moved ", movement, ")");
    }
  }
  TORCH_CHECK(failures.empty(), what, ": DDP + SyncBatchNorm training differs from single-process full-batch ",
              "training", failures);
  const double distance = weight_distance(mine, ref, what);
  const double local_distance = weight_distance(local, ref, what);
  TORCH_CHECK(local_distance > kDistanceBound, what, ": this run cannot tell SyncBatchNorm from local statistics: ",
              "training with BatchNorm's local statistics ended ", local_distance, " from the reference, within ",
              kDistanceBound);
  TORCH_CHECK(distance <= kDistanceBound, what, ": DDP + SyncBatchNorm's weights ended ", distance,
              " from single-process full-batch training's, beyond ", kDistanceBound,
              " (local statistics: ", local_distance, ")");
  // The running statistics follow the weights (the second layer's are statistics of the first's output): the same
  // bound, on how far they moved from their initial 0 and 1; num_batches_tracked exactly.
  TORCH_CHECK(mine.buffers.size() == ref.buffers.size(), what, ": buffer count");
  for (size_t i = 0; i < ref.buffers.size(); ++i) {
    const auto& b = ref.buffers[i];
    if (!b.is_floating_point()) {
      TORCH_CHECK(torch::equal(mine.buffers[i], b), what, ": buffer ", i, " is ", mine.buffers[i], " not ", b);
      continue;
    }
    const double movement = (b - ref.initial_buffers[i]).abs().max().item<double>();
    const double tolerance =
        kMovementFraction * movement + kValueFraction * b.abs().max().item<double>() + kAbsoluteFloor;
    const double diff = (mine.buffers[i] - b).abs().max().item<double>();
    worst = std::max(worst, diff / tolerance);
    TORCH_CHECK(diff <= tolerance, what, ": buffer ", i, " differs by ", diff, " > ", tolerance);
  }
  std::cout << what << ": largest difference " << worst << " of its tolerance; weights " << distance
            << " from the reference (bound " << kDistanceBound << ", local statistics " << local_distance << ")"
            << std::endl;
}

class SyncBatchNormAmpTrainingTest : public ::testing::TestWithParam<amp::OptLevel> {};
INSTANTIATE_TEST_SUITE_P(OptLevels, SyncBatchNormAmpTrainingTest,
                         ::testing::Values(amp::OptLevel::O1, amp::OptLevel::O2),
                         [](const auto& info) { return info.param == amp::OptLevel::O1 ? "O1" : "O2"; });

TEST_P(SyncBatchNormAmpTrainingTest, TwoRanksEqualSingleProcessFullBatchTrainingInBFloat16) {
  LTA_REQUIRE_GLOO();
  const amp::OptLevel level = GetParam();
  const uint64_t seed = test_util::fresh_seed();
  ddp::spawn(kWorld, [&](int rank, int) {
    at::set_num_threads(1);
    const ddp::ProcessGroup group = ddp::init_process_group(ddp::InitOptions().timeout(ddp_test::kTestTimeout));
    const std::string what = c10::str("rank ", rank, " seed ", seed);
    try {
      const Trained ref = train_single_process(level, seed);
      const Trained mine = train_rank(level, seed, group);
      const Trained local = train_rank(level, seed, group, /*sync=*/false);
      check_against_reference(mine, ref, local, what);
    } catch (const c10::Error& e) {
      if (std::getenv("LTA_SYNCBN_DEBUG") != nullptr) std::cerr << e.what() << std::endl;
      throw;
    }
  });
}

}  // namespace
