#include <ddp/distributed_data_parallel.h>

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <vector>

#include <ddp/launch/spawn.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#ifdef LIBTORCH_AMP_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "ddp/ddp_mlp_test_util.h"
#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

using namespace ddp_mlp;  // NOLINT(google-build-using-namespace): the shared test model

TEST(ReducerTest, BucketsAreIssuedDuringBackwardUnlessDelayed) {
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

TEST(ReducerTest, BucketsFollowReverseParameterOrderAndTheCaps) {
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

TEST(ReducerTest, AllreduceDtypeCompressesToBFloat16) {
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

TEST(ReducerTest, BucketReducedHookSeesPredividedSumsAndAveragedGrads) {
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

TEST(ReducerTest, AnUnusedParameterIsAnErrorNamingItUnlessAllowed) {
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

TEST(ReducerTest, BucketsAreRebuiltOnceFromTheObservedGradientOrder) {
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

TEST(ReducerTest, ARankAloneMayRunEvalForwardsWithoutBroadcastsBeforeAndAfterTheRebuild) {
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

TEST(ReducerTest, TheRebuiltLayoutIsRankZerosOrderOnEveryRank) {
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

TEST(ReducerTest, ARestoredGradientOrderGivesTheRebuiltLayoutFromTheFirstStep) {
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

}  // namespace
