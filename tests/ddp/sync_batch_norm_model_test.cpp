// ddp::SyncBatchNorm in models: the converter replaces every BatchNorm wherever it sits, keeping its state, and DDP
// training with SyncBatchNorm on forked Gloo ranks equals single-process full-batch training. The layer itself:
// sync_batch_norm_test.cpp.

#include <ddp/sync_batch_norm.h>

#include <string>
#include <vector>

#include <ddp/distributed_data_parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

using ddp_test::check_close;
using ddp_test::contains_all;
// A model with BatchNorm in every place the converter looks: the root's registry (a member holder), a
// Sequential, a ModuleList, a ModuleDict, and a nested submodule.
struct InnerImpl : torch::nn::Module {
  InnerImpl() { bn = register_module("bn", torch::nn::BatchNorm1d(4)); }
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Inner);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    features = register_module(
        "features", torch::nn::Sequential(torch::nn::Conv2d(2, 3, 3), torch::nn::BatchNorm2d(3), torch::nn::ReLU()));
    list = register_module("list", torch::nn::ModuleList(torch::nn::BatchNorm3d(2)));
    dict = register_module("dict", torch::nn::ModuleDict(torch::OrderedDict<std::string, std::shared_ptr<Module>>(
                                       {{"norm", torch::nn::BatchNorm2d(3).ptr()}})));
    head_bn = register_module("head_bn", torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(4).affine(false)));
    inner = register_module("inner", Inner());
    linear = register_module("linear", torch::nn::Linear(3, 4));
  }
  /// Forward through the registry and the containers (see convert_sync_batch_norm's limitation).
  std::vector<torch::Tensor> forward(const torch::Tensor& image, const torch::Tensor& volume) {
    auto children = named_children();
    auto h = features->forward(image);
    h = dict["norm"]->as<ddp::SyncBatchNorm>() ? dict["norm"]->as<ddp::SyncBatchNorm>()->forward(h)
                                               : dict["norm"]->as<torch::nn::BatchNorm2d>()->forward(h);
    auto v = list->ptr(0)->as<ddp::SyncBatchNorm>() ? list->ptr(0)->as<ddp::SyncBatchNorm>()->forward(volume)
                                                    : list->ptr(0)->as<torch::nn::BatchNorm3d>()->forward(volume);
    auto f = linear->forward(h.mean({2, 3}));
    for (const std::string name : {"head_bn"}) {
      auto& m = children[name];
      f = m->as<ddp::SyncBatchNorm>() ? m->as<ddp::SyncBatchNorm>()->forward(f)
                                      : m->as<torch::nn::BatchNorm1d>()->forward(f);
    }
    auto& in = children["inner"]->named_children()["bn"];
    f = in->as<ddp::SyncBatchNorm>() ? in->as<ddp::SyncBatchNorm>()->forward(f)
                                     : in->as<torch::nn::BatchNorm1d>()->forward(f);
    return {f, v};
  }
  torch::nn::Sequential features{nullptr};
  torch::nn::ModuleList list{nullptr};
  torch::nn::ModuleDict dict{nullptr};
  torch::nn::BatchNorm1d head_bn{nullptr};
  Inner inner{nullptr};
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(Net);

TEST(SyncBatchNormTest, ConverterReplacesEveryBatchNormKeepingStateBitForBitAndEvalOutputs) {
  torch::manual_seed(test_util::fresh_seed());
  Net net;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters()) p.copy_(torch::randn_like(p));
    for (auto& b : net->named_buffers()) {
      if (b.key().find("num_batches_tracked") != std::string::npos) {
        b.value().fill_(7);
      } else {
        b.value().copy_(torch::rand_like(b.value()) + 0.5);
      }
    }
  }
  net->eval();
  const auto image = torch::randn({2, 2, 6, 6});
  const auto volume = torch::randn({2, 2, 3, 3, 3});
  const auto before = net->forward(image, volume);
  std::vector<std::pair<std::string, torch::Tensor>> state_before;
  for (const auto& p : net->named_parameters()) state_before.emplace_back(p.key(), p.value().clone());
  for (const auto& b : net->named_buffers()) state_before.emplace_back(b.key(), b.value().clone());

  std::string logged;
  auto root = ddp::convert_sync_batch_norm(net.ptr(), std::nullopt, [&](const std::string& l) { logged = l; });
  EXPECT_EQ(root.get(), net.ptr().get());
  EXPECT_TRUE(
      contains_all(logged, {"replaced 5 BatchNorm", "features.1", "list.0", "dict.norm", "head_bn", "inner.bn"}));
  // The two held by member holders are named in the warning; the containers' elements are not.
  const std::string warning = logged.substr(logged.find("WARNING"));
  EXPECT_TRUE(contains_all(warning, {"2 replaced", "head_bn", "inner.bn"}));
  EXPECT_EQ(warning.find("features.1"), std::string::npos) << warning;
  int64_t sync_count = 0;
  for (const auto& m : net->modules()) {
    EXPECT_EQ(m->as<torch::nn::BatchNorm1d>(), nullptr);
    EXPECT_EQ(m->as<torch::nn::BatchNorm2d>(), nullptr);
    EXPECT_EQ(m->as<torch::nn::BatchNorm3d>(), nullptr);
    if (auto* s = m->as<ddp::SyncBatchNorm>()) {
      ++sync_count;
      EXPECT_FALSE(s->is_training());
    }
  }
  EXPECT_EQ(sync_count, 5);
  EXPECT_EQ(net->features[1]->as<ddp::SyncBatchNorm>()->options.dimensionality(), 2);
  EXPECT_EQ(net->list->ptr(0)->as<ddp::SyncBatchNorm>()->options.dimensionality(), 3);
  EXPECT_FALSE(net->named_children()["head_bn"]->as<ddp::SyncBatchNorm>()->options.affine());

  std::vector<std::pair<std::string, torch::Tensor>> state_after;
  for (const auto& p : net->named_parameters()) state_after.emplace_back(p.key(), p.value());
  for (const auto& b : net->named_buffers()) state_after.emplace_back(b.key(), b.value());
  ASSERT_EQ(state_after.size(), state_before.size());
  for (size_t i = 0; i < state_after.size(); ++i) {
    EXPECT_EQ(state_after[i].first, state_before[i].first);
    EXPECT_EQ(state_after[i].second.scalar_type(), state_before[i].second.scalar_type()) << state_after[i].first;
    EXPECT_TRUE(torch::equal(state_after[i].second, state_before[i].second)) << state_after[i].first;
  }
  const auto after = net->forward(image, volume);
  EXPECT_TRUE(torch::equal(after[0], before[0]));
  EXPECT_TRUE(torch::equal(after[1], before[1]));

  // The state loads back into plain BatchNorm: same names, same shapes.
  Net plain;
  for (auto& p : plain->named_parameters()) EXPECT_NE(net->named_parameters().find(p.key()), nullptr) << p.key();
  for (auto& b : plain->named_buffers()) EXPECT_NE(net->named_buffers().find(b.key()), nullptr) << b.key();
}

