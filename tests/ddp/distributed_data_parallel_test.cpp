#include <ddp/distributed_data_parallel.h>

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <vector>

#include <ddp/spawn.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#ifdef LIBTORCH_AMP_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

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

const std::vector<int64_t> kWidths = {kIn, 32, 32, 32, kOut};

/// The model rank `rank` starts from: a different initialization on every rank (DDP must broadcast rank 0's).
Mlp make_model(uint64_t seed, int rank, const std::vector<int64_t>& widths = kWidths) {
  torch::manual_seed(seed + 1 + static_cast<uint64_t>(rank));
  return Mlp(widths);
}

struct Data {
  torch::Tensor x, y;
};
/// The same full batch on every rank (same seed).
Data make_data(uint64_t seed, int64_t batch = kBatch) {
  torch::manual_seed(seed);
  return {torch::randn({batch, kIn}), torch::randn({batch, kOut})};
}
Data shard(const Data& d, int rank, int world) {
  const int64_t per = d.x.size(0) / world;
  return {d.x.narrow(0, rank * per, per), d.y.narrow(0, rank * per, per)};
}

/// Full-batch gradients of the single-process reference (rank 0's initialization).
std::vector<torch::Tensor> reference_grads(uint64_t seed, const Data& data) {
  Mlp ref = make_model(seed, 0);
  torch::mse_loss(ref->forward(data.x), data.y).backward();
  return grads_of(*ref);
}

/// Throws unless every tensor is allclose(rtol, atol). The fp32 bounds (1e-5, atol 1e-6): sharded and full-batch
/// gradients are fp32 GEMM sums over the batch in another order (per shard, then the allreduce), whose error is a few
/// 2^-24 of sum |terms| on any kernel path (Note [bounds on every CPU kernel path], tests/test_util.h): ~1e-7 for
/// these small sums, bounded a hundred times higher; a gradient lost or counted twice is off by O(1).
void check_close(const std::vector<torch::Tensor>& actual, const std::vector<torch::Tensor>& expected, double rtol,
                 double atol, const std::string& what) {
  TORCH_CHECK(actual.size() == expected.size(), what, ": ", actual.size(), " tensors vs ", expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    TORCH_CHECK(torch::allclose(actual[i], expected[i], rtol, atol), what, ": tensor ", i, " differs, max abs diff ",
                (actual[i] - expected[i]).abs().max().item<double>());
  }
}

/// Runs fn(rank, process group) on kWorld (or `world`) forked ranks with Gloo on loopback.
void run_ranks(const std::function<void(int, const ddp::ProcessGroup&)>& fn, int world = kWorld,
               std::chrono::milliseconds timeout = kTestTimeout) {
  ddp_test::run_ranks(fn, world, timeout);
}

void save(const std::vector<torch::Tensor>& tensors, const std::string& path) { torch::save(tensors, path); }
std::vector<torch::Tensor> load(const std::string& path) {
  std::vector<torch::Tensor> tensors;
  torch::load(tensors, path);
  return tensors;
}

// Bucket settings under which the gradient path is checked: defaults (one bucket for this small model), one
// bucket per parameter or so, and every bucket after backward.
std::vector<ddp::DistributedDataParallelOptions> bucket_variants() {
  return {ddp::DistributedDataParallelOptions(),
          ddp::DistributedDataParallelOptions().first_bucket_mb(0.001).bucket_cap_mb(0.002),
          ddp::DistributedDataParallelOptions().bucket_cap_mb(0.002).delay_allreduce(true)};
}

TEST(DistributedDataParallelTest, GradientsEqualSingleProcessFullBatchGradientsWithTwoAndFourRanks) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  for (const int world : {2, 4}) {
    run_ranks(
        [seed](int rank, const ddp::ProcessGroup& pg) {
          const Data data = make_data(seed + 100);
          const auto expected = reference_grads(seed, data);
          const Data mine = shard(data, rank, pg.size());
          for (const auto& options : bucket_variants()) {
            Mlp model = make_model(seed, rank);
            ddp::DistributedDataParallel ddp(model, pg, options);
            torch::mse_loss(ddp.forward(mine.x), mine.y).backward();
            check_close(grads_of(*model), expected, 1e-5, 1e-6,
                        c10::str("rank ", rank, " of ", pg.size(), ", ", ddp.buckets().size(), " buckets"));
          }
        },
        world);
  }
}

TEST(DistributedDataParallelTest, ConstructionBroadcastsRankZerosParameters) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks([seed](int rank, const ddp::ProcessGroup& pg) {
    Mlp model = make_model(seed, rank);
    ddp::DistributedDataParallel ddp(model, pg);
    const Mlp rank0 = make_model(seed, 0);
    check_close(model->parameters(), rank0->parameters(), 0, 0, c10::str("rank ", rank, " parameters"));
  });
}

