// ZeRO over NCCL (the GPU check): the sharded optimizer (docs/zero.md) on CUDA, NCCL carrying DDP's bucket
// reductions, trains like DDP + amp O2, and its step makes no host sync. Ranks are threads of this process (CUDA
// does not survive a fork). NCCL takes one rank per GPU, so with one GPU the world is 1, where ZeRO still takes its
// sharded path (nothing forces it: a world of 1 gets one shard holding every piece, DDP reduce-scatters each bucket
// through NCCL under stage 2, and the all-gather of the updated slices becomes a copy); with two GPUs a world of 2
// also runs NCCL's reduce-scatter across the ranks and the all-gathers. The same harness runs over Gloo on the CPU
// with one and two thread ranks: that is how it is tested without a GPU.

#include <string>
#include <vector>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <amp/zero/zero_shard.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/launch/worker_group.h>
#include <ddp/process_group.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#ifdef LIBTORCH_AMP_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "amp/zero_test_util.h"
#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

/// Two Linear layers whose sizes divide by neither 2 nor 16, so parameters straddle the ranks' slices.
struct ZcNetImpl : torch::nn::Module {
  ZcNetImpl() {
    a = register_module("a", torch::nn::Linear(23, 37));
    b = register_module("b", torch::nn::Linear(37, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::tanh(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(ZcNet);

/// While alive, with `on`, any host synchronization with the GPU throws (c10's sync debug mode, process-wide: for
/// a single rank only).
class HostSyncIsAnError {
 public:
  explicit HostSyncIsAnError(bool on) : on_(on) {
#ifdef LIBTORCH_AMP_WITH_CUDA
    if (on_) c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
#endif
  }
  ~HostSyncIsAnError() {
#ifdef LIBTORCH_AMP_WITH_CUDA
    if (on_) c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
#endif
  }
  HostSyncIsAnError(const HostSyncIsAnError&) = delete;
  HostSyncIsAnError& operator=(const HostSyncIsAnError&) = delete;

 private:
  bool on_;
};

struct ZeroRun {
  std::vector<torch::Tensor> losses;   // per step, left on the device until the run ends
  std::vector<torch::Tensor> masters;  // fp32, slot order (gathered from every rank's shard under ZeRO)
  std::vector<torch::Tensor> model;    // the model's bf16 parameters
  std::vector<torch::Tensor> initial;  // fp32 on the CPU, before training
};

constexpr int kSteps = 6;

/// One rank's run on `device`: DDP + amp O2 (bf16, dynamic loss scale, FusedAdam with two param groups), buckets
/// small enough for several, attached with `stage`; the data depends on (rank, step) only. The steps from
/// `checked_from` on (-1: none) run with host syncs turned into errors.
ZeroRun train(const ddp::ProcessGroup& pg, const torch::Device& device, amp::ZeroStage stage, int checked_from = -1) {
  ZcNet net;
  {  // the same weights on every rank, from a generator of this thread's own (the ranks are threads)
    torch::NoGradGuard no_grad;
    auto generator = at::make_generator<at::CPUGeneratorImpl>(7);
    for (auto& p : net->parameters()) p.copy_(torch::randn(p.sizes(), generator) * 0.3);
  }
  ZeroRun run;
  for (const auto& p : net->parameters()) run.initial.push_back(p.detach().clone());
  net->to(device);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(net->a->parameters());
  groups.emplace_back(net->b->parameters(), std::make_unique<amp::FusedAdamOptions>(amp::FusedAdamOptions(3e-3)));
  amp::FusedAdam adam(groups, amp::FusedAdamOptions(1e-2).weight_decay(1e-2).decoupled_weight_decay(true));
  auto [model, optimizer] =
      amp::initialize(net, adam, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16));
  ddp::DistributedDataParallel ddp_net(net, pg,
                                       ddp::DistributedDataParallelOptions()
                                           .first_bucket_mb(1e-4)
                                           .bucket_cap_mb(3e-4)
                                           .rebuild_buckets(false)
                                           .allreduce_dtype(torch::kFloat));
  TORCH_CHECK(ddp_net.buckets().size() > 1, "the test needs several buckets");
  optimizer.attach(ddp_net, stage);
  // The sharded path at any world size, a world of 1 included: a shard, and under stage 2 reduce-scattered buckets.
  TORCH_CHECK((optimizer.state().zero() != nullptr) == (stage != amp::ZeroStage::kNone), "ZeRO's shard is ",
              optimizer.state().zero() != nullptr ? "there" : "missing", " at stage ", static_cast<int>(stage));
  TORCH_CHECK(ddp_net.gradient_sharding() == (stage == amp::ZeroStage::kTwo), "gradient sharding is ",
              ddp_net.gradient_sharding() ? "on" : "off", " at stage ", static_cast<int>(stage));
  // The batches go to the device before the steps: a blocking copy is a host sync.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int s = 0; s < kSteps; ++s) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 * pg.rank() + s);
    batches.emplace_back(torch::randn({8, 23}, generator).to(device), torch::randn({8, 5}, generator).to(device));
  }
  for (int s = 0; s < kSteps; ++s) {
    const HostSyncIsAnError checked(checked_from >= 0 && s >= checked_from);
    optimizer.zero_grad();
    const auto& [x, y] = batches[static_cast<size_t>(s)];
    const torch::Tensor out = model.call([&](const torch::Tensor& in) { return ddp_net.forward(in); }, x);
    const torch::Tensor loss = (out - y).pow(2).mean();
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
    run.losses.push_back(loss.detach());
  }
  run.masters = zero_test::full_masters(optimizer);
  run.model = zero_test::parameters_of(*net);
  return run;
}

bool bit_identical(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i].cpu(), b[i].cpu())) return false;
  }
  return true;
}

