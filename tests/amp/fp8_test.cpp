// FP8 training under amp (docs/fp8.md): amp::Float8Linear as a layer, and training with O1/O2 + FP8 (convergence
// against bf16, skipped steps, checkpoints, ZeRO and DDP). The kernels and scaling rules: fp8_kernels_test.cpp.

#include <amp/nn/float8_linear.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <amp/amp.h>
#include <amp/autocast.h>
#include <amp/fp8/fp8_state.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "amp/fp8_test_util.h"
#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

using amp::Fp8Recipe;
using amp::Fp8Scaling;
using test_util::expect_error;

// ---- The layer ------------------------------------------------------------------------------------------------

// Same parameter names, initialization draws and checkpoint layout as torch::nn::Linear, and exactly Linear's
// results until FP8 is enabled.
TEST(Float8LinearTest, IsADropInForTorchLinear) {
  torch::manual_seed(11);
  torch::nn::Linear linear(48, 32);
  torch::manual_seed(11);
  amp::Float8Linear fp8(48, 32);
  ASSERT_EQ(linear->named_parameters().keys(), fp8->named_parameters().keys());
  EXPECT_TRUE(torch::equal(linear->weight, fp8->weight));
  EXPECT_TRUE(torch::equal(linear->bias, fp8->bias));
  const auto x = torch::randn({5, 48});
  EXPECT_TRUE(torch::equal(linear(x), fp8(x)));
  // A Linear checkpoint loads into Float8Linear.
  char path[] = "/tmp/lta_fp8_linearXXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  torch::manual_seed(12);
  torch::nn::Linear other(48, 32);
  torch::save(other, path);
  torch::load(fp8, path);
  std::remove(path);
  EXPECT_TRUE(torch::equal(other->weight, fp8->weight));
  EXPECT_TRUE(torch::equal(other(x), fp8(x)));
}

TEST(Float8LinearTest, RefusesDimensionsTheFp8GemmCannotTakeNamingThem) {
  amp::Float8Linear odd(10, 32);
  EXPECT_NE(odd->fp8_ineligibility().find("in_features=10 is not a multiple of 16"), std::string::npos);
  expect_error([&] { odd->enable_fp8(Fp8Recipe()); }, "Float8Linear(10 -> 32) cannot run in FP8: in_features=10");
  expect_error([] { amp::Float8Linear(16, 16)->enable_fp8(Fp8Recipe().amax_history_len(0)); },
               "amax_history_len must be in [1, 1048576], got 0");
  expect_error([] { amp::Float8Linear(16, 16)->enable_fp8(Fp8Recipe().margin(64)); },
               "margin must be in [0, 63], got 64");
  amp::Float8Linear layer(16, 16);
  layer->enable_fp8(Fp8Recipe());
  expect_error([&] { layer(torch::randn({4, 15})); }, "input's last dimension must be in_features=16");
  // An evaluation forward under no_grad casts with the current scales and records nothing.
  {
    torch::NoGradGuard no_grad;
    layer(torch::randn({4, 16}));
  }
  EXPECT_EQ(layer->fp8_meta().history.abs().sum().item<float>(), 0.0f);
}

// ---- amp::Options::fp8 ----------------------------------------------------------------------------------------

TEST(Fp8AmpTest, OptionsAcceptO1AndO2AndNameTheRecipe) {
  const auto o2 = amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16).fp8(Fp8Recipe());
  EXPECT_NE(o2.to_string().find("fp8=scaling=delayed,format=hybrid,history=1024,margin=0,amax=max"), std::string::npos);
  EXPECT_EQ(amp::Options().to_string().find("fp8"), std::string::npos) << "no FP8: the text older checkpoints have";
  expect_error([] { amp::Options().opt_level(amp::OptLevel::O0).fp8(Fp8Recipe()).resolve(); },
               "fp8() needs opt level O1 or O2, got O0");
  expect_error([] { amp::Options().opt_level(amp::OptLevel::O3).fp8(Fp8Recipe()).resolve(); },
               "fp8() needs opt level O1 or O2, got O3");
}