TEST(DistributedDataParallelTest, AfterTrainingStepsAllRanksAreBitIdenticalWithTwoAndFourRanks) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  constexpr int kSteps = 5;
  for (const int world : {2, 4}) {
    ddp_test::ScratchDir dir;
    run_ranks(
        [&](int rank, const ddp::ProcessGroup& pg) {
          Mlp model = make_model(seed, rank);
          ddp::DistributedDataParallel ddp(model, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(0.002));
          torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
          for (int step = 0; step < kSteps; ++step) {
            const Data d = make_data(seed + 1000 * static_cast<uint64_t>(rank + 1) + static_cast<uint64_t>(step), 8);
            opt.zero_grad();
            torch::mse_loss(ddp.forward(d.x), d.y).backward();
            opt.step();
          }
          save(model->parameters(), dir.file("rank" + std::to_string(rank) + ".pt"));
        },
        world);
    const auto r0 = load(dir.file("rank0.pt"));
    const Mlp initial = make_model(seed, 0);
    for (int r = 1; r < world; ++r) {
      const auto rn = load(dir.file("rank" + std::to_string(r) + ".pt"));
      ASSERT_EQ(r0.size(), rn.size());
      for (size_t i = 0; i < r0.size(); ++i) {
        EXPECT_TRUE(torch::equal(r0[i], rn[i])) << "parameter " << i << " differs between rank 0 and " << r;
      }
    }
    for (size_t i = 0; i < r0.size(); ++i) {
      EXPECT_FALSE(torch::equal(r0[i], initial->parameters()[i])) << "parameter " << i << " did not train";
    }
  }
}

TEST(DistributedDataParallelTest, NoSyncAccumulatesLocallyAndTheNextBackwardAveragesABigBatch) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks([seed](int rank, const ddp::ProcessGroup& pg) {
    const Data data = make_data(seed + 7);
    const auto expected = reference_grads(seed, data);
    const Data mine = shard(data, rank, pg.size());
    const int64_t half = mine.x.size(0) / 2;
    const Data micro[2] = {{mine.x.narrow(0, 0, half), mine.y.narrow(0, 0, half)},
                           {mine.x.narrow(0, half, half), mine.y.narrow(0, half, half)}};
    Mlp model = make_model(seed, rank);
    ddp::DistributedDataParallel ddp(model, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(0.002));
    {
      auto no_sync = ddp.no_sync();
      (torch::mse_loss(ddp.forward(micro[0].x), micro[0].y) / 2).backward();
    }
    // Inside no_sync the gradient is this rank's own: compare with a local computation.
    Mlp local = make_model(seed, 0);
    (torch::mse_loss(local->forward(micro[0].x), micro[0].y) / 2).backward();
    check_close(grads_of(*model), grads_of(*local), 1e-6, 1e-7, c10::str("rank ", rank, " inside no_sync"));

    (torch::mse_loss(ddp.forward(micro[1].x), micro[1].y) / 2).backward();
    check_close(grads_of(*model), expected, 1e-5, 1e-6, c10::str("rank ", rank, " after accumulation"));
  });
}

TEST(DistributedDataParallelTest, BucketsAreIssuedDuringBackwardUnlessDelayed) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks([seed](int rank, const ddp::ProcessGroup& pg) {
    const std::vector<int64_t> deep = {kIn, 64, 64, 64, 64, 64, 64, kOut};
    const Data d = shard(make_data(seed), rank, pg.size());
    for (const bool delay : {false, true}) {
      Mlp model = make_model(seed, rank, deep);
      ddp::DistributedDataParallel ddp(
          model, pg,
          ddp::DistributedDataParallelOptions().first_bucket_mb(0.001).bucket_cap_mb(0.01).delay_allreduce(delay));
      const size_t n = ddp.buckets().size();
      TORCH_CHECK(n >= 4, "expected several buckets, got ", n);
      torch::mse_loss(ddp.forward(d.x), d.y).backward();
      const ddp::BackwardTimeline& t = ddp.last_backward_timeline();
      for (size_t b = 0; b < n; ++b) {
        TORCH_CHECK(t.bucket_issued[b] >= t.first_gradient_ready, "bucket ", b, " issued before any gradient");
      }
      if (!delay) {
        // The first bucket (the last layer) went out while earlier layers' gradients were still being computed.
        TORCH_CHECK(t.bucket_issued[0] < t.last_gradient_ready, "bucket 0 was not issued before the last gradient");
        TORCH_CHECK(t.bucket_issued[n - 2] < t.backward_finished, "bucket ", n - 2, " was not issued during backward");
      } else {
        for (size_t b = 0; b < n; ++b) {
          TORCH_CHECK(t.bucket_issued[b] >= t.backward_finished, "delayed bucket ", b, " was issued during backward");
        }
      }
    }
  });
}

