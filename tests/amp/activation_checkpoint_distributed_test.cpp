// amp::activation_checkpoint with what trains over several ranks (2 forked ranks, Gloo): DistributedDataParallel
// (buckets, overlap, no_sync), ZeRO 1-2 under amp O2, SyncBatchNorm. Each run is compared with the same model
// unwrapped, in the same process, bit for bit.
#include <amp/recompute/activation_checkpoint.h>

#include <memory>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>
#include <ddp/sync_batch_norm.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "amp/zero_test_util.h"
#include "ddp/ddp_test_util.h"

namespace {

/// in -> [up, GELU, SyncBatchNorm (optional), dropout, down] -> output. The block is the model's last part, so the
/// first gradient of a backward is the rebuilt block's, in the nested backward of the recompute: DDP's end-of-pass
/// step must still wait for `in`'s gradient, which comes after the nested backward. checkpoints = 2 also wraps
/// [up, GELU] inside the block (a checkpoint in a checkpoint: a backward nested two deep).
struct NetImpl : torch::nn::Module {
  NetImpl(int checkpoints, std::optional<ddp::ProcessGroup> sync_bn) : checkpoints(checkpoints) {
    in = register_module("in", torch::nn::Linear(8, 16));
    up = register_module("up", torch::nn::Linear(16, 32));
    if (sync_bn)
      norm = register_module("norm", ddp::SyncBatchNorm(ddp::SyncBatchNormOptions(32).process_group(sync_bn)));
    down = register_module("down", torch::nn::Linear(32, 6));
  }
  torch::Tensor block(const torch::Tensor& x) {
    const auto first = [this](const torch::Tensor& t) { return torch::gelu(up(t)); };
    torch::Tensor h = checkpoints == 2 ? amp::activation_checkpoint(first, x) : first(x);
    if (norm) h = norm(h);
    return down(torch::dropout(h, /*p=*/0.2, is_training()));
  }
  torch::Tensor forward(torch::Tensor x) {
    const torch::Tensor h = torch::relu(in(x));
    return checkpoints > 0 ? amp::activation_checkpoint([this](const torch::Tensor& t) { return block(t); }, h)
                           : block(h);
  }
  int checkpoints;
  torch::nn::Linear in{nullptr}, up{nullptr}, down{nullptr};
  ddp::SyncBatchNorm norm{nullptr};
};
TORCH_MODULE(Net);

/// What a run leaves to compare.
struct DdpRun {
  std::vector<torch::Tensor> state;  // parameters and buffers, after the last step
  std::vector<ddp::BucketInfo> buckets;
  std::vector<int64_t> gradient_order;
  bool overlapped = true;  // every synchronized pass issued its first bucket before its last gradient was ready
};

std::vector<torch::Tensor> state_of(const torch::nn::Module& net) {
  std::vector<torch::Tensor> out = zero_test::parameters_of(net);
  for (const auto& b : net.buffers()) out.push_back(b.detach().clone());
  return out;
}

torch::Tensor batch(int rank, int step) {
  return torch::randn({5, 8}, at::make_generator<at::CPUGeneratorImpl>(1000 * rank + step));
}

/// Four SGD steps under DDP (several small buckets, rebuilt after the first step); step 2 accumulates a no_sync
/// pass first. Dropout draws from a seed per rank and pass, the same in both runs.
DdpRun train_ddp(const ddp::ProcessGroup& pg, int rank, int checkpoints, bool sync_bn) {
  torch::manual_seed(1);
  Net net(checkpoints, sync_bn ? std::optional<ddp::ProcessGroup>(pg) : std::nullopt);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  ddp::DistributedDataParallel ddp_net(net, pg,
                                       ddp::DistributedDataParallelOptions().first_bucket_mb(1e-4).bucket_cap_mb(1e-3));
  DdpRun run;
  for (int step = 0; step < 4; ++step) {
    sgd.zero_grad();
    if (step == 2) {
      auto guard = ddp_net.no_sync();
      torch::manual_seed(50 + rank);
      ddp_net.forward(batch(rank, 100 + step)).pow(2).mean().backward();
    }
    torch::manual_seed(10 * step + rank);
    ddp_net.forward(batch(rank, step)).pow(2).mean().backward();
    const ddp::BackwardTimeline& t = ddp_net.last_backward_timeline();
    run.overlapped = run.overlapped && !t.bucket_issued.empty() && t.bucket_issued.front() < t.last_gradient_ready &&
                     t.backward_finished >= t.last_gradient_ready;
    sgd.step();
  }
  run.state = state_of(*net);
  run.buckets = ddp_net.buckets();
  run.gradient_order = ddp_net.gradient_order();
  return run;
}

void check_same_run(const DdpRun& wrapped, const DdpRun& plain, int rank) {
  TORCH_CHECK(zero_test::bit_identical(wrapped.state, plain.state), "rank ", rank,
              ": the checkpointed model's parameters or buffers differ from the unwrapped model's");
  TORCH_CHECK(wrapped.gradient_order == plain.gradient_order, "rank ", rank, ": the gradient order differs");
  TORCH_CHECK(wrapped.buckets.size() == plain.buckets.size() && wrapped.buckets.size() > 2, "rank ", rank, ": ",
              wrapped.buckets.size(), " buckets, unwrapped ", plain.buckets.size());
  for (size_t b = 0; b < plain.buckets.size(); ++b) {
    TORCH_CHECK(wrapped.buckets[b].parameter_names == plain.buckets[b].parameter_names, "rank ", rank, ": bucket ", b,
                " holds other parameters");
  }
  TORCH_CHECK(plain.overlapped && wrapped.overlapped, "rank ", rank,
              ": a bucket was not issued while gradients were still arriving (unwrapped ", plain.overlapped,
              ", checkpointed ", wrapped.overlapped, ")");
}

TEST(ActivationCheckpointDdpTest, GradientsBucketsAndOverlapAreThoseOfTheUnwrappedModel) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        const DdpRun plain = train_ddp(pg, rank, 0, false);
        check_same_run(train_ddp(pg, rank, 1, false), plain, rank);
        check_same_run(train_ddp(pg, rank, 2, false), plain, rank);
      },
      2);
}

