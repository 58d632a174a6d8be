// ZeRO's deferred publish (amp::ZeroPublish::kAtNextForward, Note [deferred publish] in amp/zero/zero_publish.cpp): the
// parameter all-gather a step starts completes at the next forward through amp::Model, the run ends bit-identical to
// the in-step publish, and a forward that bypasses amp::Model is refused at the next scale_loss. Gloo on CPU, forked
// ranks.
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "amp/zero_test_util.h"
#include "ddp/ddp_test_util.h"

namespace {

using zero_test::bit_identical;

/// Sizes that divide by neither 2 nor 4 (parameters straddle the ranks' slices), several buckets below.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    a = register_module("a", torch::nn::Linear(7, 13));
    b = register_module("b", torch::nn::Linear(13, 5));
  }
  torch::Tensor forward(torch::Tensor x) { return b(torch::tanh(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Net);

struct Batch {
  torch::Tensor x, y;
};

/// The data of step `s` on `rank` (the same in every run).
Batch batch(int rank, int s) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 * rank + s);
  torch::Tensor x = torch::randn({6, 7}, generator);
  torch::Tensor y = torch::randn({6, 5}, generator);
  return {x, y};
}

/// DDP + amp O2 (bf16, dynamic loss scale), FusedAdam in AdamW mode, attached with a stage and a publish mode.
struct Training {
  Net net;
  std::unique_ptr<amp::FusedAdam> adam;  // outlives amp's state (declared first, destroyed last)
  std::unique_ptr<amp::Initialized<Net>> amp_;
  std::unique_ptr<ddp::DistributedDataParallel> ddp_net;
  int rank;

  Training(const ddp::ProcessGroup& pg, amp::ZeroStage stage, amp::ZeroPublish publish) : rank(pg.rank()) {
    torch::manual_seed(1);
    net = Net();
    adam = std::make_unique<amp::FusedAdam>(
        net->parameters(), amp::FusedAdamOptions(1e-2).weight_decay(1e-2).decoupled_weight_decay(true));
    amp_ = std::make_unique<amp::Initialized<Net>>(
        amp::initialize(net, *adam, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16)));
    ddp_net = std::make_unique<ddp::DistributedDataParallel>(
        net, pg,
        ddp::DistributedDataParallelOptions().first_bucket_mb(1e-4).bucket_cap_mb(3e-4).rebuild_buckets(false));
    amp_->optimizer.attach(*ddp_net, stage, publish);
    amp_->optimizer.set_overflow_logger([](const std::string&) {});  // the planted overflow is expected
  }
  amp::Optimizer& optimizer() { return amp_->optimizer; }

  /// One step on batch(rank, s), the forward through amp::Model; rank 1's input holds an inf when s == inf_step.
  /// Returns the loss.
  float train_step(int s, int inf_step = -1) {
    Batch b = batch(rank, s);
    if (s == inf_step && rank == 1) b.x[0][0] = std::numeric_limits<float>::infinity();
    optimizer().zero_grad();
    const torch::Tensor out = amp_->model.call([&](const torch::Tensor& in) { return ddp_net->forward(in); }, b.x);
    const torch::Tensor loss = (out - b.y).pow(2).mean();
    {
      auto scaled = amp::scale_loss(loss, optimizer());
      scaled.backward();
    }
    optimizer().step();
    return loss.item<float>();
  }
  /// A forward through DDP and the module, bypassing amp::Model (so the input is cast by hand); fp32 output.
  torch::Tensor raw_forward(const torch::Tensor& x) {
    return ddp_net->forward(x.to(torch::kBFloat16)).to(torch::kFloat);
  }
  std::vector<torch::Tensor> masters() { return zero_test::full_masters(optimizer()); }
  std::vector<torch::Tensor> parameters() { return zero_test::parameters_of(*net); }
};

/// Runs `check(rank, stage, deferred, in_step)` on 2 Gloo ranks for stages 1 and 2, after `steps` training steps of a
/// deferred-publish run and an in-step run side by side.
void after_steps_side_by_side(int steps, const std::function<void(int, int, Training&, Training&)>& check) {
  for (const int stage : {1, 2}) {
    ddp_test::run_ranks(
        [&](int rank, const ddp::ProcessGroup& pg) {
          const auto zero_stage = static_cast<amp::ZeroStage>(stage);
          Training deferred(pg, zero_stage, amp::ZeroPublish::kAtNextForward);
          Training in_step(pg, zero_stage, amp::ZeroPublish::kInStep);
          for (int s = 0; s < steps; ++s) {
            deferred.train_step(s);
            in_step.train_step(s);
          }
          check(rank, stage, deferred, in_step);
        },
        2);
  }
}