TEST(SyncBatchNormTest, ConverterReturnsAModelWithoutBatchNormUnchangedAndConvertsABatchNormRoot) {
  torch::nn::Sequential mlp(torch::nn::Linear(3, 4), torch::nn::ReLU());
  std::string logged;
  const auto log = [&](const std::string& l) { logged = l; };
  EXPECT_EQ(ddp::convert_sync_batch_norm(mlp.ptr(), std::nullopt, log).get(), mlp.ptr().get());
  EXPECT_TRUE(contains_all(logged, {"no BatchNorm1d/2d/3d", "unchanged"}));

  torch::nn::BatchNorm2d bn(5);
  auto root = ddp::convert_sync_batch_norm(bn.ptr(), std::nullopt, log);
  ASSERT_NE(root->as<ddp::SyncBatchNorm>(), nullptr);
  EXPECT_TRUE(contains_all(logged, {"replaced 1", "(root)"}));
  EXPECT_EQ(ddp::set_sync_batch_norm_process_group(*root, std::nullopt), 1);
}

using ddp_test::make_bn_cnn;

TEST(SyncBatchNormTest, DdpTrainingWithSyncBatchNormEqualsSingleProcessFullBatchTraining) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  constexpr int kSteps = 20;
  constexpr int64_t kFullBatch = 16;
  constexpr double kLr = 0.1;
  ddp_test::run_ranks(
      [&](int rank, const ddp::ProcessGroup& pg) {
        // In fp64 on both sides: 20 SGD steps amplify rounding differences, and two correct fp32 implementations of
        // the statistics (ATen's BatchNorm kernel, SyncBatchNorm's own sums) drift apart by up to ~4e-4 in about 1% of
        // seeds. fp64 leaves the algorithm (global statistics, synchronized gradients) as the only possible difference,
        // so the bound can be tight; the fp32 and half numerics are checked step by step against fp64 above.
        const auto data_for = [&](int step) {
          torch::manual_seed(seed + 1000 + static_cast<uint64_t>(step));
          return std::make_pair((torch::randn({kFullBatch, 1, 6, 6}) + 1).to(torch::kDouble),
                                torch::randint(0, 3, {kFullBatch}));
        };
        // The reference: BatchNorm on the full batch in one process.
        auto ref = make_bn_cnn(seed);
        ref->to(torch::kDouble);
        torch::optim::SGD ref_opt(ref->parameters(), kLr);
        for (int step = 0; step < kSteps; ++step) {
          const auto [x, y] = data_for(step);
          ref_opt.zero_grad();
          torch::cross_entropy_loss(ref->forward(x), y).backward();
          ref_opt.step();
        }

        // DDP over 2 ranks, each with half the batch, the BatchNorms converted (rank 1 starts from other weights: DDP
        // broadcasts rank 0's).
        auto model = make_bn_cnn(seed + static_cast<uint64_t>(rank));
        model->to(torch::kDouble);
        ddp::convert_sync_batch_norm(model.ptr(), pg, [](const std::string&) {});
        ddp::DistributedDataParallel ddp(model, pg);
        torch::optim::SGD opt(model->parameters(), kLr);
        const int64_t per = kFullBatch / pg.size();
        for (int step = 0; step < kSteps; ++step) {
          const auto [x, y] = data_for(step);
          opt.zero_grad();
          torch::cross_entropy_loss(ddp.forward(x.narrow(0, rank * per, per)), y.narrow(0, rank * per, per)).backward();
          opt.step();
        }
        const auto ref_state = ref->named_parameters();
        for (const auto& p : model->named_parameters()) {
          check_close(p.value(), ref_state[p.key()], 1e-9, 1e-11, c10::str("rank ", rank, " parameter ", p.key()));
        }
        const auto ref_buffers = ref->named_buffers();
        for (const auto& b : model->named_buffers()) {
          check_close(b.value(), ref_buffers[b.key()], 1e-9, 1e-11, c10::str("rank ", rank, " buffer ", b.key()));
        }
        // And the parameters moved, so the comparison means something.
        const auto start = make_bn_cnn(seed);
        TORCH_CHECK(!torch::allclose(start->parameters()[0].to(torch::kDouble), model->parameters()[0]),
                    "the parameters did not move");
      },
      2);
}

}  // namespace