/// A model with two FP8-able layers, one whose width the GEMM cannot take, and a plain Linear.
struct MixedNetImpl : torch::nn::Module {
  MixedNetImpl() {
    a = register_module("a", amp::Float8Linear(32, 64));
    b = register_module("b", amp::Float8Linear(64, 48));
    odd = register_module("odd", amp::Float8Linear(48, 10));
    plain = register_module("plain", torch::nn::Linear(10, 10));
  }
  torch::Tensor forward(torch::Tensor x) { return plain(odd(torch::gelu(b(torch::gelu(a(x)))))); }
  amp::Float8Linear a{nullptr}, b{nullptr}, odd{nullptr};
  torch::nn::Linear plain{nullptr};
};
TORCH_MODULE(MixedNet);

amp::Options o2_fp8(const Fp8Recipe& recipe = Fp8Recipe().amax_history_len(16)) {
  return amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16).fp8(recipe);
}

TEST(Fp8AmpTest, InitializeRunsEligibleLayersInFp8AndLogsTheRest) {
  torch::manual_seed(5);
  MixedNet net;
  amp::FusedAdam adam(net->parameters(), amp::FusedAdamOptions(1e-3));
  auto [model, optimizer] = amp::initialize(net, adam, o2_fp8());
  EXPECT_TRUE(net->a->fp8_enabled());
  EXPECT_TRUE(net->b->fp8_enabled());
  EXPECT_FALSE(net->odd->fp8_enabled());
  const auto report = optimizer.fp8_report();
  ASSERT_EQ(report.size(), 3u);
  EXPECT_NE(report[0].find("'odd' stays in its amp precision: out_features=10 is not a multiple of 16"),
            std::string::npos)
      << report[0];
  EXPECT_NE(report[1].find("'plain' is a torch::nn::Linear and stays in its amp precision"), std::string::npos)
      << report[1];
  EXPECT_NE(report[2].find("2 of 3 Float8Linear layers run in FP8"), std::string::npos) << report[2];
  expect_error([&] { net->a->update_fp8_scales(); }, "this layer's FP8 state belongs to amp");
  // The layers' state is amp's: one buffer, the layers hold views of it.
  EXPECT_EQ(optimizer.state().fp8()->history().sizes(), (std::vector<int64_t>{6, 16}));
  EXPECT_EQ(net->b->fp8_meta().history.data_ptr<float>(), optimizer.state().fp8()->history()[3].data_ptr<float>());
  const auto y = model(torch::randn({4, 32}));
  EXPECT_EQ(y.scalar_type(), torch::kFloat);
}

/// One amp step of `model` (forwarding through `forward`, e.g. DDP's) on (x, target) with an MSE loss; the loss.
template <typename Model, typename Forward>
float amp_step(Model& model, amp::Optimizer& optimizer, const Forward& forward, const torch::Tensor& x,
               const torch::Tensor& target) {
  optimizer.zero_grad();
  const torch::Tensor loss = torch::mse_loss(model.call(forward, x), target);
  {
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
  }
  optimizer.step();
  return loss.item<float>();
}

struct Fp8Run {
  std::vector<torch::Tensor> params;
  torch::Tensor history, scale;
  std::vector<float> losses;
  std::vector<int64_t> skipped;
};

