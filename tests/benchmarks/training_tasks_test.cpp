// The figures the accuracy validation reports for the tiny transformer (issue 26, bench_validate_transformer): the
// held-out loss and accuracy (TransformerTask::held_out) and the loss floor quoted beside them (loss_floor).
#include <cmath>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/training_tasks.h"

namespace {

bench::TransformerTask::Settings small_task(int64_t vocab, int64_t steps, int64_t batch, int64_t eval) {
  bench::TransformerTask::Settings settings;
  settings.model.vocab_size(vocab).seq_len(64).d_model(16).num_heads(2).num_layers(1);
  settings.steps = steps;
  settings.batch_size = batch;
  settings.eval_sequences = eval;
  settings.seed = 7;
  return settings;
}

at::Tensor tokens_named(const bench::TransformerTask& task, const std::string& name) {
  for (const auto& [key, tensor] : task.peer_data()) {
    if (key == name) return tensor;
  }
  ADD_FAILURE() << "no " << name << " in peer_data()";
  return {};
}

// Uniform logits: every held-out token costs log(V) exactly, and argmax picks token 0, so the accuracy is the share
// of held-out targets that are token 0 (counted here from the held-out sequences themselves).
TEST(TransformerTaskTest, HeldOutLossAndAccuracyOfUniformLogitsAreLogVocabAndTheShareOfToken0) {
  constexpr int64_t kVocab = 8;
  const bench::TransformerTask task(small_task(kVocab, 2, 4, 37), torch::kCPU);  // 37: a last part-batch too
  const auto held_out = task.held_out([](const torch::Tensor& x) {
    return torch::zeros({x.size(0), x.size(1), kVocab});
  });
  EXPECT_NEAR(held_out.loss, std::log(static_cast<double>(kVocab)), 1e-6);
  const auto targets = tokens_named(task, "eval_tokens").slice(1, 1);
  EXPECT_EQ(targets.size(0), 37);
  EXPECT_DOUBLE_EQ(held_out.accuracy, targets.eq(0).sum().item<double>() / static_cast<double>(targets.numel()));
  EXPECT_DOUBLE_EQ(task.accuracy([](const torch::Tensor& x) {
    return torch::zeros({x.size(0), x.size(1), kVocab});
  }),
                   held_out.accuracy);
}

// The floor is the entropy of the next token given the previous one. Measured on the generated data itself (the
// plug-in conditional entropy of 128,000 transitions over a vocabulary of 4, standard error about 0.003), it must
// agree; the formula without the rule token's share of the uniform draw would give 0.55 instead of 0.41.
TEST(TransformerTaskTest, TheLossFloorIsTheConditionalEntropyOfTheGeneratedTokens) {
  constexpr int64_t kVocab = 4;
  const bench::TransformerTask task(small_task(kVocab, 50, 40, 1), torch::kCPU);
  const auto tokens = tokens_named(task, "train_tokens");  // [2000, 65]
  const auto pairs = tokens.slice(1, 0, -1).reshape({-1}) * kVocab + tokens.slice(1, 1).reshape({-1});
  const auto counts = torch::bincount(pairs, {}, kVocab * kVocab).to(torch::kDouble).view({kVocab, kVocab});
  const auto given = counts / counts.sum(1, true);
  const double entropy =
      -(counts * torch::log(given.clamp_min(1e-300))).sum().item<double>() / counts.sum().item<double>();
  EXPECT_NEAR(task.loss_floor(), entropy, 0.015);
  EXPECT_NEAR(task.loss_floor(), 0.4141, 5e-4);  // -(0.90625 ln 0.90625 + 3 x 0.03125 ln 0.03125)
}

}  // namespace
