// amp and ddp together (the seed's Apex way): gradients are allreduced while still scaled, so an inf on one rank
// reaches every rank through the sum, every rank raises the same found_inf without an extra collective, and
// every rank skips the same step.
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/launch/spawn.h>
#include <ddp/process_group.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 2));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

/// Sum over ranks of |params - rank 0's params|: 0 when every rank holds bit-identical parameters.
double divergence_from_rank0(const ddp::ProcessGroup& group, const std::vector<torch::Tensor>& params) {
  double total = 0;
  for (const auto& p : params) {
    auto mine = p.detach().to(torch::kFloat).clone();
    auto root = mine.clone();
    group.broadcast_(root, 0);
    total += (mine - root).abs().sum().item<double>();
  }
  return total;
}

/// With attach: amp unscales each reduced bucket during backward; without: one pass at the end of the scope.
class AmpDdpTest : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(BucketUnscale, AmpDdpTest, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "Attached" : "AtScopeEnd"; });

TEST_P(AmpDdpTest, InfOnOneRankMakesEveryRankSkipTheSameStep) {
  LTA_REQUIRE_GLOO();
  const bool attach = GetParam();
  ddp::spawn(2, [attach](int rank, int) {
    const ddp::ProcessGroup group = ddp::init_process_group(ddp::InitOptions().timeout(std::chrono::seconds(20)));
    torch::manual_seed(1);  // the same initial weights everywhere (DDP also broadcasts them from rank 0)
    Net net;
    amp::FusedSGD sgd(net->parameters(), amp::FusedSgdOptions(0.1).momentum(0.9));
    auto [model, optimizer] = amp::initialize(
        net, sgd, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16).dynamic_loss_scale());
    ddp::DistributedDataParallel ddp_net(net, group);
    if (attach) optimizer.attach(ddp_net);
    auto step = [&](torch::Tensor x) {
      optimizer.zero_grad();
      auto out = model.call([&](const torch::Tensor& in) { return ddp_net.forward(in); }, x);
      {
        auto scaled = amp::scale_loss(out.pow(2).mean(), optimizer);
        scaled.backward();
      }
      optimizer.step();
    };
    step(torch::randn({4, 8}, at::make_generator<at::CPUGeneratorImpl>(10 + rank)));
    TORCH_CHECK(divergence_from_rank0(group, net->parameters()) == 0.0, "rank ", rank,
                ": ranks diverged after a clean step");
    std::vector<torch::Tensor> before;
    for (const auto& p : net->parameters()) before.push_back(p.detach().clone());
    auto x = torch::randn({4, 8}, at::make_generator<at::CPUGeneratorImpl>(20 + rank));
    if (rank == 1) x[0][0] = std::numeric_limits<float>::infinity();
    step(x);
    const auto d = optimizer.scaler().diagnostics_now();
    TORCH_CHECK(d.found_inf && d.skipped_steps == 1, "rank ", rank, ": expected the overflow to be seen here too");
    TORCH_CHECK(d.scale == 32768.0, "rank ", rank, ": the scale should have backed off to 32768, got ", d.scale);
    const auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK(torch::equal(params[i], before[i]), "rank ", rank, ": parameter ", i, " changed in a skipped step");
    }
    step(torch::randn({4, 8}, at::make_generator<at::CPUGeneratorImpl>(30 + rank)));
    TORCH_CHECK(divergence_from_rank0(group, net->parameters()) == 0.0, "rank ", rank,
                ": ranks diverged after skipping");
  });
}