TEST(DistributedDataParallelTest, BucketsFollowReverseParameterOrderAndTheCaps) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks(
      [seed](int rank, const ddp::ProcessGroup& pg) {
        // layers.0: 8x32 + 32, layers.1: 32x32 + 32, layers.2: 32x4 + 4 (fp32).
        Mlp model = make_model(seed, rank, {kIn, 32, 32, kOut});
        const double kb = 1.0 / 1024;  // MB per KB
        ddp::DistributedDataParallel ddp(
            model, pg, ddp::DistributedDataParallelOptions().first_bucket_mb(0.5 * kb).bucket_cap_mb(4.5 * kb));
        const auto buckets = ddp.buckets();
        // First bucket, cap 512 B: layers.2.bias (16 B) then layers.2.weight (512 B) reach it.
        // Next, cap 4608 B: layers.1.bias (128 B) + layers.1.weight (4096 B) = 4224 B, + layers.0.bias = 4352 B,
        // + layers.0.weight (1024 B) closes it at 5376 B.
        const std::vector<std::vector<std::string>> expected = {
            {"layers.2.bias", "layers.2.weight"},
            {"layers.1.bias", "layers.1.weight", "layers.0.bias", "layers.0.weight"}};
        TORCH_CHECK(buckets.size() == expected.size(), "got ", buckets.size(), " buckets");
        for (size_t b = 0; b < buckets.size(); ++b) {
          TORCH_CHECK(buckets[b].parameter_names == expected[b], "bucket ", b, " holds ",
                      c10::Join(", ", buckets[b].parameter_names));
          TORCH_CHECK(buckets[b].dtype == torch::kFloat, buckets[b].dtype);
        }
        TORCH_CHECK(buckets[0].num_elements == 4 * 32 + 4, buckets[0].num_elements);
      },
      1);
}

TEST(DistributedDataParallelTest, AllreduceDtypeCompressesToBFloat16) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks([seed](int rank, const ddp::ProcessGroup& pg) {
    const Data data = make_data(seed + 3);
    const auto expected = reference_grads(seed, data);
    const Data mine = shard(data, rank, pg.size());
    Mlp model = make_model(seed, rank);
    ddp::DistributedDataParallel ddp(model, pg,
                                     ddp::DistributedDataParallelOptions().allreduce_dtype(torch::kBFloat16));
    for (const auto& b : ddp.buckets()) TORCH_CHECK(b.dtype == torch::kBFloat16, "bucket dtype ", b.dtype);
    torch::mse_loss(ddp.forward(mine.x), mine.y).backward();
    // Each rank's gradient is rounded to bf16 before the sum (up to 2^-9 of values near 0.5): where the ranks'
    // gradients nearly cancel, the relative bound says nothing and that absolute error is all that is left.
    check_close(grads_of(*model), expected, test_util::rtol_for(torch::kBFloat16), 4e-3,
                c10::str("rank ", rank, " with bf16 buckets"));
  });
}

TEST(DistributedDataParallelTest, BucketReducedHookSeesPredividedSumsAndAveragedGrads) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks([seed](int rank, const ddp::ProcessGroup& pg) {
    const Data data = make_data(seed + 5);
    const auto expected = reference_grads(seed, data);
    const Data mine = shard(data, rank, pg.size());
    constexpr double kPredivide = 4.0;
    Mlp model = make_model(seed, rank);
    ddp::DistributedDataParallel ddp(model, pg,
                                     ddp::DistributedDataParallelOptions()
                                         .gradient_predivide_factor(kPredivide)
                                         .first_bucket_mb(0.001)
                                         .bucket_cap_mb(0.002));
    std::vector<int64_t> seen;
    ddp.set_bucket_reduced_hook([&](const ddp::ReducedBucket& b) {
      seen.push_back(b.index);
      // buffer = sum over ranks / predivide = average * world / predivide.
      torch::Tensor flat = torch::cat([&] {
        std::vector<torch::Tensor> v;
        for (const auto& g : b.grads) v.push_back(g.reshape({-1}));
        return v;
      }());
      TORCH_CHECK(torch::allclose(b.buffer, flat * (pg.size() / kPredivide), 1e-6, 1e-7), "bucket ", b.index,
                  " buffer is not the predivided sum");
    });
    torch::mse_loss(ddp.forward(mine.x), mine.y).backward();
    TORCH_CHECK(seen.size() == ddp.buckets().size(), "hook ran ", seen.size(), " times");
    for (size_t i = 0; i < seen.size(); ++i) TORCH_CHECK(seen[i] == static_cast<int64_t>(i), "hook order");
    check_close(grads_of(*model), expected, 1e-5, 1e-6, c10::str("rank ", rank, " with predivide"));
  });
}

