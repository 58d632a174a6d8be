// FP8 training (amp::Options::fp8, docs/fp8.md) of the benchmark's models on the CPU: the tiny transformer (every
// Linear in FP8, synthetic bigram tokens) and the example CNN (fc1 in FP8; fc2, 128 -> 10, stays bf16;
// Fashion-MNIST) reach a held-out loss within 2% of the same run under bf16 O2: same initialization, same batches,
// same optimizer.

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <amp/amp.h>

#include "common/training_tasks.h"

namespace {

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

/// Prints both held-out losses and checks that the runs learned, that FP8 changed the arithmetic, and that FP8's
/// held-out loss is within 2% of bf16's.
void expect_within_two_percent(const char* what, const Result& bf16, const Result& fp8) {
  const double ratio = fp8.held_out / bf16.held_out;
  std::printf("%s: held-out loss bf16 O2 %.4f, FP8 %.4f (ratio %.4f; first step %.4f)\n", what, bf16.held_out,
              fp8.held_out, ratio, bf16.losses.front());
  EXPECT_LT(bf16.held_out, 0.6 * bf16.losses.front()) << "the run should learn";
  EXPECT_NEAR(ratio, 1.0, 0.02);
  EXPECT_NE(fp8.losses, bf16.losses) << "FP8 must actually change the arithmetic";
}

TEST(Fp8TrainingTest, TinyTransformerReachesTheBf16LossWithinTwoPercent) {
  bench::TransformerTask::Settings settings;
  settings.model.vocab_size(64).seq_len(32).d_model(64).num_heads(4).num_layers(2);
  settings.steps = 300;
  settings.batch_size = 16;
  settings.lr = 3e-3;
  settings.seed = 5;
  const bench::TransformerTask task(settings, torch::kCPU);
  std::vector<std::string> report;
  const Result bf16 = train(task, false);
  const Result fp8 = train(task, true, &report);
  ASSERT_FALSE(report.empty());
  EXPECT_NE(report.back().find("9 of 9 Float8Linear layers run in FP8"), std::string::npos) << report.back();
  expect_within_two_percent("tiny transformer, 300 steps", bf16, fp8);
}

TEST(Fp8TrainingTest, ExampleCnnReachesTheBf16LossWithinTwoPercent) {
  bench::CnnTask::Settings settings;
  // The real data set (make test's bootstrap installs it): the synthetic stand-in is learned to a loss of ~0 within
  // these steps, where a ratio of final losses says nothing.
  if (!std::filesystem::exists(std::string(settings.data_dir) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "needs Fashion-MNIST in " << settings.data_dir
                 << " (apt-get install dataset-fashion-mnist; scripts/bootstrap.sh installs it)";
  }
  settings.train_samples = 64 * 300;
  settings.test_samples = 2000;
  settings.max_steps = 300;
  settings.batch_size = 64;
  settings.seed = 5;
  const bench::CnnTask task(settings, torch::kCPU);
  ASSERT_TRUE(task.real_data());
  std::vector<std::string> report;
  const Result bf16 = train(task, false);
  const Result fp8 = train(task, true, &report);
  ASSERT_EQ(report.size(), 2u);
  EXPECT_NE(report[0].find("'fc2' stays in its amp precision: out_features=10"), std::string::npos) << report[0];
  EXPECT_NE(report[1].find("1 of 2 Float8Linear layers run in FP8"), std::string::npos) << report[1];
  expect_within_two_percent("example CNN, 300 steps", bf16, fp8);
}

}  // namespace