/// One rank's training run of `steps` steps (the second one accumulating two backward passes with delay_unscale,
/// the third one with two losses); returns the fp32 masters.
std::vector<torch::Tensor> train(const ddp::ProcessGroup& group, int rank, bool attach, int steps,
                                 const std::function<void(amp::Optimizer&)>& inside_scope = nullptr,
                                 torch::Device device = torch::kCPU, c10::ScalarType half_dtype = torch::kBFloat16) {
  torch::manual_seed(1);
  Net net;
  net->to(device);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto [model, optimizer] =
      amp::initialize(net, sgd, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(half_dtype).num_losses(2));
  ddp::DistributedDataParallel ddp_net(
      net, group, ddp::DistributedDataParallelOptions().allreduce_dtype(torch::kFloat).first_bucket_mb(1e-4));
  if (attach) optimizer.attach(ddp_net);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
  for (int s = 0; s < steps; ++s) {
    optimizer.zero_grad();
    const int passes = s == 1 ? 2 : 1;
    for (int p = 0; p < passes; ++p) {
      auto out = model.call([&](const torch::Tensor& in) { return ddp_net.forward(in); },
                            torch::randn({4, 8}, generator).to(device));
      auto scaled = amp::scale_loss(out.pow(2).mean(), optimizer, 0, /*delay_unscale=*/p + 1 < passes);
      scaled.backward();
      if (inside_scope && p + 1 == passes) inside_scope(optimizer);
    }
    if (s == 2) {  // a second loss with its own scaler
      auto out = model.call([&](const torch::Tensor& in) { return ddp_net.forward(in); },
                            torch::randn({4, 8}, generator).to(device));
      auto scaled = amp::scale_loss(out.abs().mean(), optimizer, 1);
      scaled.backward();
    }
    optimizer.step();
  }
  std::vector<torch::Tensor> masters;
  for (const auto& g : optimizer.inner().param_groups()) {
    for (const auto& p : g.params()) masters.push_back(p.detach().clone());
  }
  return masters;
}

/// Still inside the scale_loss scope after an attached backward: the consumer already wrote unscaled fp32 master
/// gradients and released the half model gradients, bucket by bucket during backward.
void check_consumed_during_backward(amp::Optimizer& optimizer, int rank) {
  for (const auto& slot : optimizer.state().slots()) {
    TORCH_CHECK(slot.has_master && slot.master.grad().defined() && !slot.model.grad().defined(), "rank ", rank, ": ",
                slot.name, " was not consumed during backward");
    TORCH_CHECK(slot.master.grad().abs().max().item<float>() < 100.0f, "rank ", rank, ": ", slot.name,
                "'s master gradient still carries the loss scale");
  }
}

TEST(AmpDdpAttachTest, BucketsAreUnscaledDuringBackwardIntoMastersAndTrainLikeTheEndOfScopePass) {
  LTA_REQUIRE_GLOO();
  ddp::spawn(2, [](int rank, int) {
    at::set_num_threads(1);
    const ddp::ProcessGroup group = ddp::init_process_group(ddp::InitOptions().timeout(std::chrono::seconds(20)));
    int checked = 0;
    const auto attached = train(group, rank, true, 4, [&](amp::Optimizer& optimizer) {
      check_consumed_during_backward(optimizer, rank);
      ++checked;
    });
    TORCH_CHECK(checked == 4, "the in-scope check ran ", checked, " times");
    const auto at_scope_end = train(group, rank, false, 4);
    // The attached path rounds once (fp32 sum times average * inv_scale), the other twice (bf16 average, then
    // unscale): the same training up to bf16 rounding of the gradients. Both runs use the same kernels on the same
    // machine, so the kernel path does not enter: 4 SGD steps apart by one 2^-8 rounding of each gradient stay far
    // inside 2e-2 relative (+ 2e-3 for entries near 0) (Note [bounds on every CPU kernel path]).
    TORCH_CHECK(attached.size() == at_scope_end.size(), "parameter counts differ");
    for (size_t i = 0; i < attached.size(); ++i) {
      TORCH_CHECK(torch::allclose(attached[i], at_scope_end[i], 2e-2, 2e-3), "rank ", rank, ": master ", i,
                  " differs by ", (attached[i] - at_scope_end[i]).abs().max().item<double>());
    }
    // Both ranks hold the same masters.
    for (const auto& m : attached) {
      auto root = m.clone();
      group.broadcast_(root, 0);
      TORCH_CHECK(torch::equal(root, m), "rank ", rank, ": masters diverged across ranks");
    }
  });
}