/// A module with a buffer that ranks set differently after construction.
struct WithBufferImpl : torch::nn::Module {
  WithBufferImpl() {
    fc = register_module("fc", torch::nn::Linear(kIn, kOut));
    counter = register_buffer("counter", torch::zeros({3}));
  }
  torch::Tensor forward(torch::Tensor x) { return fc->forward(x) + counter.sum(); }
  torch::nn::Linear fc{nullptr};
  torch::Tensor counter;
};
TORCH_MODULE(WithBuffer);

TEST(DistributedDataParallelTest, BroadcastBuffersBeforeForwardIsAnOption) {
  LTA_REQUIRE_GLOO();
  run_ranks([](int rank, const ddp::ProcessGroup& pg) {
    for (const bool broadcast : {true, false}) {
      WithBuffer model;
      ddp::DistributedDataParallel ddp(model, pg, ddp::DistributedDataParallelOptions().broadcast_buffers(broadcast));
      {
        torch::NoGradGuard no_grad;
        model->counter.fill_(static_cast<float>(rank + 1));
      }
      ddp.forward(torch::zeros({2, kIn}));
      const float expected = broadcast ? 1.0f : static_cast<float>(rank + 1);
      TORCH_CHECK(model->counter.eq(expected).all().item<bool>(), "rank ", rank, " broadcast_buffers=", broadcast,
                  ": counter is ", model->counter);
    }
  });
}

TEST(DistributedDataParallelTest, ARankExitingMidTrainingFailsTheOthersQuicklyWithAClearError) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  const std::chrono::milliseconds timeout(8000);
  const auto start = Clock::now();
  const std::string message = error_of([&] {
    run_ranks(
        [seed](int rank, const ddp::ProcessGroup& pg) {
          Mlp model = make_model(seed, rank);
          ddp::DistributedDataParallel ddp(model, pg);
          const Data d = shard(make_data(seed), rank, pg.size());
          for (int step = 0; step < 100; ++step) {
            if (rank == 1 && step == 2) ::_exit(0);  // leaves quietly: only the survivor can report the failure
            model->zero_grad();
            torch::mse_loss(ddp.forward(d.x), d.y).backward();
          }
        },
        kWorld, timeout);
  });
  // The survivor names itself and the backend; which collective notices the lost peer first depends on timing
  // under load, so the collective's name is not required.
  EXPECT_TRUE(contains_all(message, {"ddp::spawn: rank 0 of 2", "failed on rank 0 of 2 (backend gloo)"})) << message;
  EXPECT_LT(Clock::now() - start, timeout);
}

TEST(DistributedDataParallelTest, MismatchedModelsFailOnEveryRankNamingTheParameter) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  ddp_test::ScratchDir dir;
  run_ranks([&](int rank, const ddp::ProcessGroup& pg) {
    Mlp model = make_model(seed, rank, rank == 0 ? kWidths : std::vector<int64_t>{kIn, 32, 24, 32, kOut});
    const std::string message = error_of([&] { ddp::DistributedDataParallel ddp(model, pg); });
    std::ofstream(dir.file("rank" + std::to_string(rank))) << message;
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    std::ifstream in(dir.file("rank" + std::to_string(rank)));
    const std::string message((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_TRUE(
        contains_all(message, {"the module or the options differ across ranks (checked on rank " + std::to_string(rank),
                               "entry #2 is 'parameter layers.1.weight [32, 32] Float' on rank 0 but "
                               "'parameter layers.1.weight [24, 32] Float' on rank 1"}));
  }
}

TEST(DistributedDataParallelTest, DifferentBucketOptionsFailOnEveryRankInsteadOfPairingUnrelatedBuckets) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  const std::string message = error_of([&] {
    run_ranks([&](int rank, const ddp::ProcessGroup& pg) {
      Mlp model = make_model(seed, rank);
      ddp::DistributedDataParallel ddp(model, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(rank + 1));
    });
  });
  EXPECT_TRUE(contains_all(message, {"'option bucket_cap_mb=1 ", "' on rank 0 but 'option bucket_cap_mb=2 "}));
}

/// Uses its second layer only when told to.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    used = register_module("used", torch::nn::Linear(kIn, kOut));
    sometimes = register_module("sometimes", torch::nn::Linear(kIn, kOut));
  }
  torch::Tensor forward(torch::Tensor x, bool use_second) {
    return use_second ? used->forward(x) + sometimes->forward(x) : used->forward(x);
  }
  torch::nn::Linear used{nullptr}, sometimes{nullptr};
};
TORCH_MODULE(Branchy);

