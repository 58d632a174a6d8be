// run::save_training_checkpoint / load_training_checkpoint: one file that puts a loop back where it was (model,
// optimizer, run state), for a plain LibTorch optimizer and for amp's, and one clear line for a file that is not one.
#include <fstream>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <amp/amp.h>
#include <amp/io/atomic_file.h>
#include <run/training_checkpoint.h>
#include "python_free_examples/example_process.h"

namespace {

/// A model and an SGD with momentum that has taken two steps (so that its buffers hold something).
struct Trained {
  torch::nn::Linear model{torch::nn::LinearOptions(4, 3)};
  torch::optim::SGD sgd{model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)};
  explicit Trained(uint64_t seed) {
    torch::manual_seed(seed);
    for (auto& p : model->parameters()) p.data().normal_();
    for (int i = 0; i < 2; ++i) {
      sgd.zero_grad();
      model->forward(torch::randn({5, 4})).square().sum().backward();
      sgd.step();
    }
  }
  /// The next step's weights: equal only when the weights and the momentum buffers both came back.
  torch::Tensor next_weights() {
    torch::manual_seed(99);
    sgd.zero_grad();
    model->forward(torch::randn({5, 4})).square().sum().backward();
    sgd.step();
    return model->weight.detach().clone();
  }
};

run::RunState a_state() {
  run::RunState state;
  state.position = run::TrainingPosition{2, 3, 11};
  state.position.epoch_loss = run::EpochLoss{4.5, 3};
  state.seed = 7;
  state.batch_size = 16;
  state.world_size = 2;
  state.train_samples = 640;
  state.cpu_generator_state = run::cpu_generator_state();
  state.ddp_gradient_order = {1, 0};
  return state;
}

void expect_same_state(const run::RunState& a, const run::RunState& b) {
  EXPECT_EQ(a.position.epoch, b.position.epoch);
  EXPECT_EQ(a.position.batches_done, b.position.batches_done);
  EXPECT_EQ(a.position.steps, b.position.steps);
  EXPECT_EQ(a.position.epoch_loss.sum, b.position.epoch_loss.sum);
  EXPECT_EQ(a.position.epoch_loss.steps, b.position.epoch_loss.steps);
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.batch_size, b.batch_size);
  EXPECT_EQ(a.world_size, b.world_size);
  EXPECT_EQ(a.train_samples, b.train_samples);
  EXPECT_TRUE(torch::equal(a.cpu_generator_state, b.cpu_generator_state));
  EXPECT_EQ(a.ddp_gradient_order, b.ddp_gradient_order);
}

TEST(TrainingCheckpointTest, APlainOptimizersRunComesBackExactly) {
  example_test::Scratch scratch;
  const std::string path = scratch.file("run.pt");
  Trained saved(1);
  const run::RunState state = a_state();
  run::save_training_checkpoint(path, *saved.model, saved.sgd, state);

  Trained loaded(2);  // other weights, other momentum
  const std::optional<run::RunState> back = run::load_training_checkpoint(path, *loaded.model, loaded.sgd);
  ASSERT_TRUE(back.has_value());
  expect_same_state(*back, state);
  EXPECT_TRUE(torch::equal(loaded.next_weights(), saved.next_weights())) << "weights and momentum both restored";
}

TEST(TrainingCheckpointTest, AnAmpRunComesBackExactly) {
  example_test::Scratch scratch;
  const std::string path = scratch.file("amp.pt");
  const auto options = amp::Options().opt_level(amp::OptLevel::O2).half_dtype(at::kBFloat16);
  Trained saved(1);
  auto saved_amp = amp::initialize(saved.model, saved.sgd, options);
  const run::RunState state = a_state();
  run::save_training_checkpoint(path, saved_amp.model, saved_amp.optimizer, state);

  Trained loaded(2);
  auto loaded_amp = amp::initialize(loaded.model, loaded.sgd, options);
  const std::optional<run::RunState> back = run::load_training_checkpoint(path, loaded_amp.model, loaded_amp.optimizer);
  ASSERT_TRUE(back.has_value());
  expect_same_state(*back, state);
  for (size_t i = 0; i < saved.model->parameters().size(); ++i) {
    EXPECT_TRUE(torch::equal(loaded.model->parameters()[i], saved.model->parameters()[i])) << "parameter " << i;
  }

  // amp::save_checkpoint without the run state: loads, with none.
  amp::save_checkpoint(path, saved_amp.model, saved_amp.optimizer);
  EXPECT_FALSE(run::load_training_checkpoint(path, loaded_amp.model, loaded_amp.optimizer).has_value());
}

TEST(TrainingCheckpointTest, AFileWithoutRunStateLoadsWithNone) {
  example_test::Scratch scratch;
  const std::string path = scratch.file("old.pt");
  Trained saved(1);
  torch::serialize::OutputArchive archive, model_archive, optimizer_archive;  // as checkpoints were before run states
  saved.model->save(model_archive);
  saved.sgd.save(optimizer_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  amp::save_archive_atomically(archive, path);
  Trained loaded(2);
  EXPECT_FALSE(run::load_training_checkpoint(path, *loaded.model, loaded.sgd).has_value());
  EXPECT_TRUE(torch::equal(loaded.model->weight, saved.model->weight));
}

TEST(TrainingCheckpointTest, AFileThatIsNotOneIsOneLineNamingWhy) {
  example_test::Scratch scratch;
  Trained loaded(2);
  const torch::Tensor before = loaded.model->weight.detach().clone();
  const auto error_of = [&](const std::string& path) {
    try {
      run::load_training_checkpoint(path, *loaded.model, loaded.sgd);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string random = scratch.file("random.pt");
  std::ofstream(random) << std::string(4096, 'x');
  EXPECT_EQ(error_of(random).rfind("cannot read it as a checkpoint: damaged or truncated zip archive", 0), 0u)
      << error_of(random);
  EXPECT_EQ(error_of(random).find('\n'), std::string::npos) << "one line: " << error_of(random);

  const std::string other = scratch.file("other.pt");  // a torch archive, but not of a model and optimizer
  torch::serialize::OutputArchive archive;
  archive.write("something", torch::ones({2}));
  archive.save_to(other);
  EXPECT_EQ(error_of(other).rfind("no 'model' part: ", 0), 0u) << error_of(other);
  EXPECT_TRUE(torch::equal(loaded.model->weight, before)) << "nothing was loaded";
}

}  // namespace