/// Trains MixedNet under O2 + FP8 with FusedAdamW for `steps` steps of the seeded data (an inf in the input at
/// `inf_step`), optionally saving a checkpoint after `save_after` steps or starting from `resume`.
Fp8Run train_mixed(int steps, const Fp8Recipe& recipe, int inf_step = -1, int save_after = -1,
                   const std::string& checkpoint = "", bool resume = false) {
  torch::manual_seed(21);
  MixedNet net;
  amp::FusedAdam adam(net->parameters(), amp::FusedAdamOptions(3e-3).weight_decay(1e-2).decoupled_weight_decay(true));
  auto [model, optimizer] = amp::initialize(net, adam, o2_fp8(recipe));
  int first = 0;
  if (resume) {
    amp::load_checkpoint(checkpoint, model, optimizer);
    first = save_after;
  }
  Fp8Run run;
  for (int s = first; s < steps; ++s) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 + s);
    torch::Tensor x = torch::randn({24, 32}, generator) * 4.0;
    const torch::Tensor target = torch::randn({24, 10}, generator);
    if (s == inf_step) x[3][5] = std::numeric_limits<float>::infinity();
    optimizer.zero_grad();
    const auto loss = torch::mse_loss(model(x), target);
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
    run.losses.push_back(loss.item<float>());
    run.skipped.push_back(static_cast<int64_t>(optimizer.last_step_now().skipped));
    if (s + 1 == save_after && !resume) amp::save_checkpoint(checkpoint, model, optimizer);
  }
  for (const auto& p : net->parameters()) run.params.push_back(p.detach().clone());
  run.history = optimizer.state().fp8()->history().clone();
  run.scale = optimizer.state().fp8()->scale().clone();
  return run;
}

// A non-finite amax (an inf in a forward input, which the cast saturates, so the loss stays finite) skips the
// step as an overflow would: parameters, histories and scales are those of a run without that step's update.
TEST(Fp8AmpTest, ANonFiniteAmaxSkipsTheStepAndKeepsTheHistoryClean) {
  const Fp8Recipe recipe = Fp8Recipe().amax_history_len(8);
  const Fp8Run clean = train_mixed(4, recipe);
  const Fp8Run with_inf = train_mixed(5, recipe, /*inf_step=*/4);
  EXPECT_EQ(with_inf.skipped[4], 1);
  EXPECT_TRUE(std::isfinite(with_inf.losses[4])) << "the saturating cast keeps the loss finite";
  EXPECT_EQ(clean.skipped, std::vector<int64_t>(4, 0));
  for (size_t i = 0; i < clean.params.size(); ++i) EXPECT_TRUE(torch::equal(clean.params[i], with_inf.params[i]));
  EXPECT_TRUE(torch::equal(clean.history, with_inf.history));
  EXPECT_TRUE(torch::equal(clean.scale, with_inf.scale));
  EXPECT_FALSE(torch::equal(clean.scale, torch::ones_like(clean.scale))) << "the scales moved from 1";
}

// fp16 with dynamic loss scaling: an output gradient that overflows fp16 is clipped by the saturating E5M2 cast, so
// the weight gradient of a bias-free FP8 layer stays finite; its amax is inf all the same, and that counts as the
// loss's overflow: the scale backs off and the step is skipped, until the gradients fit and training goes on.
TEST(Fp8AmpTest, AnOverflowingOutputGradientBacksOffTheLossScale) {
  torch::manual_seed(19);
  amp::Float8Linear layer(amp::Float8LinearOptions(32, 16).bias(false));
  amp::FusedSGD sgd(layer->parameters(), amp::FusedSgdOptions(1e-4));
  auto [model, optimizer] = amp::initialize(
      layer, sgd, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kHalf).fp8(Fp8Recipe()));
  // Small inputs keep the weight gradient finite even from saturated output gradients (57344 x 1e-3 x 32 rows).
  const auto x = torch::randn({32, 32}) * 1e-3;
  const auto target = torch::full({32, 16}, 1000.0f);  // dy = scale * 2 (y - t) / 512: beyond fp16 at 2^16, 2^15
  std::vector<float> scales;
  std::vector<int64_t> skipped;
  for (int s = 0; s < 4; ++s) {
    amp_step(
        model, optimizer, [&](const torch::Tensor& in) { return model->forward(in); }, x, target);
    scales.push_back(optimizer.scaler().diagnostics_now().scale);
    skipped.push_back(static_cast<int64_t>(optimizer.last_step_now().skipped));
  }
  EXPECT_EQ(skipped, (std::vector<int64_t>{1, 1, 0, 0}));
  EXPECT_EQ(scales, (std::vector<float>{32768.0f, 16384.0f, 16384.0f, 16384.0f}));
  EXPECT_TRUE(torch::isfinite(optimizer.state().fp8()->history()).all().item<bool>());
}