const char* publish_name(amp::ZeroPublish publish) {
  return publish == amp::ZeroPublish::kInStep ? "in-step" : "at-next-forward";
}

TEST(ZeroPublishTest, DeferredPublishEndsBitIdenticalToInStepThroughASkippedStepAndCheckpoints) {
  LTA_REQUIRE_GLOO();
  ddp_test::ScratchDir dir;
  for (const int stage : {1, 2}) {
    ddp_test::run_ranks(
        [&](int rank, const ddp::ProcessGroup& pg) {
          struct Result {
            std::vector<float> losses;
            std::vector<int64_t> skipped;
            std::vector<torch::Tensor> masters, parameters;
          };
          // 12 steps, step 5 overflowing on rank 1 (every rank skips it). Right after step 3 (its publish pending
          // under kAtNextForward) a consolidated and a sharded save; right after step 7 the consolidated file is
          // loaded and right after step 9 the sharded one: the pending publish must neither be saved stale nor
          // overwrite what the load wrote.
          auto run = [&](amp::ZeroPublish publish) {
            const std::string tag = std::to_string(stage) + publish_name(publish);
            const std::string consolidated = dir.file(tag + ".ckpt"), sharded = dir.file(tag + ".sharded.ckpt");
            Training r(pg, static_cast<amp::ZeroStage>(stage), publish);
            Result out;
            for (int s = 0; s < 12; ++s) {
              out.losses.push_back(r.train_step(s, /*inf_step=*/5));
              out.skipped.push_back(static_cast<int64_t>(r.optimizer().last_step_now().skipped));
              if (s == 3) {
                amp::save_checkpoint(consolidated, r.amp_->model, r.optimizer());
                amp::save_checkpoint_sharded(sharded, r.amp_->model, r.optimizer());
              }
              if (s == 7) amp::load_checkpoint(consolidated, r.amp_->model, r.optimizer());
              if (s == 9) amp::load_checkpoint(sharded, r.amp_->model, r.optimizer());
            }
            r.optimizer().wait_for_parameters();  // the raw module's parameters are read next
            out.masters = r.masters();
            out.parameters = r.parameters();
            return out;
          };
          const Result in_step = run(amp::ZeroPublish::kInStep);
          const Result deferred = run(amp::ZeroPublish::kAtNextForward);
          const std::vector<int64_t> expected_skips{0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0};
          TORCH_CHECK(in_step.skipped == expected_skips, "rank ", rank, ", stage ", stage,
                      ": the in-step run did not skip exactly step 5");
          TORCH_CHECK(deferred.skipped == in_step.skipped, "rank ", rank, ", stage ", stage, ": other steps skipped");
          TORCH_CHECK(deferred.losses == in_step.losses, "rank ", rank, ", stage ", stage, ": losses differ");
          TORCH_CHECK(bit_identical(deferred.masters, in_step.masters), "rank ", rank, ", stage ", stage,
                      ": masters differ");
          TORCH_CHECK(bit_identical(deferred.parameters, in_step.parameters), "rank ", rank, ", stage ", stage,
                      ": model parameters differ");
        },
        2);
  }
}