TEST(DistributedDataParallelTest, AnUnusedParameterIsAnErrorNamingItUnlessAllowed) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  const std::string message = error_of([&] {
    run_ranks([seed](int rank, const ddp::ProcessGroup& pg) {
      torch::manual_seed(seed);
      Branchy model;
      ddp::DistributedDataParallel ddp(model, pg);
      const Data d = shard(make_data(seed), rank, pg.size());
      torch::mse_loss(ddp.forward(d.x, false), d.y).backward();
    });
  });
  EXPECT_TRUE(contains_all(message, {"2 parameter(s) got no gradient in this backward pass: sometimes.weight, "
                                     "sometimes.bias",
                                     "find_unused_parameters(true)"}));

  // Allowed: rank 0 uses the branch, rank 1 does not; the average counts rank 1's contribution as zero.
  run_ranks([seed](int rank, const ddp::ProcessGroup& pg) {
    torch::manual_seed(seed);
    Branchy model;
    torch::manual_seed(seed);
    Branchy local;
    ddp::DistributedDataParallel ddp(model, pg, ddp::DistributedDataParallelOptions().find_unused_parameters(true));
    const Data d = shard(make_data(seed), 0, pg.size());  // the same data on both ranks
    torch::mse_loss(ddp.forward(d.x, rank == 0), d.y).backward();
    torch::mse_loss(local->forward(d.x, true), d.y).backward();
    const torch::Tensor expected = local->sometimes->weight.grad() / pg.size();
    TORCH_CHECK(torch::allclose(model->sometimes->weight.grad(), expected, 1e-5, 1e-6), "rank ", rank,
                ": the partly unused parameter's gradient is not half of rank 0's");
  });
}

/// Square layers registered l0, l1, l2, l3 but applied in the opposite order (x -> l3 -> l2 -> l1 -> l0): backward
/// produces l0's gradients first, while the initial buckets (reverse registration order) start with l3's.
struct ReversedImpl : torch::nn::Module {
  ReversedImpl() {
    for (int i = 0; i < 4; ++i) layers->push_back(torch::nn::Linear(kIn, kIn));
    register_module("layers", layers);
  }
  torch::Tensor forward(torch::Tensor x) {
    for (int i = 3; i >= 0; --i) x = torch::tanh(layers[i]->as<torch::nn::Linear>()->forward(x));
    return x;
  }
  torch::nn::ModuleList layers;
};
TORCH_MODULE(Reversed);

/// About one layer per bucket for kIn x kIn fp32 layers (256 B weight + 32 B bias).
ddp::DistributedDataParallelOptions one_layer_per_bucket() {
  const double cap = 260.0 / (1024 * 1024);
  return ddp::DistributedDataParallelOptions().first_bucket_mb(cap).bucket_cap_mb(cap);
}

std::vector<std::string> layers_of(const std::vector<ddp::BucketInfo>& buckets) {
  std::vector<std::string> layers;
  for (const auto& b : buckets) layers.push_back(b.parameter_names.front().substr(0, 8));  // "layers.N"
  return layers;
}

TEST(DistributedDataParallelTest, BucketsAreRebuiltOnceFromTheObservedGradientOrder) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks([seed](int rank, const ddp::ProcessGroup& pg) {
    const Data data = make_data(seed);
    const Data mine = shard(data, rank, pg.size());
    torch::manual_seed(seed);
    Reversed ref;
    torch::mse_loss(ref->forward(data.x), data.y.narrow(1, 0, 1).expand({-1, kIn})).backward();
    const auto expected = grads_of(*ref);
    for (const bool rebuild : {true, false}) {
      torch::manual_seed(seed + static_cast<uint64_t>(rank));  // DDP broadcasts rank 0's parameters
      Reversed model;
      ddp::DistributedDataParallel ddp(model, pg, one_layer_per_bucket().rebuild_buckets(rebuild));
      const std::vector<std::string> initial = {"layers.3", "layers.2", "layers.1", "layers.0"};
      TORCH_CHECK(layers_of(ddp.buckets()) == initial, "initial layout: ", c10::Join(", ", layers_of(ddp.buckets())));
      for (int step = 0; step < 3; ++step) {
        model->zero_grad();
        const auto y = mine.y.narrow(1, 0, 1).expand({-1, kIn});
        torch::mse_loss(ddp.forward(mine.x), y).backward();
        check_close(grads_of(*model), expected, 1e-5, 1e-6, c10::str("rank ", rank, " step ", step));
        const ddp::BackwardTimeline& t = ddp.last_backward_timeline();
        const bool rebuilt = rebuild && step > 0;
        const std::vector<std::string> want =
            rebuilt ? std::vector<std::string>{"layers.0", "layers.1", "layers.2", "layers.3"} : initial;
        TORCH_CHECK(layers_of(ddp.buckets()) == want, "step ", step, " rebuild ", rebuild, ": layout ",
                    c10::Join(", ", layers_of(ddp.buckets())));
        if (rebuilt) {
          // In use order, the first bucket goes out while the other layers' gradients are still being computed.
          TORCH_CHECK(t.bucket_issued[0] < t.last_gradient_ready, "step ", step,
                      ": the rebuilt first bucket was not issued before the last gradient");
        } else {
          // In registration order, the first bucket waits for the last gradient, and every later one waits for it.
          for (size_t b = 0; b < t.bucket_issued.size(); ++b) {
            TORCH_CHECK(t.bucket_issued[b] >= t.last_gradient_ready, "step ", step, ": bucket ", b,
                        " issued before the last gradient in the registration-order layout");
          }
        }
      }
    }
  });
}

