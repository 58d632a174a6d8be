// FP8 training (amp::Options::fp8, docs/fp8.md) of the benchmark's models on the CPU: the tiny transformer (every
// Linear in FP8, synthetic bigram tokens) and the example CNN (fc1 in FP8; fc2, 128 -> 10, stays bf16;
// Fashion-MNIST) train no worse than the same runs under bf16 O2 (same initialization, same batches, same
// optimizer), within the margins of Note [FP8 training margins].

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <amp/amp.h>

#include "common/training_tasks.h"

namespace {

// Note [FP8 training margins]
// The claim is one-sided: FP8 does not train worse than bf16 O2. Any change of rounding (FP8, another thread count,
// another CPU kernel path: AVX512-BF16/AMX oneDNN GEMMs, AVX2, ATen's default vectors) sends a 300-step run down
// another trajectory, so the bound is set by how far such runs scatter, not by one machine's pair of numbers.
// Measured 2026-12-02, 2-core Intel Xeon VM (AVX512-BF16, AMX), 1 thread, native kernels, seeds 5-10:
// - example CNN (Fashion-MNIST, SGD lr 0.05): bf16 held-out losses 0.450-0.483, FP8 0.373-0.469; the paired ratio
//   FP8 / bf16 per seed 0.796-1.043 (mean 0.896, standard deviation 0.085). The same seed 5 with 2 threads gave bf16
//   0.4220 / FP8 0.4291 (1.017), and the AMD EPYC machine natively 0.4416 / 0.3986 (0.903): the spread of one pair
//   is the spread of the trajectories. The test averages 3 seeds (standard deviation of the mean ratio about 0.05)
//   and allows 15%: three standard deviations above parity, five above the measured mean. A broken FP8 path (a
//   wrong scale, a transposed operand) does not learn at all, or diverges: far outside.
// - tiny transformer (bigram tokens, AdamW): it converges to the data's entropy, and the paired ratio is 1.0008-1.0014
//   over seeds 5-7 (native, 1 thread) and 1.0013 with 2 threads: FP8 costs about 0.1%, and 2% (15 times that) holds
//   on one seed.
// CI runs the CNN again under ATen's default vectors with oneDNN capped at AVX2 (tests/CMakeLists.txt, one seed;
// both models passed there on 2026-12-02).
constexpr double kTransformerMargin = 0.02;
constexpr double kCnnMargin = 0.15;

struct Result {
  std::vector<float> losses;  // training loss per step
  double held_out = 0;        // loss on held-out data after training (the comparison: per-batch losses are noisy)
};

torch::Tensor tensor_named(const bench::NamedTensors& tensors, const std::string& name) {
  for (const auto& [key, value] : tensors) {
    if (key == name) return value;
  }
  throw std::runtime_error("no tensor named " + name);
}

/// Cross-entropy of the trained model on the task's held-out split (called in eval mode, without grad).
double held_out_loss(const bench::CnnTask& task, const bench::ForwardFn& forward) {
  const auto data = task.peer_data();
  const auto logits = forward(tensor_named(data, "test_images"));
  return torch::cross_entropy_loss(logits, tensor_named(data, "test_labels")).item<double>();
}

double held_out_loss(const bench::TransformerTask& task, const bench::ForwardFn& forward) {
  const auto tokens = tensor_named(task.peer_data(), "eval_tokens");
  const int64_t seq = task.settings().model.seq_len();
  const auto logits = forward(tokens.narrow(1, 0, seq));
  return torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), tokens.narrow(1, 1, seq).reshape({-1}))
      .item<double>();
}

template <typename Task>
Result train(const Task& task, bool fp8, std::vector<std::string>* report = nullptr) {
  auto net = task.make_model();
  auto inner = task.make_optimizer(net);
  amp::Options options = amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16);
  if (fp8) options.fp8(amp::Fp8Recipe());
  auto [model, optimizer] = amp::initialize(net, *inner, options);
  if (report != nullptr) *report = optimizer.fp8_report();
  Result result;
  for (int64_t s = 0; s < task.num_steps(); ++s) {
    const bench::Batch batch = task.batch(s);
    optimizer.zero_grad();
    const torch::Tensor loss = task.loss(model(batch.input), batch);
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
    result.losses.push_back(loss.item<float>());
  }
  net->eval();
  const torch::NoGradGuard no_grad;
  result.held_out = held_out_loss(task, [&](const torch::Tensor& x) { return model(x); });
  return result;
}

