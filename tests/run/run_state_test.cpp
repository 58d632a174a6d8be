// run::RunState: what a checkpoint keeps of where the run stands comes back whole, torch's CPU generator continues
// where it was, and a damaged state is one line naming what is wrong.
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <run/run_state.h>

namespace {

run::RunState sample_state() {
  run::RunState state;
  state.position = {3, 17, 245, {8.25, 17}};
  state.seed = 0xfedcba9876543210ULL;  // above INT64_MAX: kept bit for bit
  state.batch_size = 32;
  state.global_batch_size = 64;
  state.world_size = 2;
  state.train_samples = 6000;
  state.cpu_generator_state = run::cpu_generator_state();
  state.ddp_gradient_order = {3, 1, 2, 0};
  return state;
}

TEST(RunStateTest, EncodedAndDecodedItIsTheSame) {
  const run::RunState state = sample_state();
  const run::RunState back = run::decode_run_state(run::encode_run_state(state));
  EXPECT_EQ(back.position.epoch, 3);
  EXPECT_EQ(back.position.batches_done, 17);
  EXPECT_EQ(back.position.steps, 245);
  EXPECT_EQ(back.position.epoch_loss.sum, 8.25);
  EXPECT_EQ(back.position.epoch_loss.steps, 17);
  EXPECT_EQ(back.seed, state.seed);
  EXPECT_EQ(back.batch_size, 32);
  EXPECT_EQ(back.global_batch_size, 64);
  EXPECT_EQ(back.world_size, 2);
  EXPECT_EQ(back.train_samples, 6000);
  EXPECT_TRUE(torch::equal(back.cpu_generator_state, state.cpu_generator_state));
  EXPECT_EQ(back.ddp_gradient_order, state.ddp_gradient_order);
}

TEST(RunStateTest, TheRestoredGeneratorDrawsWhatTheSavedOneWouldHave) {
  torch::manual_seed(11);
  torch::rand({5});
  const torch::Tensor saved = run::cpu_generator_state();
  const torch::Tensor expected = torch::rand({7});
  torch::rand({100});  // the generator moves on
  run::restore_cpu_generator(saved);
  EXPECT_TRUE(torch::equal(torch::rand({7}), expected));
  try {
    run::restore_cpu_generator(torch::zeros({3}, torch::kByte));
    ADD_FAILURE() << "a 3-byte state was taken";
  } catch (const std::runtime_error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind("its CPU generator state does not load: ", 0), 0u) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(RunStateTest, ADamagedStateSaysWhatIsWrong) {
  const auto message = [](const std::string& bytes) {
    try {
      run::decode_run_state(bytes);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("decoded");
  };
  EXPECT_EQ(message("not an archive").rfind("its run state cannot be read (", 0), 0u);
  std::string bytes = run::encode_run_state(sample_state());
  EXPECT_EQ(message(bytes.substr(0, bytes.size() / 2)).rfind("its run state cannot be read (", 0), 0u);

  run::RunState negative = sample_state();
  negative.position.batches_done = -1;
  EXPECT_EQ(message(run::encode_run_state(negative)).rfind("its run state is malformed (epoch 3, batches done -1", 0),
            0u);

  torch::serialize::OutputArchive archive;  // another archive: no version
  archive.write("epoch", torch::tensor({int64_t{1}}));
  std::ostringstream other;
  archive.save_to(other);
  EXPECT_EQ(message(other.str()), "its run state has no valid 'version'");
}

}  // namespace