TEST(DistributedDataParallelTest, ARankAloneMayRunEvalForwardsWithoutBroadcastsBeforeAndAfterTheRebuild) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks([seed](int rank, const ddp::ProcessGroup& pg) {
    const Data data = make_data(seed);
    const Data mine = shard(data, rank, pg.size());
    const auto target = mine.y.narrow(1, 0, 1).expand({-1, kIn});
    torch::manual_seed(seed);
    Reversed ref;
    torch::mse_loss(ref->forward(data.x), data.y.narrow(1, 0, 1).expand({-1, kIn})).backward();
    torch::manual_seed(seed);
    Reversed model;
    ddp::DistributedDataParallel ddp(model, pg, one_layer_per_bucket().broadcast_buffers(false));
    auto eval_on_rank0 = [&] {
      if (rank != 0) return;
      torch::NoGradGuard no_grad;
      ddp.forward(mine.x);  // would hang (or pair with the other rank's allreduce) if it broadcast
    };
    for (int step = 0; step < 3; ++step) {
      eval_on_rank0();
      model->zero_grad();
      torch::mse_loss(ddp.forward(mine.x), target).backward();
      check_close(grads_of(*model), grads_of(*ref), 1e-5, 1e-6, c10::str("rank ", rank, " step ", step));
    }
    TORCH_CHECK(layers_of(ddp.buckets()).front() == "layers.0", "rank ", rank, ": the buckets were not rebuilt");
  });
}

/// Two independent branches whose creation order is a constructor argument: the autograd engine runs the later
/// created branch's backward first, so the ranks observe different gradient orders.
struct TwoBranchesImpl : torch::nn::Module {
  explicit TwoBranchesImpl(bool a_first) : a_first(a_first) {
    a = register_module("a", torch::nn::Linear(kIn, kIn));
    b = register_module("b", torch::nn::Linear(kIn, kIn));
  }
  torch::Tensor forward(torch::Tensor x) {
    torch::Tensor first, second;
    if (a_first) {
      first = a->forward(x);
      second = b->forward(x);
    } else {
      second = b->forward(x);
      first = a->forward(x);
    }
    return torch::tanh(first) * torch::sigmoid(second);
  }
  bool a_first;
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoBranches);

TEST(DistributedDataParallelTest, TheRebuiltLayoutIsRankZerosOrderOnEveryRank) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks([seed](int rank, const ddp::ProcessGroup& pg) {
    const Data data = make_data(seed);
    const Data mine = shard(data, rank, pg.size());
    const auto target = [](const Data& d) { return d.y.narrow(1, 0, 1).expand({-1, kIn}); };
    torch::manual_seed(seed);
    TwoBranches ref(true);
    torch::mse_loss(ref->forward(data.x), target(data)).backward();
    torch::manual_seed(seed);
    TwoBranches model(rank == 0);
    ddp::DistributedDataParallel ddp(model, pg, one_layer_per_bucket());
    std::vector<char> order;  // which branch's weight gradient this rank computed first, second
    model->a->weight.register_hook([&](const torch::Tensor&) { order.push_back('a'); });
    model->b->weight.register_hook([&](const torch::Tensor&) { order.push_back('b'); });
    for (int step = 0; step < 2; ++step) {
      model->zero_grad();
      torch::mse_loss(ddp.forward(mine.x), target(mine)).backward();
      check_close(grads_of(*model), grads_of(*ref), 1e-5, 1e-6, c10::str("rank ", rank, " step ", step));
    }
    // The ranks really observed different orders...
    TORCH_CHECK(order.size() == 4 && order[0] == (rank == 0 ? 'b' : 'a'), "rank ", rank, " computed ", order[0],
                "'s gradient first");
    // ...and rank 1 follows rank 0's: b's bucket first.
    const auto names = ddp.buckets();
    TORCH_CHECK(names.size() == 2 && names[0].parameter_names.front().rfind("b.", 0) == 0 &&
                    names[1].parameter_names.front().rfind("a.", 0) == 0,
                "rank ", rank, ": rebuilt layout starts with ", names[0].parameter_names.front());
  });
}