TEST(ZeroPublishTest, AForwardThatBypassesAmpModelAfterADeferredStepIsRefusedAtTheNextScaleLoss) {
  LTA_REQUIRE_GLOO();
  after_steps_side_by_side(2, [](int rank, int stage, Training& deferred, Training& in_step) {
    // The forward went through DDP's module, not amp::Model: it ran on the previous step's parameters.
    const torch::Tensor x = batch(rank, 2).x;
    const torch::Tensor stale = deferred.raw_forward(x).pow(2).mean();
    std::string message = ddp_test::error_of([&] {
      auto scaled = amp::scale_loss(stale, deferred.optimizer());
      scaled.backward();
    });
    TORCH_CHECK(ddp_test::contains_all(message, {"scale_loss began", "parameter all-gather was still pending",
                                                 "ZeroPublish::kAtNextForward", "did not go through amp::Model",
                                                 "optimizer.wait_for_parameters()"}),
                "rank ", rank, ", stage ", stage, ": ", message);
    // The stale forward is what went wrong, so it is named before scale_loss's own checks (here a loss_id out of
    // range): the check runs first, as it did before State's parts were split out.
    message = ddp_test::error_of([&] { amp::scale_loss(stale, deferred.optimizer(), /*loss_id=*/7); });
    TORCH_CHECK(ddp_test::contains_all(message, {"scale_loss began", "still pending"}), "rank ", rank, ", stage ",
                stage, ": ", message);
    // A synchronized backward outside a scope meets the same check at DDP's first reduced bucket.
    message = ddp_test::error_of([&] { deferred.raw_forward(x).pow(2).mean().backward(); });
    TORCH_CHECK(ddp_test::contains_all(message, {"synchronized backward pass", "still pending", "model.forward"}),
                "rank ", rank, ", stage ", stage, ": ", message);
    // Refused before anything changed: through amp::Model the run goes on as the in-step one.
    for (int s = 2; s < 4; ++s) {
      TORCH_CHECK(deferred.train_step(s) == in_step.train_step(s), "rank ", rank, ", stage ", stage,
                  ": the loss of step ", s, " differs after the refusals");
    }
    TORCH_CHECK(bit_identical(deferred.masters(), in_step.masters()), "rank ", rank, ", stage ", stage,
                ": masters differ after the refusals");
  });
}

TEST(ZeroPublishTest, WaitForParametersGivesAForwardThatBypassesAmpModelTheSteppedParameters) {
  LTA_REQUIRE_GLOO();
  after_steps_side_by_side(3, [](int rank, int stage, Training& deferred, Training& in_step) {
    // The caveat: until the wait the module holds the previous step's parameters.
    TORCH_CHECK(!bit_identical(deferred.parameters(), in_step.parameters()), "rank ", rank, ", stage ", stage,
                ": the module held the stepped parameters before the wait (was the publish deferred?)");
    deferred.optimizer().wait_for_parameters();
    TORCH_CHECK(bit_identical(deferred.parameters(), in_step.parameters()), "rank ", rank, ", stage ", stage,
                ": wait_for_parameters() did not bring the stepped parameters");
    deferred.optimizer().wait_for_parameters();  // nothing pending: nothing happens
    // A step driven by forwards that bypass amp::Model, each after the wait, is the in-step run's.
    for (int s = 3; s < 5; ++s) {
      const Batch b = batch(rank, s);
      float losses[2];
      Training* runs[2] = {&deferred, &in_step};
      for (int k = 0; k < 2; ++k) {
        runs[k]->optimizer().wait_for_parameters();
        runs[k]->optimizer().zero_grad();
        const torch::Tensor loss = (runs[k]->raw_forward(b.x) - b.y).pow(2).mean();
        {
          auto scaled = amp::scale_loss(loss, runs[k]->optimizer());
          scaled.backward();
        }
        runs[k]->optimizer().step();
        losses[k] = loss.item<float>();
      }
      TORCH_CHECK(losses[0] == losses[1], "rank ", rank, ", stage ", stage, ": the loss of step ", s, " differs");
    }
    deferred.optimizer().wait_for_parameters();
    TORCH_CHECK(bit_identical(deferred.masters(), in_step.masters()) &&
                    bit_identical(deferred.parameters(), in_step.parameters()),
                "rank ", rank, ", stage ", stage, ": masters or parameters differ");
  });
}

TEST(ZeroPublishTest, DeferringWithoutZeroIsRefused) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        torch::manual_seed(1);
        Net net;
        amp::FusedAdam adam(net->parameters(), amp::FusedAdamOptions(1e-2));
        auto [model, optimizer] = amp::initialize(net, adam, amp::Options().opt_level(amp::OptLevel::O2));
        ddp::DistributedDataParallel ddp_net(net, pg);
        const std::string message = ddp_test::error_of(
            [&] { optimizer.attach(ddp_net, amp::ZeroStage::kNone, amp::ZeroPublish::kAtNextForward); });
        TORCH_CHECK(ddp_test::contains_all(message, {"no all-gather to defer", "ZeroStage::kOne or kTwo"}), "rank ",
                    rank, ": ", message);
        optimizer.wait_for_parameters();  // without ZeRO: nothing to wait for
      },
      2);
}

}  // namespace