// The output is a tensor of its own (not a view), so in-place ops on it work as on Linear's.
TEST(Float8LinearTest, InPlaceOpsOnTheOutputWork) {
  torch::manual_seed(23);
  amp::Float8Linear layer(32, 16);
  layer->enable_fp8(Fp8Recipe());
  const auto x = torch::randn({5, 32}).requires_grad_(true);
  auto y = layer(x);
  y.add_(1.0);  // on the layer's output itself
  y.relu_();
  y.sum().backward();
  EXPECT_TRUE(x.grad().defined());
  EXPECT_TRUE(layer->weight.grad().defined());
}

// An amp checkpoint holds the amax histories and scales: a run broken after 6 steps and resumed from the file ends
// bit-identical to the unbroken run (parameters, histories, scales), for both recipes.
TEST(Fp8AmpTest, CheckpointResumeIsBitIdentical) {
  for (const Fp8Recipe& recipe : {Fp8Recipe().amax_history_len(4), Fp8Recipe().scaling(Fp8Scaling::kCurrent)}) {
    char path[] = "/tmp/lta_fp8_ckptXXXXXX";
    const int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    close(fd);
    const Fp8Run whole = train_mixed(12, recipe, -1, /*save_after=*/6, path);
    const Fp8Run resumed = train_mixed(12, recipe, -1, 6, path, /*resume=*/true);
    std::remove(path);
    ASSERT_EQ(whole.params.size(), resumed.params.size());
    for (size_t i = 0; i < whole.params.size(); ++i) EXPECT_TRUE(torch::equal(whole.params[i], resumed.params[i]));
    EXPECT_TRUE(torch::equal(whole.history, resumed.history)) << recipe.to_string();
    EXPECT_TRUE(torch::equal(whole.scale, resumed.scale)) << recipe.to_string();
    EXPECT_GT(whole.history.abs().sum().item<float>(), 0.0f);
  }
}

TEST(Fp8AmpTest, ACheckpointOfAnotherFp8SetupIsRefusedNamingTheSetting) {
  char path[] = "/tmp/lta_fp8_ckptXXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  train_mixed(2, Fp8Recipe().amax_history_len(4), -1, 2, path);
  torch::manual_seed(21);
  MixedNet net;
  amp::FusedAdam adam(net->parameters(), amp::FusedAdamOptions(3e-3));
  auto [model, optimizer] = amp::initialize(net, adam, o2_fp8(Fp8Recipe().amax_history_len(8)));
  const auto before = optimizer.state().fp8()->history().clone();
  expect_error([&] { amp::load_checkpoint(path, model, optimizer); }, "history=4");
  std::remove(path);
  EXPECT_TRUE(torch::equal(before, optimizer.state().fp8()->history()));
}

