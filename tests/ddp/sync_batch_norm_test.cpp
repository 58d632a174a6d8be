#include <ddp/sync_batch_norm.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <ddp/distributed_data_parallel.h>
#include <ddp/launch/spawn.h>
#include <ddp/launch/worker_group.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#ifdef LIBTORCH_AMP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

using ddp_test::check_close;

using ddp_test::contains_all;
using ddp_test::kTestTimeout;

/// Runs fn(rank, process group) on `world` forked ranks with Gloo on loopback; a rank reports failure by throwing.
void run_ranks(int world, const std::function<void(int, const ddp::ProcessGroup&)>& fn) {
  ddp::spawn(world, [&](int rank, int) {
    at::set_num_threads(1);
    const ddp::ProcessGroup pg = ddp::init_process_group(ddp::InitOptions().timeout(kTestTimeout));
    try {
      fn(rank, pg);
    } catch (const c10::Error& e) {
      // spawn carries the message without the backtrace back; LTA_SYNCBN_DEBUG=1 prints it with the backtrace.
      if (std::getenv("LTA_SYNCBN_DEBUG") != nullptr) std::cerr << e.what() << std::endl;
      throw;
    }
  });
}

/// The reference: torch::nn::BatchNorm{1,2,3}d in fp64 with the given options.
std::shared_ptr<torch::nn::Module> make_batch_norm(int dimensionality, const torch::nn::BatchNormOptions& options) {
  switch (dimensionality) {
    case 1:
      return torch::nn::BatchNorm1d(options).ptr();
    case 2:
      return torch::nn::BatchNorm2d(options).ptr();
    default:
      return torch::nn::BatchNorm3d(options).ptr();
  }
}

torch::Tensor batch_norm_forward(const std::shared_ptr<torch::nn::Module>& m, const torch::Tensor& x) {
  if (auto* b1 = m->as<torch::nn::BatchNorm1d>()) return b1->forward(x);
  if (auto* b2 = m->as<torch::nn::BatchNorm2d>()) return b2->forward(x);
  return m->as<torch::nn::BatchNorm3d>()->forward(x);
}

torch::Tensor tensor_or_undefined(const torch::nn::Module& m, const std::string& name) {
  const auto params = m.named_parameters(false);
  if (const auto* p = params.find(name)) return p->defined() && p->grad().defined() ? p->grad() : torch::Tensor();
  return torch::Tensor();
}

struct Case {
  int dimensionality;               // 1, 2 or 3
  std::vector<int64_t> spatial;     // trailing dims after (N, C)
  std::vector<int64_t> rank_sizes;  // per-rank batch sizes (sum: the full batch)
  std::optional<double> momentum;   // nullopt: cumulative average
  bool affine;
  bool track_running_stats;
  double eps;
  torch::ScalarType dtype;  // the input's dtype
};

std::string describe(const Case& c) {
  std::string sizes;
  for (auto s : c.rank_sizes) sizes += std::to_string(s) + " ";
  return c10::str(c.dimensionality, "d spatial=", c.spatial, " sizes=", sizes,
                  "momentum=", c.momentum ? std::to_string(*c.momentum) : "cumulative", " affine=", c.affine,
                  " track=", c.track_running_stats, " eps=", c.eps, " dtype=", c.dtype);
}

constexpr int64_t kChannels = 3;