TEST(AmpDdpAttachTest, OnTheGpuBucketsAreUnscaledOnTheCommunicationStreamLikeAtScopeEnd) {
  if (!ddp::backend_available("nccl")) GTEST_SKIP() << "needs the NCCL backend (a CUDA build)";
  ddp_test::ScratchDir dir;  // the parent must not initialize CUDA before forking: the child looks for the GPU
  ddp::spawn(1, [&](int rank, int) {
    if (!torch::cuda::is_available()) {
      std::ofstream(dir.file("no_gpu")) << "none";
      return;
    }
    const ddp::ProcessGroup group =
        ddp::init_process_group(ddp::InitOptions().backend("nccl").cuda_device(0).timeout(ddp_test::kTestTimeout));
    const torch::Device cuda(torch::kCUDA, 0);
    int checked = 0;
    const auto attached = train(
        group, rank, true, 4,
        [&](amp::Optimizer& optimizer) {
          check_consumed_during_backward(optimizer, rank);
          ++checked;
        },
        cuda, torch::kHalf);
    TORCH_CHECK(checked == 4, "the in-scope check ran ", checked, " times");
    const auto at_scope_end = train(group, rank, false, 4, nullptr, cuda, torch::kHalf);
    for (size_t i = 0; i < attached.size(); ++i) {
      TORCH_CHECK(torch::allclose(attached[i], at_scope_end[i], 1e-2, 1e-3), "master ", i, " differs by ",
                  (attached[i] - at_scope_end[i]).abs().max().item<double>());
    }
  });
  if (std::ifstream(dir.file("no_gpu")).good()) GTEST_SKIP() << "needs a CUDA GPU; none is present";
}

TEST(AmpDdpAttachTest, MixingUnscaledAndScaledMasterlessGradientsInOneScopeIsRefused) {
  LTA_REQUIRE_GLOO();
  ddp::spawn(2, [](int rank, int) {
    const ddp::ProcessGroup group = ddp::init_process_group(ddp::InitOptions().timeout(std::chrono::seconds(20)));
    torch::manual_seed(1);
    Net net;  // O1: fp32 parameters, no masters: the consumer unscales .grad in place
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    auto [model, optimizer] = amp::initialize(net, sgd, amp::Options().opt_level(amp::OptLevel::O1));
    // One parameter per bucket: a refusal in the first bucket leaves the later ones' allreduces in flight, and DDP
    // must let them finish before the next backward writes the buckets again.
    ddp::DistributedDataParallel ddp_net(
        net, group, ddp::DistributedDataParallelOptions().first_bucket_mb(1e-6).bucket_cap_mb(1e-6));
    TORCH_CHECK(ddp_net.buckets().size() > 1, "the test needs several buckets");
    optimizer.attach(ddp_net);
    const auto x = torch::randn({4, 8}, at::make_generator<at::CPUGeneratorImpl>(5 + rank));
    using ddp_test::error_of;
    // Two synchronized backward passes in one scope.
    const std::string twice = error_of([&] {
      auto out = model.call([&](const torch::Tensor& in) { return ddp_net.forward(in); }, x);
      auto scaled = amp::scale_loss(out.pow(2).mean(), optimizer);
      scaled.backward(/*retain_graph=*/true);
      scaled.backward();
    });
    TORCH_CHECK(twice.find("second synchronized backward") != std::string::npos, "rank ", rank, ": got '", twice, "'");
    // A synchronized backward, then one under no_sync, in one scope.
    optimizer.zero_grad();
    const std::string after = error_of([&] {
      auto out = model.call([&](const torch::Tensor& in) { return ddp_net.forward(in); }, x);
      auto scaled = amp::scale_loss(out.pow(2).mean(), optimizer);
      scaled.backward(/*retain_graph=*/true);
      auto no_sync = ddp_net.no_sync();
      scaled.backward();
    });
    TORCH_CHECK(after.find("changed after DDP's reduced bucket was unscaled") != std::string::npos, "rank ", rank,
                ": got '", after, "'");
    // The supported way (earlier passes under no_sync) trains normally afterwards.
    optimizer.zero_grad();
    {
      auto out = model.call([&](const torch::Tensor& in) { return ddp_net.forward(in); }, x);
      auto scaled = amp::scale_loss(out.pow(2).mean(), optimizer);
      {
        auto no_sync = ddp_net.no_sync();
        scaled.backward(/*retain_graph=*/true);
      }
      scaled.backward();
    }
    optimizer.step();
    TORCH_CHECK(!optimizer.scaler().diagnostics_now().found_inf, "rank ", rank, ": unexpected overflow");
    TORCH_CHECK(divergence_from_rank0(group, net->parameters()) == 0.0, "rank ", rank, ": parameters diverged");
  });
}