// O1: autocast runs the model in bf16 around fp32 weights; the FP8 layers cast the fp32 input and weight straight
// to FP8 and return the autocast dtype. Training on a fixed batch lowers the loss, and the GEMMs are FP8 (the run
// differs from O1 without FP8).
TEST(Fp8AmpTest, O1AutocastTrainsWithFp8Gemms) {
  auto run = [](bool fp8) {
    torch::manual_seed(17);
    MixedNet net;
    amp::FusedAdam adam(net->parameters(), amp::FusedAdamOptions(1e-2));
    amp::Options options = amp::Options().opt_level(amp::OptLevel::O1).half_dtype(torch::kBFloat16);
    if (fp8) options.fp8(Fp8Recipe().amax_history_len(4));
    auto [model, optimizer] = amp::initialize(net, adam, options);
    auto generator = at::make_generator<at::CPUGeneratorImpl>(3);
    const auto x = torch::randn({32, 32}, generator);
    const auto target = torch::randn({32, 10}, generator);
    {
      const amp::AutocastScope autocast(torch::kCPU, torch::kBFloat16);
      const torch::NoGradGuard no_grad;
      EXPECT_EQ(net->a(x).scalar_type(), torch::kBFloat16);
    }
    EXPECT_EQ(net->a->weight.scalar_type(), torch::kFloat) << "O1 keeps fp32 weights";
    std::vector<float> losses;
    for (int s = 0; s < 30; ++s) {
      optimizer.zero_grad();
      const auto loss = torch::mse_loss(model(x), target);
      {
        auto scaled = amp::scale_loss(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
      losses.push_back(loss.item<float>());
    }
    if (fp8) {
      EXPECT_GT(optimizer.state().fp8()->history().abs().sum().item<float>(), 0.0f);
    }
    return losses;
  };
  const auto fp8 = run(true);
  const auto bf16 = run(false);
  // A training outcome, one-sided (Note [bounds on every CPU kernel path]): 30 Adam steps on one fixed batch halve the
  // loss with a wide margin on any kernel path (the printed ratio); a broken FP8 GEMM does not learn or diverges.
  std::printf("O1 FP8: loss %.4f -> %.4f (ratio %.3f, bound 0.5); bf16 %.4f -> %.4f\n", fp8.front(), fp8.back(),
              fp8.back() / fp8.front(), bf16.front(), bf16.back());
  EXPECT_LT(fp8.back(), 0.5f * fp8.front());
  EXPECT_NE(fp8, bf16);
}

// ZeRO stage 2 with FP8 layers trains bit-identically to DDP + amp with FP8 layers (the amax reduction and the skip
// flag happen before the sharded step), with identical scales on both ranks.
TEST(Fp8AmpTest, ZeroStageTwoWithFp8TrainsLikeDdpWithFp8) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        auto train = [&](amp::ZeroStage stage) {
          torch::manual_seed(33);
          MixedNet net;
          amp::FusedAdam adam(net->parameters(),
                              amp::FusedAdamOptions(3e-3).weight_decay(1e-2).decoupled_weight_decay(true));
          auto [model, optimizer] = amp::initialize(net, adam, o2_fp8(Fp8Recipe().amax_history_len(4)));
          ddp::DistributedDataParallel ddp_net(
              net, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(0.005).rebuild_buckets(false));
          optimizer.attach(ddp_net, stage);
          auto generator = at::make_generator<at::CPUGeneratorImpl>(700 + rank);
          for (int s = 0; s < 6; ++s) {
            torch::Tensor x = torch::randn({16, 32}, generator) * (1.0 + rank);
            if (s == 3 && rank == 1) x[0][0] = std::numeric_limits<float>::infinity();  // skipped on both ranks
            const auto target = torch::randn({16, 10}, generator);
            amp_step(
                model, optimizer, [&](const torch::Tensor& in) { return ddp_net.forward(in); }, x, target);
            TORCH_CHECK(optimizer.last_step_now().skipped == (s == 3), "rank ", rank, " step ", s,
                        ": skipped=", optimizer.last_step_now().skipped);
          }
          std::vector<torch::Tensor> out;
          for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
          out.push_back(optimizer.state().fp8()->scale().clone());
          out.push_back(optimizer.state().fp8()->history().clone());
          return out;
        };
        const auto ddp_run = train(amp::ZeroStage::kNone);
        const auto zero_run = train(amp::ZeroStage::kTwo);
        for (size_t i = 0; i < ddp_run.size(); ++i) {
          TORCH_CHECK(torch::equal(ddp_run[i], zero_run[i]), "rank ", rank, ": tensor ", i, " differs");
          auto root = zero_run[i].clone();
          pg.broadcast_(root, 0);
          TORCH_CHECK(torch::equal(root, zero_run[i]), "rank ", rank, ": tensor ", i, " differs from rank 0's");
        }
      },
      2);
}