/// On every rank: two training steps (forward, backward of sum(y * g)) and one eval forward of SyncBatchNorm on
/// this rank's slice, against fp64 BatchNorm on the concatenated batch. Weight / bias gradients are summed over
/// the ranks (what DDP's average times the world size gives). Throws on a mismatch.
void check_case(const Case& c, uint64_t seed, int rank, const ddp::ProcessGroup& pg) {
  const std::string what = c10::str(describe(c), " rank ", rank, " of ", pg.size());
  int64_t full = 0;
  for (auto s : c.rank_sizes) full += s;
  int64_t offset = 0;
  for (int r = 0; r < rank; ++r) offset += c.rank_sizes[static_cast<size_t>(r)];
  const int64_t mine = c.rank_sizes[static_cast<size_t>(rank)];

  // Inputs with a mean far from zero (the case where sum / sum-of-squares statistics lose digits).
  torch::manual_seed(seed);
  std::vector<int64_t> shape{full, kChannels};
  shape.insert(shape.end(), c.spatial.begin(), c.spatial.end());
  const auto weight = torch::rand({kChannels}) + 0.5;
  const auto bias = torch::randn({kChannels});

  auto ref = make_batch_norm(c.dimensionality, torch::nn::BatchNormOptions(kChannels)
                                                   .eps(c.eps)
                                                   .momentum(c.momentum)
                                                   .affine(c.affine)
                                                   .track_running_stats(c.track_running_stats));
  ref->to(torch::kDouble);
  auto sync = ddp::SyncBatchNorm(ddp::SyncBatchNormOptions(kChannels)
                                     .eps(c.eps)
                                     .momentum(c.momentum)
                                     .affine(c.affine)
                                     .track_running_stats(c.track_running_stats)
                                     .dimensionality(c.dimensionality)
                                     .process_group(pg));
  if (c.affine) {
    torch::NoGradGuard no_grad;
    sync->weight.copy_(weight);
    sync->bias.copy_(bias);
    ref->named_parameters()["weight"].copy_(weight);
    ref->named_parameters()["bias"].copy_(bias);
  }

  // Tolerances: fp32 input: the 1e-5 relative (plus 1e-6 absolute for values near 0). Half / bf16 input:
  // the output and input gradient are fp32 results rounded once to the dtype, so they are within one unit of
  // relative rounding (2^-10 for fp16, 2^-7 for bf16) of the exact value; statistics and parameter gradients stay
  // fp32 sums of exactly converted values: fp32's bound, loosened for the longer sums.
  // Kernel paths (Note [bounds on every CPU kernel path], tests/test_util.h): the CPU sums are our batch-norm twins,
  // 16 fp32 lanes under DEFAULT and AVX2, 32 under AVX512, lanes and chunks added in fp64 (Note [batch-norm twin
  // sums]); the statistics' sums (positive terms, mean 5) are then within ~2e-6 relative on any width, and the output
  // is an fp32 value rounded once. tests/numerics/check_kernel_paths.py runs the twins' lane model at 16 and 32 lanes
  // on the largest case below against these bounds (worst draw: see docs/testing.md); CI reruns this test under ATen's
  // default vectors (numerics.sync_batch_norm_under_other_kernels).
  const bool half = c.dtype != torch::kFloat;
  const double out_rtol = c.dtype == torch::kHalf ? 1.0 / 1024 : (c.dtype == torch::kBFloat16 ? 1.0 / 128 : 1e-5);
  const double out_atol = half ? out_rtol * 1e-2 : 1e-6;
  const double stat_rtol = 1e-5;
  const double grad_rtol = half ? 1e-4 : 1e-5;

  for (int step = 0; step < 2; ++step) {
    const auto x_full = (torch::randn(shape) * 2 + 5).to(c.dtype);  // the same on every rank (same seed)
    const auto g_full = torch::randn(shape).to(c.dtype);
    const std::string at_step = c10::str(what, " step ", step);

    auto x_ref = x_full.to(torch::kDouble).requires_grad_();
    for (auto& p : ref->parameters()) p.mutable_grad() = torch::Tensor();
    const auto y_ref = batch_norm_forward(ref, x_ref);
    (y_ref * g_full.to(torch::kDouble)).sum().backward();

    auto x = x_full.narrow(0, offset, mine).clone().requires_grad_();
    for (auto& p : sync->parameters()) p.mutable_grad() = torch::Tensor();
    const auto y = sync->forward(x);
    TORCH_CHECK(y.scalar_type() == c.dtype, at_step, ": output dtype ", y.scalar_type());
    (y * g_full.narrow(0, offset, mine)).sum().backward();

    check_close(y, y_ref.narrow(0, offset, mine), out_rtol, out_atol, at_step + " output");
    check_close(x.grad(), x_ref.grad().narrow(0, offset, mine), out_rtol, half ? out_atol * 10 : 1e-5,
                at_step + " input gradient");
    // The weight and bias gradients are sums over the whole batch (of dy * x_hat and of dy) that may cancel: an
    // fp32 sum is off by some ulps of the sum of its |terms|, not of its result (PyTorch's own fp32 BatchNorm2d
    // misses 1e-5 of the result in 6 of 400 such gradients at 8 x 3 x 23 x 29). So the bound adds one fp32 ulp
    // (2^-23) of the largest channel's sum of |terms|, computed in fp64 from the reference.
    std::vector<int64_t> reduce{0};
    for (int64_t d = 2; d < x_ref.dim(); ++d) reduce.push_back(d);
    const auto xd = x_full.to(torch::kDouble);
    const auto x_hat = (xd - xd.mean(reduce, true)) / (xd.var(reduce, false, true) + c.eps).sqrt();
    const auto gd = g_full.to(torch::kDouble);
    const double weight_terms = (gd * x_hat).abs().sum(reduce).max().item<double>();
    const double bias_terms = gd.abs().sum(reduce).max().item<double>();
    for (const std::string name : {"weight", "bias"}) {
      auto g = tensor_or_undefined(*sync, name);
      if (g.defined()) {
        g = g.clone();
        pg.wait(pg.allreduce_sum_async(g), "test gradient sum");
      }
      const double terms = name == "weight" ? weight_terms : bias_terms;
      check_close(g, tensor_or_undefined(*ref, name), grad_rtol, grad_rtol + std::ldexp(terms, -23),
                  at_step + " " + name + " gradient");
    }
    const auto ref_buffers = ref->named_buffers();
    for (const auto& b : sync->named_buffers()) {
      check_close(b.value(), ref_buffers[b.key()], stat_rtol, 1e-6, at_step + " " + b.key());
    }
  }

  // Eval mode: running statistics (or, without them, this rank's own batch statistics, as BatchNorm's).
  sync->eval();
  ref->eval();
  const auto x_full = (torch::randn(shape) * 2 + 5).to(c.dtype);
  const auto x = x_full.narrow(0, offset, mine);
  if (c.track_running_stats) {
    torch::NoGradGuard no_grad;
    check_close(sync->forward(x), batch_norm_forward(ref, x_full.to(torch::kDouble)).narrow(0, offset, mine), out_rtol,
                out_atol, what + " eval output");
  } else if (mine > 1) {
    // This rank's own statistics, through at::batch_norm as BatchNorm: compared with fp32 BatchNorm, since with as
    // few as 2 values per channel the variance is ill-conditioned and fp32 differs from fp64 beyond 1e-5.
    torch::NoGradGuard no_grad;
    auto ref32 = std::dynamic_pointer_cast<torch::nn::Module>(ref->clone());
    ref32->to(torch::kFloat);
    check_close(sync->forward(x), batch_norm_forward(ref32, x.to(torch::kFloat)), out_rtol, out_atol,
                what + " eval output (local statistics)");
  }
}