TEST(DistributedDataParallelTest, ARestoredGradientOrderGivesTheRebuiltLayoutFromTheFirstStep) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  run_ranks([seed](int rank, const ddp::ProcessGroup& pg) {
    const Data mine = shard(make_data(seed), rank, pg.size());
    const auto target = mine.y.narrow(1, 0, 1).expand({-1, kIn});
    const std::vector<std::string> initial = {"layers.3", "layers.2", "layers.1", "layers.0"};
    const std::vector<std::string> rebuilt = {"layers.0", "layers.1", "layers.2", "layers.3"};
    const auto step = [&](Reversed& model, ddp::DistributedDataParallel& ddp) {
      model->zero_grad();
      torch::mse_loss(ddp.forward(mine.x), target).backward();
    };
    // The run that is saved: no order before its first backward, the pending one after it, the rebuilt one after.
    torch::manual_seed(seed);
    Reversed first;
    ddp::DistributedDataParallel saved(first, pg, one_layer_per_bucket());
    TORCH_CHECK(saved.gradient_order().empty(), "rank ", rank, ": an order before any backward");
    step(first, saved);
    const std::vector<int64_t> pending = saved.gradient_order();
    step(first, saved);
    const std::vector<int64_t> order = saved.gradient_order();
    TORCH_CHECK(layers_of(saved.buckets()) == rebuilt, "rank ", rank, ": the saved run did not rebuild");
    TORCH_CHECK(order.size() == 8 && order == pending, "rank ", rank, ": the order before the rebuild (",
                c10::Join(", ", pending), ") is not the rebuilt one (", c10::Join(", ", order), ")");

    // The resumed run: the rebuilt layout before its first step, kept after it.
    Reversed resumed;
    ddp::DistributedDataParallel ddp(resumed, pg, one_layer_per_bucket());
    TORCH_CHECK(layers_of(ddp.buckets()) == initial, "rank ", rank, ": unexpected initial layout");
    ddp.restore_gradient_order(order);
    TORCH_CHECK(layers_of(ddp.buckets()) == rebuilt, "rank ", rank, ": restored layout ",
                c10::Join(", ", layers_of(ddp.buckets())));
    TORCH_CHECK(ddp.gradient_order() == order, "rank ", rank, ": gradient_order() after the restore");
    for (int i = 0; i < 2; ++i) step(resumed, ddp);
    TORCH_CHECK(layers_of(ddp.buckets()) == rebuilt && ddp.gradient_order() == order, "rank ", rank,
                ": the layout changed after the restore");

    // Rank 0's order is the one applied: another rank's (here a wrong one) does not matter.
    Reversed other;
    ddp::DistributedDataParallel follows(other, pg, one_layer_per_bucket());
    follows.restore_gradient_order(rank == 0 ? order : std::vector<int64_t>{0});
    TORCH_CHECK(layers_of(follows.buckets()) == rebuilt, "rank ", rank, ": did not follow rank 0's order");

    // Nothing saved on rank 0 (a checkpoint written before the first backward): the usual rebuild later.
    Reversed fresh;
    ddp::DistributedDataParallel later(fresh, pg, one_layer_per_bucket());
    later.restore_gradient_order({});
    TORCH_CHECK(layers_of(later.buckets()) == initial, "rank ", rank, ": an empty order changed the layout");
    for (int i = 0; i < 2; ++i) step(fresh, later);
    TORCH_CHECK(layers_of(later.buckets()) == rebuilt, "rank ", rank, ": no rebuild after an empty restore");

    // An order that does not fit the model on rank 0 fails on every rank, layout unchanged.
    Reversed unfit;
    ddp::DistributedDataParallel refused(unfit, pg, one_layer_per_bucket());
    const std::vector<int64_t> wrong = rank == 0 ? std::vector<int64_t>{0, 1, 2} : order;
    const std::string message = error_of([&] { refused.restore_gradient_order(wrong); });
    TORCH_CHECK(
        contains_all(message, {"rank 0's saved gradient order (3 entries)", "8 parameters", "the layout is unchanged"}),
        "rank ", rank, ": ", message);
    TORCH_CHECK(layers_of(refused.buckets()) == initial, "rank ", rank, ": a refused order changed the layout");
  });
}

// GPU checks. The parent never initializes CUDA (a forked child could not use it then): each child looks for a
// GPU itself and, finding none, leaves a marker that makes the test skip.

/// Runs fn(rank, pg) on `world` forked ranks over `backend` with the model on cuda:0; returns false when the
/// children found no GPU.
bool run_ranks_on_gpu(const std::string& backend, int world,
                      const std::function<void(int, const ddp::ProcessGroup&)>& fn) {
  ddp_test::ScratchDir dir;
  ddp::spawn(world, [&](int rank, int) {
    if (!torch::cuda::is_available()) {
      std::ofstream(dir.file("no_gpu" + std::to_string(rank))) << "none";
      return;
    }
    at::set_num_threads(1);
    const ddp::ProcessGroup pg =
        ddp::init_process_group(ddp::InitOptions().backend(backend).cuda_device(0).timeout(kTestTimeout));
    fn(rank, pg);
  });
  return !std::ifstream(dir.file("no_gpu0")).good();
}