/// On `world` thread ranks over `backend` (with `cuda`, rank r on GPU r): ZeRO stages 1 and 2 end with the masters,
/// model parameters and losses of DDP + amp O2, bit for bit. With 1 or 2 ranks each reduced gradient element is the
/// sum of at most two values, the same in any order, so DDP's allreduce and ZeRO's reduce-scatter deliver the same
/// bits; the unscaling is the same fused copy, and the optimizer's update is elementwise (Note [fused optimizer
/// step]: one rule per element), so a piece of a parameter is updated as the whole parameter would be.
void expect_zero_trains_like_ddp(const std::string& backend, int world, bool cuda) {
  const int port = ddp::detail::find_free_port();
  const auto errors = ddp_test::run_thread_ranks(world, [&](int rank) {
    const ddp::ProcessGroup pg = ddp_test::thread_rank_group(backend, rank, world, port, cuda);
    const torch::Device device =
        cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(rank)) : torch::Device(torch::kCPU);
    const ZeroRun reference = train(pg, device, amp::ZeroStage::kNone);
    for (const auto stage : {amp::ZeroStage::kOne, amp::ZeroStage::kTwo}) {
      const ZeroRun zero = train(pg, device, stage);
      const std::string what =
          c10::str("rank ", rank, " of ", world, " (", backend, "), stage ", static_cast<int>(stage), ": ");
      TORCH_CHECK(zero.masters.front().device() == device, what, "the shard's masters are on ",
                  zero.masters.front().device());
      TORCH_CHECK(bit_identical(zero.masters, reference.masters), what, "masters differ from DDP + amp O2");
      TORCH_CHECK(bit_identical(zero.model, reference.model), what, "model parameters differ from DDP + amp O2");
      TORCH_CHECK(bit_identical(zero.losses, reference.losses), what, "losses differ from DDP + amp O2");
    }
    // And training moved the masters, so the comparison means something.
    TORCH_CHECK(!torch::equal(reference.masters.front().cpu(), reference.initial.front()), "rank ", rank,
                ": training did not move the masters");
  });
  for (int rank = 0; rank < world; ++rank) EXPECT_EQ(errors[static_cast<size_t>(rank)], "") << "rank " << rank;
}

TEST(ZeroNcclTest, StagesOneAndTwoOverNcclTrainLikeDdpAmpO2BitForBit) {
  LTA_REQUIRE_NCCL_GPUS(1);
  expect_zero_trains_like_ddp("nccl", 1, /*cuda=*/true);
}

TEST(ZeroNcclTest, TwoRanksOnTwoGpusTrainLikeDdpAmpO2BitForBit) {
  LTA_REQUIRE_NCCL_GPUS(2);
  expect_zero_trains_like_ddp("nccl", 2, /*cuda=*/true);
}

// A ZeRO stage 2 step over NCCL (forward, the reduce-scatter of every bucket, the fused unscale of this rank's
// slices, the overflow flag, the sharded FusedAdam step and the write-back into the model) makes no host sync.
TEST(ZeroNcclTest, AStageTwoStepOverNcclMakesNoHostSync) {
  LTA_REQUIRE_NCCL_GPUS(1);
  const int port = ddp::detail::find_free_port();
  const auto errors = ddp_test::run_thread_ranks(1, [&](int) {
    const ddp::ProcessGroup pg = ddp_test::thread_rank_group("nccl", 0, 1, port, /*cuda=*/true);
    // The first two steps warm up (NCCL's communicator, allocations, the optimizer's lazy state); the rest are checked.
    const ZeroRun run = train(pg, torch::Device(torch::kCUDA, 0), amp::ZeroStage::kTwo, /*checked_from=*/2);
    TORCH_CHECK(torch::isfinite(torch::stack(run.losses)).all().item<bool>(), "a loss is not finite");
  });
  EXPECT_EQ(errors[0], "");
}

// The harness on the CPU: the same runs over Gloo with one and two thread ranks.
TEST(ZeroThreadRanksTest, TheDeviceChecksPassOverGlooOnTheCpuWithOneAndTwoRanks) {
  LTA_REQUIRE_GLOO();
  expect_zero_trains_like_ddp("gloo", 1, /*cuda=*/false);
  expect_zero_trains_like_ddp("gloo", 2, /*cuda=*/false);
}

}  // namespace