std::vector<Case> cases_for(int world, torch::ScalarType dtype) {
  const std::vector<std::vector<int64_t>> splits =
      world == 2 ? std::vector<std::vector<int64_t>>{{4, 4}, {3, 6}, {0, 7}}
                 : std::vector<std::vector<int64_t>>{{2, 2, 2, 2}, {1, 3, 2, 4}, {3, 0, 2, 2}};
  std::vector<Case> cases;
  // 23 x 29 = 667 values per (sample, channel) run: the CPU statistics' 8 lanes, two whole chunks of 256 and a tail.
  const std::vector<std::pair<int, std::vector<int64_t>>> shapes = {
      {1, {}}, {1, {5}}, {2, {3, 4}}, {3, {2, 3, 2}}, {2, {23, 29}}};
  size_t i = 0;
  for (const auto& split : splits) {
    for (const auto& [d, spatial] : shapes) {
      // Rotate the options over the cases so that each value meets several shapes and splits.
      const std::optional<double> momentum = i % 3 == 1 ? std::nullopt : std::optional<double>(i % 3 == 0 ? 0.1 : 0.7);
      cases.push_back({d, spatial, split, momentum, i % 4 != 2, i % 5 != 3, i % 2 == 0 ? 1e-5 : 1e-3, dtype});
      ++i;
    }
  }
  return cases;
}