TEST(DistributedDataParallelTest, NcclWithWorldSizeOneOnTheGpuKeepsTheGradients) {
  if (!ddp::backend_available("nccl")) GTEST_SKIP() << "needs the NCCL backend (a CUDA build)";
  const uint64_t seed = test_util::fresh_seed();
  const bool ran = run_ranks_on_gpu("nccl", 1, [seed](int, const ddp::ProcessGroup& pg) {
    TORCH_CHECK(pg.device().is_cuda(), "an NCCL group works on CUDA tensors, got ", pg.device());
    const Data d = make_data(seed);
    const auto x = d.x.cuda(), y = d.y.cuda();
    Mlp model = make_model(seed, 0);
    model->to(torch::kCUDA);
    Mlp local = make_model(seed, 0);
    local->to(torch::kCUDA);
    ddp::DistributedDataParallel ddp(model, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(0.002));
    for (int step = 0; step < 2; ++step) {  // the second step reuses the buckets
      model->zero_grad();
      local->zero_grad();
      torch::mse_loss(ddp.forward(x), y).backward();
      torch::mse_loss(local->forward(x), y).backward();
      check_close(grads_of(*model), grads_of(*local), 0, 0, c10::str("NCCL world size 1, step ", step));
    }
  });
  if (!ran) GTEST_SKIP() << "needs a CUDA GPU; none is present";
}

TEST(DistributedDataParallelTest, GlooWithCudaTensorsMatchesFullBatchGradients) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  const bool ran = run_ranks_on_gpu("gloo", kWorld, [seed](int rank, const ddp::ProcessGroup& pg) {
    const Data data = make_data(seed + 100);
    Mlp ref = make_model(seed, 0);
    ref->to(torch::kCUDA);
    torch::mse_loss(ref->forward(data.x.cuda()), data.y.cuda()).backward();
    const Data mine = shard(data, rank, pg.size());
    for (const auto& options : bucket_variants()) {
      Mlp model = make_model(seed, rank);
      model->to(torch::kCUDA);
      ddp::DistributedDataParallel ddp(model, pg, options);
      torch::mse_loss(ddp.forward(mine.x.cuda()), mine.y.cuda()).backward();
      check_close(grads_of(*model), grads_of(*ref), 1e-4, 1e-5, c10::str("rank ", rank, " (Gloo, CUDA tensors)"));
    }
  });
  if (!ran) GTEST_SKIP() << "needs a CUDA GPU; none is present";
}

// Forward and backward on a non-default stream: DDP writes the averaged gradients on its communication stream into
// tensors allocated on that stream (record_stream keeps the allocator from reusing them early). Step after step, with
// the freed gradients' memory churned by new allocations, the gradients are those of full-batch training.
TEST(DistributedDataParallelTest, GlooWithCudaTensorsOnASideStreamMatchesFullBatchGradients) {
  LTA_REQUIRE_GLOO();
#ifdef LIBTORCH_AMP_WITH_CUDA
  const uint64_t seed = test_util::fresh_seed();
  const bool ran = run_ranks_on_gpu("gloo", kWorld, [seed](int rank, const ddp::ProcessGroup& pg) {
    const Data data = make_data(seed + 200);
    Mlp ref = make_model(seed, 0);
    ref->to(torch::kCUDA);
    torch::mse_loss(ref->forward(data.x.cuda()), data.y.cuda()).backward();
    const Data mine = shard(data, rank, pg.size());
    Mlp model = make_model(seed, rank);
    model->to(torch::kCUDA);
    ddp::DistributedDataParallel ddp(model, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(0.002));
    const c10::cuda::CUDAStreamGuard on_side_stream(c10::cuda::getStreamFromPool());
    for (int step = 0; step < 3; ++step) {
      model->zero_grad();
      torch::mse_loss(ddp.forward(mine.x.cuda()), mine.y.cuda()).backward();
      std::vector<torch::Tensor> churn;
      for (int i = 0; i < 8; ++i) churn.push_back(torch::full({4096}, 7.0f, torch::kCUDA));
      check_close(grads_of(*model), grads_of(*ref), 1e-4, 1e-5,
                  c10::str("rank ", rank, " step ", step, " (side stream)"));
    }
  });
  if (!ran) GTEST_SKIP() << "needs a CUDA GPU; none is present";
#else
  GTEST_SKIP() << "libtorch_amp was built without CUDA (LIBTORCH_AMP_CUDA=OFF)";
#endif
}

}  // namespace