/// A parameter stored transposed: dense but non-contiguous, and autograd lays its gradient out alike, so DDP
/// copies it through the bucket tensor by tensor.
struct TransposedNetImpl : torch::nn::Module {
  TransposedNetImpl() {
    w = register_parameter("w", torch::randn({2, 8}).t());
    fc = register_module("fc", torch::nn::Linear(8, 2));
  }
  torch::Tensor forward(torch::Tensor x) { return fc(x) + x.matmul(w); }
  torch::Tensor w;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(TransposedNet);

TEST(AmpDdpAttachTest, NonContiguousGradientsTrainLikeTheEndOfScopePass) {
  LTA_REQUIRE_GLOO();
  ddp::spawn(2, [](int rank, int) {
    const ddp::ProcessGroup group = ddp::init_process_group(ddp::InitOptions().timeout(ddp_test::kTestTimeout));
    // O1 writes the unscaled average into .grad in place (a non-contiguous one is left to DDP's write-back and the
    // scope's end); O2 writes it into contiguous fp32 master gradients, whatever the model gradient's layout.
    for (const amp::OptLevel level : {amp::OptLevel::O1, amp::OptLevel::O2}) {
      std::vector<std::vector<torch::Tensor>> grads(2);
      for (const bool attach : {true, false}) {
        torch::manual_seed(3);
        TransposedNet net;
        TORCH_CHECK(!net->w.is_contiguous(), "the test needs a non-contiguous parameter");
        torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
        auto [model, optimizer] =
            amp::initialize(net, sgd, amp::Options().opt_level(level).half_dtype(torch::kBFloat16));
        ddp::DistributedDataParallel ddp_net(net, group);
        if (attach) optimizer.attach(ddp_net);
        const auto x = torch::randn({4, 8}, at::make_generator<at::CPUGeneratorImpl>(7 + rank));
        {
          auto out = model.call([&](const torch::Tensor& in) { return ddp_net.forward(in); }, x);
          auto scaled = amp::scale_loss(out.pow(2).mean(), optimizer);
          scaled.backward();
        }
        for (const auto& slot : optimizer.state().slots()) {
          const torch::Tensor& g = slot.has_master ? slot.master.grad() : slot.model.grad();
          TORCH_CHECK(g.defined(), "rank ", rank, ": ", slot.name, " has no gradient");
          grads[attach ? 0 : 1].push_back(g.to(torch::kFloat).contiguous());
        }
      }
      TORCH_CHECK(grads[0].size() == grads[1].size(), "gradient counts differ");
      // One backward, the same kernels on both sides: the two paths differ by one bf16 rounding (2^-8) of the
      // averaged gradient, inside 2e-2 / 2e-3 on any kernel path (Note [bounds on every CPU kernel path]).
      for (size_t i = 0; i < grads[0].size(); ++i) {
        TORCH_CHECK(torch::allclose(grads[0][i], grads[1][i], 2e-2, 2e-3), "rank ", rank, ", O",
                    static_cast<int>(level), ": gradient ", i, " differs by ",
                    (grads[0][i] - grads[1][i]).abs().max().item<double>());
      }
    }
  });
}

TEST(AmpDdpAttachTest, AttachingADdpOfAnotherModuleIsAnError) {
  LTA_REQUIRE_GLOO();
  ddp::spawn(1, [](int, int) {
    const ddp::ProcessGroup group = ddp::init_process_group();
    Net net, other;
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    auto [model, optimizer] = amp::initialize(net, sgd, amp::Options().opt_level(amp::OptLevel::O1));
    ddp::DistributedDataParallel wrong(other, group);
    try {
      optimizer.attach(wrong);
    } catch (const c10::Error& e) {
      TORCH_CHECK(std::string(e.what()).find("wraps a different module") != std::string::npos, e.what());
      return;
    }
    TORCH_CHECK(false, "attach accepted a DDP of another module");
  });
}

}  // namespace