TEST(SyncBatchNormTest, MatchesFp64BatchNormOnTheConcatenatedBatchWithTwoAndFourRanks) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  for (const int world : {2, 4}) {
    run_ranks(world, [&](int rank, const ddp::ProcessGroup& pg) {
      for (const auto& c : cases_for(world, torch::kFloat)) check_case(c, seed, rank, pg);
    });
  }
}

TEST(SyncBatchNormTest, HalfAndBFloat16InputsKeepFp32StatisticsAndReturnTheInputDtype) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks(2, [&](int rank, const ddp::ProcessGroup& pg) {
    for (const auto dtype : {torch::kHalf, torch::kBFloat16}) {
      for (const auto& c : cases_for(2, dtype)) check_case(c, seed, rank, pg);
    }
  });
}

TEST(SyncBatchNormTest, WorldSizeOneIsBatchNormBitForBit) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks(1, [&](int, const ddp::ProcessGroup& pg) {
    for (const std::optional<double> momentum : {std::optional<double>(0.1), std::optional<double>()}) {
      torch::manual_seed(seed);
      torch::nn::BatchNorm2d bn(torch::nn::BatchNormOptions(kChannels).momentum(momentum));
      auto sync = ddp::SyncBatchNorm(ddp::SyncBatchNormOptions(kChannels).momentum(momentum).process_group(pg));
      for (int step = 0; step < 3; ++step) {
        const auto x = torch::randn({4, kChannels, 3, 3}) * 3 + 1;
        const auto xa = x.clone().requires_grad_();
        const auto xb = x.clone().requires_grad_();
        const auto ya = bn->forward(xa);
        const auto yb = sync->forward(xb);
        ya.pow(2).sum().backward();
        yb.pow(2).sum().backward();
        // Exact on any kernel path: at world size 1 both sides run ATen's own batch_norm on the same input.
        TORCH_CHECK(torch::equal(ya, yb) && torch::equal(xa.grad(), xb.grad()),
                    "world size 1: output or input "
                    "gradient differs from BatchNorm");
        TORCH_CHECK(
            torch::equal(bn->running_mean, sync->running_mean) && torch::equal(bn->running_var, sync->running_var),
            "world size 1: running statistics differ from BatchNorm");
        TORCH_CHECK(torch::equal(bn->weight.grad(), sync->weight.grad()), "world size 1: weight gradient differs");
      }
    }
  });
}

