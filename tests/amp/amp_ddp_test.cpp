// amp and ddp together (the seed's Apex way): gradients are allreduced while still scaled, so an inf on one rank
// reaches every rank through the sum, every rank raises the same found_inf without an extra collective, and
// every rank skips the same step.
#include <string>
#include <vector>

#include <amp/amp.h>
#include <amp/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>
#include <ddp/spawn.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

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

TEST(AmpDdpTest, InfOnOneRankMakesEveryRankSkipTheSameStep) {
  if (!ddp::backend_available("gloo")) GTEST_SKIP() << "needs the Gloo backend (apt-get install libgloo-dev)";
  ddp::spawn(2, [](int rank, int) {
    const ddp::ProcessGroup group = ddp::init_process_group(ddp::InitOptions().timeout(std::chrono::seconds(20)));
    torch::manual_seed(1);  // the same initial weights everywhere (DDP also broadcasts them from rank 0)
    Net net;
    amp::FusedSGD sgd(net->parameters(), amp::FusedSgdOptions(0.1).momentum(0.9));
    auto [model, optimizer] = amp::initialize(
        net, sgd, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16).dynamic_loss_scale());
    ddp::DistributedDataParallel ddp_net(net, group);
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

}  // namespace