/// The seeds a comparison trains with (`defaults`, comma-separated): each seed gives both precisions the same
/// initialization and batches (a paired comparison). LTA_FP8_TRAINING_SEEDS overrides them, to measure the spread
/// over more seeds.
std::vector<uint64_t> training_seeds(const char* defaults) {
  std::vector<uint64_t> seeds;
  const char* env = std::getenv("LTA_FP8_TRAINING_SEEDS");
  std::stringstream list(env != nullptr && *env != '\0' ? env : defaults);
  for (std::string item; std::getline(list, item, ',');) seeds.push_back(std::stoull(item));
  return seeds;
}

/// The claim a user cares about: FP8 does not train worse than bf16. Checks that the mean held-out loss of the FP8
/// runs over the seeds is at most (1 + margin) times the bf16 runs' (one-sided: FP8 doing better is no failure),
/// that the bf16 runs learned, and that FP8 changed the arithmetic. Prints every seed's pair.
void expect_not_worse_than_bf16(const char* what, const std::vector<Result>& bf16, const std::vector<Result>& fp8,
                                double margin) {
  double bf16_mean = 0, fp8_mean = 0;
  for (size_t i = 0; i < bf16.size(); ++i) {
    std::printf("%s, seed %zu: held-out loss bf16 O2 %.4f, FP8 %.4f (ratio %.4f; first step %.4f)\n", what, i,
                bf16[i].held_out, fp8[i].held_out, fp8[i].held_out / bf16[i].held_out, bf16[i].losses.front());
    bf16_mean += bf16[i].held_out / static_cast<double>(bf16.size());
    fp8_mean += fp8[i].held_out / static_cast<double>(fp8.size());
    EXPECT_LT(bf16[i].held_out, 0.6 * bf16[i].losses.front()) << "the bf16 run should learn (seed " << i << ")";
    EXPECT_NE(fp8[i].losses, bf16[i].losses) << "FP8 must actually change the arithmetic";
  }
  const double ratio = fp8_mean / bf16_mean;
  std::printf("%s: mean held-out loss over %zu seeds: bf16 O2 %.4f, FP8 %.4f (ratio %.4f, bound %.4f)\n", what,
              bf16.size(), bf16_mean, fp8_mean, ratio, 1.0 + margin);
  EXPECT_LE(ratio, 1.0 + margin) << what << ": FP8 trains worse than bf16 by more than the seed-to-seed spread allows";
}

TEST(Fp8TrainingTest, TinyTransformerTrainsNoWorseThanBf16) {
  std::vector<Result> bf16, fp8;
  for (const uint64_t seed : training_seeds("5")) {
    bench::TransformerTask::Settings settings;
    settings.model.vocab_size(64).seq_len(32).d_model(64).num_heads(4).num_layers(2);
    settings.steps = 300;
    settings.batch_size = 16;
    settings.lr = 3e-3;
    settings.seed = seed;
    const bench::TransformerTask task(settings, torch::kCPU);
    std::vector<std::string> report;
    bf16.push_back(train(task, false));
    fp8.push_back(train(task, true, &report));
    ASSERT_FALSE(report.empty());
    EXPECT_NE(report.back().find("9 of 9 Float8Linear layers run in FP8"), std::string::npos) << report.back();
  }
  expect_not_worse_than_bf16("tiny transformer, 300 steps", bf16, fp8, kTransformerMargin);
}

TEST(Fp8TrainingTest, ExampleCnnTrainsNoWorseThanBf16) {
  // The real data set (make test's bootstrap installs it): the synthetic stand-in is learned to a loss of ~0 within
  // these steps, where a ratio of final losses says nothing.
  if (!std::filesystem::exists(std::string(bench::CnnTask::Settings().data_dir) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "needs Fashion-MNIST in " << bench::CnnTask::Settings().data_dir
                 << " (apt-get install dataset-fashion-mnist; scripts/bootstrap.sh installs it)";
  }
  std::vector<Result> bf16, fp8;
  for (const uint64_t seed : training_seeds("5,6,7")) {
    bench::CnnTask::Settings settings;
    settings.train_samples = 64 * 300;
    settings.test_samples = 2000;
    settings.max_steps = 300;
    settings.batch_size = 64;
    settings.seed = seed;
    const bench::CnnTask task(settings, torch::kCPU);
    ASSERT_TRUE(task.real_data());
    std::vector<std::string> report;
    bf16.push_back(train(task, false));
    fp8.push_back(train(task, true, &report));
    ASSERT_EQ(report.size(), 2u);
    EXPECT_NE(report[0].find("'fc2' stays in its amp precision: out_features=10"), std::string::npos) << report[0];
    EXPECT_NE(report[1].find("1 of 2 Float8Linear layers run in FP8"), std::string::npos) << report[1];
  }
  expect_not_worse_than_bf16("example CNN, 300 steps", bf16, fp8, kCnnMargin);
}

}  // namespace