/// Runs `fn` expecting an error on every rank that contains every fragment; throws (failing the test) otherwise.
void expect_error_on_rank(int rank, const std::function<void()>& fn, const std::vector<std::string>& fragments) {
  std::string message;
  try {
    fn();
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  TORCH_CHECK(!message.empty(), "rank ", rank, ": expected an error, got none");
  for (const auto& f : fragments) {
    TORCH_CHECK(message.find(f) != std::string::npos, "rank ", rank, ": '", f, "' not in: ", message);
  }
}

TEST(SyncBatchNormTest, BadInputOnOneRankIsTheSameClearErrorOnEveryRankWithoutHanging) {
  LTA_REQUIRE_GLOO();
  const auto start = std::chrono::steady_clock::now();
  run_ranks(2, [](int rank, const ddp::ProcessGroup& pg) {
    auto sync = ddp::SyncBatchNorm(ddp::SyncBatchNormOptions(kChannels).dimensionality(2).process_group(pg));
    // A 2d module given a 3-d input on rank 1 only.
    expect_error_on_rank(
        rank,
        [&] {
          sync->forward(rank == 1 ? torch::randn({2, kChannels, 4}) : torch::randn({2, kChannels, 4, 4}));
        },
        {"SyncBatchNorm2d(3)", "rank 1 got a 3-d input", "expects 4 dims (N, C, H, W)"});
    // Rank 0's input has 5 channels.
    expect_error_on_rank(rank,
                         [&] {
                           sync->forward(torch::randn({2, rank == 0 ? 5 : kChannels, 4, 4}));
                         },
                         {"rank 0 got an input with 5 channels", "expects 3"});
    // A single value per channel over the whole group.
    expect_error_on_rank(rank,
                         [&] {
                           sync->forward(torch::randn({rank == 0 ? 1 : 0, kChannels, 1, 1}));
                         },
                         {"expected more than 1 value per channel", "got 1"});
    // After the errors the group is still in step: a good forward works.
    const auto y = sync->forward(torch::randn({2, kChannels, 4, 4}));
    TORCH_CHECK(y.sizes() == torch::IntArrayRef({2, kChannels, 4, 4}), "forward after the errors failed");
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, kTestTimeout);
}

TEST(SyncBatchNormTest, RanksWithDifferentChannelCountsFailOnEveryRank) {
  LTA_REQUIRE_GLOO();
  const auto start = std::chrono::steady_clock::now();
  run_ranks(2, [](int rank, const ddp::ProcessGroup& pg) {
    const int64_t channels = rank == 0 ? 3 : 4;
    auto sync = ddp::SyncBatchNorm(ddp::SyncBatchNormOptions(channels).process_group(pg));
    expect_error_on_rank(rank,
                         [&] {
                           sync->forward(torch::randn({2, channels, 4}));
                         },
                         {"has num_features", "every rank must build the same model"});
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, kTestTimeout);
}

TEST(SyncBatchNormTest, OptionsAreValidatedAndTrainingNeedsAProcessGroup) {
  EXPECT_TRUE(contains_all(ddp_test::error_of([] { ddp::SyncBatchNorm(ddp::SyncBatchNormOptions(0)); }),
                           {"num_features must be > 0, got 0"}));
  EXPECT_TRUE(contains_all(ddp_test::error_of([] { ddp::SyncBatchNorm(ddp::SyncBatchNormOptions(2).momentum(1.5)); }),
                           {"momentum must lie in [0, 1], got 1.5"}));
  EXPECT_TRUE(
      contains_all(ddp_test::error_of([] { ddp::SyncBatchNorm(ddp::SyncBatchNormOptions(2).dimensionality(4)); }),
                   {"dimensionality must be 1, 2 or 3, got 4"}));
  ddp::SyncBatchNorm sync(2);
  EXPECT_TRUE(contains_all(ddp_test::error_of([&] {
                             sync->forward(torch::randn({4, 2}));
                           }),
                           {"SyncBatchNorm(2)", "needs a process group"}));
  sync->eval();
  EXPECT_TRUE(torch::allclose(sync->forward(torch::ones({4, 2})), torch::ones({4, 2}) / std::sqrt(1 + 1e-5)));
}

// CUDA tensors (for the GPU check): ranks are threads of this process (a forked child cannot use CUDA), meeting
// over tcp:// on loopback; Gloo takes the CUDA tensors, and NCCL when built in. Each thread compares its slice with
// BatchNorm2d (fp32) on the concatenated batch on the GPU. With more than one rank this runs the CUDA path of
// ATen's batch_norm_stats / batch_norm_elemt / batch_norm_backward_reduce / batch_norm_backward_elemt; bf16 input
// is their mixed-type case (fp32 statistics and parameters); `empty_rank` gives rank 0 the whole batch and the
// others none. Each rank runs its backward on its own thread (ddp_test::run_thread_ranks, BackwardOnThisThread):
// on one GPU the ranks would otherwise share autograd's CUDA thread and deadlock in SyncBatchNorm's allreduce.
// On the CPU (`cuda` false) the same checks run with threads as ranks: that is how they are tested without a GPU.
void run_cuda_ranks(const std::string& backend, int world, torch::ScalarType dtype = torch::kFloat,
                    bool empty_rank = false, bool cuda = true) {
  const int port = ddp::detail::find_free_port();
  const uint64_t seed = test_util::fresh_seed();
  const int64_t full = 4 * world;
  const auto rows = [&](int rank) -> std::pair<int64_t, int64_t> {  // (offset, count) of a rank's slice
    if (empty_rank) return rank == 0 ? std::make_pair(int64_t{0}, full) : std::make_pair(full, int64_t{0});
    return {4 * rank, 4};
  };
  // bf16: the output and input gradient are fp32 results rounded once to bf16 (2^-7 relative).
  const double rtol = dtype == torch::kBFloat16 ? 1.0 / 128 : 1e-4;
  const double atol = dtype == torch::kBFloat16 ? 1e-2 : 1e-5;
  const auto errors = ddp_test::run_thread_ranks(world, [&](int rank) {
    const torch::Device device =
        cuda ? torch::Device(torch::kCUDA, backend == "nccl" ? rank : 0) : torch::Device(torch::kCPU);
    ddp::InitOptions init;
    if (cuda) init.cuda_device(device.index());
    const ddp::ProcessGroup pg = ddp::init_process_group(init.backend(backend)
                                                             .init_method("tcp://127.0.0.1:" + std::to_string(port))
                                                             .rank(rank)
                                                             .world_size(world)
                                                             .timeout(kTestTimeout));
    // A generator of this thread's own: the ranks are threads, and the global one is shared (drawing from it while
    // another thread reseeds it gave the ranks different data whenever the threads interleaved).
    auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
    const auto x_full = (torch::randn({full, kChannels, 5, 5}, generator).to(device) * 2 + 3).to(dtype);
    const auto g_full = torch::randn({full, kChannels, 5, 5}, generator).to(device).to(dtype);
    torch::nn::BatchNorm2d ref(kChannels);
    ref->to(device);
    auto x_ref = x_full.to(torch::kFloat).clone().requires_grad_();
    const auto y_ref = ref->forward(x_ref);  // one training forward: the running statistics move once
    (y_ref * g_full.to(torch::kFloat)).sum().backward();
    auto sync = ddp::SyncBatchNorm(ddp::SyncBatchNormOptions(kChannels).dimensionality(2).process_group(pg));
    sync->to(device);
    const auto [offset, count] = rows(rank);
    auto x = x_full.narrow(0, offset, count).clone().requires_grad_();
    // x's gradient is accumulated at the end of backward, by whichever thread runs it: it must be this one.
    std::thread::id backward_thread;
    x.register_hook([&](const torch::Tensor& grad) {
      backward_thread = std::this_thread::get_id();
      return grad;
    });
    TORCH_CHECK(!c10::AutogradState::get_tls_state().get_multithreading_enabled(),
                "the rank's thread leaves autograd's device threads on");
    const auto y = sync->forward(x);
    TORCH_CHECK(y.scalar_type() == dtype, "CUDA output dtype ", y.scalar_type());
    (y * g_full.narrow(0, offset, count)).sum().backward();
    TORCH_CHECK(backward_thread == std::this_thread::get_id(), "the backward ran on another thread than the rank's");
    torch::NoGradGuard no_grad;
    check_close(y, y_ref.narrow(0, offset, count), rtol, atol, "CUDA output");
    check_close(x.grad(), x_ref.grad().narrow(0, offset, count), rtol, atol, "CUDA input gradient");
    check_close(sync->running_mean, ref->running_mean, 1e-5, 1e-6, "CUDA running_mean");
    check_close(sync->running_var, ref->running_var, 1e-5, 1e-6, "CUDA running_var");
    // DDP sums the ranks' weight / bias gradients (and divides by the world size): the sum is BatchNorm's.
    for (auto* p : {&sync->weight, &sync->bias}) {
      auto g = p->grad().clone();
      pg.wait(pg.allreduce_sum_async(g), "test gradient sum");
      const auto& expected = p == &sync->weight ? ref->weight.grad() : ref->bias.grad();
      check_close(g, expected, 1e-4, 1e-3, "CUDA weight / bias gradient");
    }
  });
  for (int rank = 0; rank < world; ++rank) EXPECT_EQ(errors[static_cast<size_t>(rank)], "") << "rank " << rank;
}

TEST(SyncBatchNormTest, TheDeviceTestChecksPassWithThreadsAsRanksOnTheCpu) {
  LTA_REQUIRE_GLOO();
  run_cuda_ranks("gloo", 1, torch::kFloat, false, /*cuda=*/false);
  run_cuda_ranks("gloo", 2, torch::kFloat, false, /*cuda=*/false);
  run_cuda_ranks("gloo", 2, torch::kBFloat16, false, /*cuda=*/false);
  run_cuda_ranks("gloo", 2, torch::kFloat, /*empty_rank=*/true, /*cuda=*/false);
}

TEST(SyncBatchNormTest, TheThreadRanksGuardTurnsAutogradsDeviceThreadsOffAndRestoresThem) {
  auto& state = c10::AutogradState::get_tls_state();
  ASSERT_TRUE(state.get_multithreading_enabled());
  {
    const ddp_test::BackwardOnThisThread outer;
    EXPECT_FALSE(state.get_multithreading_enabled());
    {
      const ddp_test::BackwardOnThisThread inner;
      EXPECT_FALSE(state.get_multithreading_enabled());
    }
    EXPECT_FALSE(state.get_multithreading_enabled());  // the inner guard restores the outer's state, not the default
  }
  EXPECT_TRUE(state.get_multithreading_enabled());
  // Each rank thread runs under the guard; this thread's state is not touched.
  const auto errors = ddp_test::run_thread_ranks(2, [](int rank) {
    TORCH_CHECK(!c10::AutogradState::get_tls_state().get_multithreading_enabled(), "rank ", rank,
                ": autograd's device threads are on");
    TORCH_CHECK(rank != 1, "rank 1 fails on purpose");
  });
  EXPECT_EQ(errors, (std::vector<std::string>{"", "rank 1 fails on purpose"}));
  EXPECT_TRUE(state.get_multithreading_enabled());
}

// The counts ATen's CUDA batch_norm_backward_elemt receives: int32 entries that it sums in int64. The backward used
// to pass the group's total as one int32 (at::full({1}, total, kInt)), which throws above 2^31 - 1; the per-rank
// counts, split where one rank alone exceeds it, carry any total. (The CUDA path itself: the GPU test below.)
TEST(SyncBatchNormTest, CountsForTheCudaBackwardCarryTotalsAbove2To31InInt32Entries) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  const std::vector<int64_t> per_rank{(int64_t{1} << 30) + 16, (int64_t{1} << 30) + 16};  // 2^31 + 32 in all
  EXPECT_THROW(at::full({1}, static_cast<double>(per_rank[0] + per_rank[1]), at::kInt), std::exception);
  const at::Tensor two = ddp::detail::batch_norm_counts(per_rank);
  EXPECT_EQ(two.scalar_type(), at::kInt);
  EXPECT_TRUE(torch::equal(two, torch::tensor({(1 << 30) + 16, (1 << 30) + 16}, torch::kInt)));  // PyTorch's form
  EXPECT_EQ(two.sum(torch::kLong).item<int64_t>(), (int64_t{1} << 31) + 32);
  // One rank alone above 2^31 - 1 (split), an empty rank, and 3 * 2^31 + 5.
  const std::vector<int64_t> uneven{kInt32Max + 7, 0, 5, (int64_t{3} << 31) + 5};
  const at::Tensor split = ddp::detail::batch_norm_counts(uneven);
  EXPECT_EQ(split.scalar_type(), at::kInt);
  EXPECT_GE(split.min().item<int32_t>(), 0);
  EXPECT_EQ(split.sum(torch::kLong).item<int64_t>(), kInt32Max + 7 + 5 + (int64_t{3} << 31) + 5);
  EXPECT_EQ(split.numel(), 2 + 1 + 1 + 4);
  EXPECT_THROW(ddp::detail::batch_norm_counts({3, -1}), c10::Error);
}

TEST(SyncBatchNormCudaTest, WorldSizeOneOnCudaMatchesBatchNorm) {
  LTA_REQUIRE_CUDA();
  LTA_REQUIRE_GLOO();
  run_cuda_ranks("gloo", 1);
}

TEST(SyncBatchNormCudaTest, GlooWithCudaTensorsMatchesBatchNormOnTheConcatenatedBatch) {
  LTA_REQUIRE_CUDA();
  LTA_REQUIRE_GLOO();
  run_cuda_ranks("gloo", 2);
}

TEST(SyncBatchNormCudaTest, GlooWithCudaBFloat16InputsMatchesFp32BatchNorm) {
  LTA_REQUIRE_CUDA();
  LTA_REQUIRE_GLOO();
  run_cuda_ranks("gloo", 2, torch::kBFloat16);
}

TEST(SyncBatchNormCudaTest, GlooWithCudaTensorsAndARankWithAnEmptyBatch) {
  LTA_REQUIRE_CUDA();
  LTA_REQUIRE_GLOO();
  run_cuda_ranks("gloo", 2, torch::kFloat, /*empty_rank=*/true);
}

TEST(SyncBatchNormCudaTest, NcclMatchesBatchNormOnTheConcatenatedBatch) {
  LTA_REQUIRE_CUDA();
  if (!ddp::backend_available("nccl")) GTEST_SKIP() << "needs the NCCL backend (not built in)";
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 CUDA GPUs";
  run_cuda_ranks("nccl", 2);
}

// More than 2^31 - 1 values per channel over the group: 2 ranks (threads, one GPU, Gloo) of 2^30 + 2^17 bf16 values
// each (exact in the fp32 header). The CUDA backward threw here while it passed the total as one int32. With
// dy = 1 the exact input gradient is (1 - sum(dy) / n - x_hat * mean(dy * x_hat)) * invstd = 0, since
// mean(x_hat) = 0; the fp32 sums leave |dx| around 1e-6 (relative errors of ~1e-7 in sum(dy) / n and in the
// centred sum, times invstd = 1/2 and |x_hat| < 6). A wrong n (one rank's count, or a wrapped one) makes it
// (1 - n / n_used) * invstd, at least 1/4: the bound 1e-3 separates the two.
TEST(SyncBatchNormCudaTest, TrainsWithMoreThan2To31ValuesPerChannelOverTheGroup) {
  LTA_REQUIRE_CUDA();
  LTA_REQUIRE_GLOO();
#ifdef LIBTORCH_AMP_WITH_CUDA
  // Per rank: x, y, dy and dx at 2 GiB each, and a temporary: 10 GiB, twice, with room to spare.
  constexpr int64_t kNeededBytes = int64_t{40} << 30;
  const auto device_bytes = static_cast<int64_t>(at::cuda::getDeviceProperties(0)->totalGlobalMem);
  if (device_bytes < kNeededBytes) {
    GTEST_SKIP() << "needs a GPU with 40 GiB of memory (two ranks of 2^30 bf16 values); this one has "
                 << (device_bytes >> 30) << " GiB";
  }
  const int port = ddp::detail::find_free_port();
  const auto errors = ddp_test::run_thread_ranks(2, [&](int rank) {
    const ddp::ProcessGroup pg = ddp::init_process_group(ddp::InitOptions()
                                                             .backend("gloo")
                                                             .init_method("tcp://127.0.0.1:" + std::to_string(port))
                                                             .rank(rank)
                                                             .world_size(2)
                                                             .timeout(kTestTimeout));
    const auto options = torch::TensorOptions().device(torch::kCUDA, 0).dtype(torch::kBFloat16);
    const auto x = torch::randn({16, 1, 8192, 8193}, options).mul_(2).add_(3).requires_grad_();  // 2^30 + 2^17
    auto sync = ddp::SyncBatchNorm(ddp::SyncBatchNormOptions(1).dimensionality(2).process_group(pg));
    sync->to(torch::kCUDA);
    const auto y = sync->forward(x);
    y.backward(torch::ones_like(y));
    const float worst = x.grad().abs().max().item<float>();
    TORCH_CHECK(worst <= 1e-3f, "rank ", rank, ": max |dx| = ", worst, " where the exact gradient is 0");
    // The forward's count is right too: the running mean moved by a tenth (momentum 0.1) of the data's mean 3.
    const float running_mean = sync->running_mean.item<float>();
    TORCH_CHECK(std::abs(running_mean - 0.3f) < 1e-3f, "rank ", rank, ": running_mean ", running_mean);
  });
  for (int rank = 0; rank < 2; ++rank) EXPECT_EQ(errors[static_cast<size_t>(rank)], "") << "rank " << rank;
#endif
}

}  // namespace