/// SyncBatchNorm in the block: its allgather runs again in the recompute, on every rank alike; its running
/// statistics and batch count take each batch once (the recompute leaves them alone).
TEST(ActivationCheckpointDdpTest, SyncBatchNormGathersAgainButCountsEachBatchOnce) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        const DdpRun plain = train_ddp(pg, rank, 0, true);
        const DdpRun wrapped = train_ddp(pg, rank, 1, true);
        check_same_run(wrapped, plain, rank);
      },
      2);
}

/// amp O2 (bf16, dynamic loss scale) with ZeRO stage 1 and stage 2 (gradient sharding, reduce-scatter during backward):
/// the checkpointed model's masters and model parameters are the unwrapped model's, bit for bit.
std::vector<torch::Tensor> train_zero(const ddp::ProcessGroup& pg, int rank, amp::ZeroStage stage, bool checkpointed) {
  torch::manual_seed(1);
  Net net(checkpointed ? 1 : 0, std::nullopt);
  amp::FusedAdam adam(net->parameters(), amp::FusedAdamOptions(1e-2).weight_decay(1e-2).decoupled_weight_decay(true));
  auto [model, optimizer] =
      amp::initialize(net, adam, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16));
  ddp::DistributedDataParallel ddp_net(
      net, pg, ddp::DistributedDataParallelOptions().first_bucket_mb(1e-4).bucket_cap_mb(1e-3).rebuild_buckets(false));
  optimizer.attach(ddp_net, stage);
  for (int step = 0; step < 4; ++step) {
    optimizer.zero_grad();
    torch::manual_seed(10 * step + rank);
    auto out = model.call([&](const torch::Tensor& in) { return ddp_net.forward(in); }, batch(rank, step));
    {
      auto scaled = amp::scale_loss(out.pow(2).mean(), optimizer);
      scaled.backward();
    }
    optimizer.step();
  }
  std::vector<torch::Tensor> out = zero_test::full_masters(optimizer);
  for (const auto& p : zero_test::parameters_of(*net)) out.push_back(p);
  return out;
}

TEST(ActivationCheckpointDdpTest, ZeroStages1And2UnderAmpO2TrainLikeTheUnwrappedModel) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        for (const amp::ZeroStage stage : {amp::ZeroStage::kOne, amp::ZeroStage::kTwo}) {
          const auto plain = train_zero(pg, rank, stage, false);
          const auto wrapped = train_zero(pg, rank, stage, true);
          TORCH_CHECK(zero_test::bit_identical(wrapped, plain), "rank ", rank, ", ZeRO stage ", static_cast<int>(stage),
                      ": the checkpointed model's masters or parameters differ from the unwrapped model's");
        }
      },
      2);
}

}  // namespace