// Under DDP the amaxes are max-reduced once per step, so ranks that see different data cast with the same scales
// (without the reduction each rank's input scale would follow its own data).
TEST(Fp8AmpTest, TwoRankDdpKeepsIdenticalScalesOnBothRanks) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        torch::manual_seed(31);
        MixedNet net;
        amp::FusedAdam adam(net->parameters(), amp::FusedAdamOptions(3e-3));
        auto [model, optimizer] = amp::initialize(net, adam, o2_fp8(Fp8Recipe().amax_history_len(4)));
        ddp::DistributedDataParallel ddp_net(net, pg);
        optimizer.attach(ddp_net);
        auto generator = at::make_generator<at::CPUGeneratorImpl>(500 + rank);
        std::vector<float> local_input_amax;
        for (int s = 0; s < 6; ++s) {
          const auto x = torch::randn({16, 32}, generator) * (rank == 0 ? 1.0 : 8.0);  // different amaxes per rank
          const auto target = torch::randn({16, 10}, generator);
          local_input_amax.push_back(x.to(torch::kBFloat16).abs().max().item<float>());  // O2 casts inputs
          amp_step(
              model, optimizer, [&](const torch::Tensor& in) { return ddp_net.forward(in); }, x, target);
        }
        auto same_as_rank0 = [&](const torch::Tensor& t) {
          auto root = t.clone();
          pg.broadcast_(root, 0);
          return torch::equal(t, root);
        };
        const auto& fp8 = *optimizer.state().fp8();
        TORCH_CHECK(same_as_rank0(fp8.scale().clone()), "rank ", rank, ": FP8 scales differ from rank 0's");
        TORCH_CHECK(same_as_rank0(fp8.history().clone()), "rank ", rank, ": FP8 histories differ from rank 0's");
        // The input's history holds the larger of the two ranks' amaxes (rank 1's data is 8x larger).
        auto theirs = torch::tensor(local_input_amax);
        auto other = theirs.clone();
        pg.broadcast_(other, 1);
        // After 6 steps a length-4 row is [0 (this step's slot), step 3, step 4, step 5].
        const auto expected = torch::cat({torch::zeros({1}), torch::maximum(theirs, other).narrow(0, 3, 3)});
        TORCH_CHECK(torch::equal(fp8.history()[amp::kFp8Input], expected), "rank ", rank,
                    ": the input amax history is not the max over the ranks: ", fp8.history()[amp::kFp8Input], " vs ",
                    expected);
        for (const auto& p : net->parameters()) TORCH_CHECK(same_as_rank0(p.detach().clone()), "parameters differ");
      },
      2);
}

// ---- CUDA (the GPU check) --------------------------------------------------------------------------------------

// An FP8 amp step (O2 bf16, FusedAdamW, delayed scaling: casts, amaxes, GEMMs, the non-finite check and the
// scale update) performs no host synchronization: c10's sync debug mode turns any sync into an error.
TEST(Fp8CudaTest, CudaFp8AmpStepHasNoHostSync) {
  LTA_REQUIRE_FP8_GPU();
#ifdef LIBTORCH_AMP_WITH_CUDA
  torch::manual_seed(9);
  MixedNet net;
  net->to(torch::kCUDA);
  amp::FusedAdamW adam(net->parameters(), amp::FusedAdamOptions(1e-3));
  auto [model, optimizer] = amp::initialize(net, adam, o2_fp8());
  const auto x = torch::randn({64, 32}, torch::kCUDA);
  const auto target = torch::randn({64, 10}, torch::kCUDA);
  auto step = [&] {
    optimizer.zero_grad();
    const auto loss = torch::mse_loss(model(x), target);
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
  };
  step();  // warm-up: allocations and lazy state
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  try {
    for (int i = 0; i < 3; ++i) step();
  } catch (...) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    throw;
  }
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  EXPECT_EQ(optimizer.scaler().diagnostics_now().skipped_steps, 0);
  EXPECT_GT(optimizer.state().fp8()->history().abs().sum().item<float>(), 0.0f);
#endif
}

}  // namespace
