#include "common/training.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

std::string invalid_argument_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected std::invalid_argument";
  return "";
}

TEST(OneLineTest, CutsANestedBacktraceJoinsLinesAndEscapesBytes) {
  EXPECT_EQ(examples::one_line("cannot read 'x': bad zip\nException raised from load at f.cpp:3 (most recent call "
                               "first):\nframe #0: c10::Error::Error()"),
            "cannot read 'x': bad zip");
  EXPECT_EQ(examples::one_line("first\nsecond\n"), "first; second");
  EXPECT_EQ(examples::one_line(std::string("bad \x01\xff\tend", 10)), "bad \\x01\\xff end");
}

TEST(OneLineTest, WhatOfALibTorchErrorIsCutToItsMessage) {
  try {
    TORCH_CHECK(false, "the message");
  } catch (const c10::Error& e) {
    EXPECT_EQ(examples::one_line(std::string("wrapped: ") + e.what()), "wrapped: the message");
  }
}

TEST(PickDeviceTest, NamesTheFlagForDevicesThatAreNotThere) {
  EXPECT_EQ(examples::pick_device("cpu"), torch::Device(torch::kCPU));
  EXPECT_EQ(invalid_argument_of([] { examples::pick_device("tpu"); }),
            "--device 'tpu' is not a device: use auto, cpu, cuda or cuda:N");
  if (torch::cuda::is_available()) {
    const auto visible = static_cast<int>(torch::cuda::device_count());
    EXPECT_EQ(examples::pick_device("cuda", visible - 1), torch::Device(torch::kCUDA, visible - 1));
    EXPECT_NE(invalid_argument_of([&] {
                examples::pick_device("cuda:" + std::to_string(visible));
              }).find("only " + std::to_string(visible) + " CUDA GPU(s) are visible"),
              std::string::npos);
  } else {
    EXPECT_EQ(invalid_argument_of([] { examples::pick_device("cuda"); }),
              "--device cuda: no CUDA GPU is visible (use --device cpu)");
    EXPECT_EQ(examples::pick_device("auto"), torch::Device(torch::kCPU));
  }
}

TEST(CheckCommonFlagsTest, NamesTheFlagAndTheValue) {
  examples::CommonFlags good;
  examples::check_common_flags(good);
  const auto error_with = [&](const std::function<void(examples::CommonFlags&)>& change) {
    examples::CommonFlags flags;
    change(flags);
    return invalid_argument_of([&] { examples::check_common_flags(flags); });
  };
  EXPECT_EQ(error_with([](auto& f) { f.batch_size = 0; }), "--batch-size must be a positive integer, got 0");
  EXPECT_EQ(error_with([](auto& f) { f.epochs = -3; }), "--epochs must be a positive integer, got -3");
  EXPECT_EQ(error_with([](auto& f) { f.lr = std::nan(""); }), "--lr must be a positive finite number, got nan");
  EXPECT_EQ(error_with([](auto& f) { f.lr = std::numeric_limits<double>::infinity(); }),
            "--lr must be a positive finite number, got inf");
  EXPECT_EQ(error_with([](auto& f) { f.limit_train = -1; }), "--limit-train must be 0 (all) or positive, got -1");
  EXPECT_EQ(error_with([](auto& f) { f.progress_every = -1; }),
            "--progress-every must be 0 (every step) or a positive number of seconds, got -1");
  EXPECT_EQ(error_with([](auto& f) { f.progress_every = std::nan(""); }),
            "--progress-every must be 0 (every step) or a positive number of seconds, got nan");
  EXPECT_EQ(error_with([](auto& f) { f.resume = "/nonexistent/model.pt"; }),
            "--resume '/nonexistent/model.pt': no such file");
  EXPECT_EQ(error_with([](auto& f) { f.resume = "/tmp"; }), "--resume '/tmp': not a file");
  EXPECT_EQ(error_with([](auto& f) { f.save = "/nonexistent/model.pt"; }),
            "--save '/nonexistent/model.pt': the folder '/nonexistent' does not exist");
  EXPECT_EQ(error_with([](auto& f) { f.save = "/tmp"; }), "--save '/tmp': it is a folder, not a file");
  EXPECT_EQ(error_with([](auto& f) { f.save_every = 0; }), "--save-every must be a positive integer, got 0");
  EXPECT_EQ(error_with([](auto& f) { f.save_every = 3; }),
            "--save-every needs --save or --checkpoint-dir (where it writes)");
  EXPECT_EQ(error_with([](auto& f) { f.keep_last = 0; }), "--keep-last must be a positive integer, got 0");
  EXPECT_EQ(error_with([](auto& f) {
              f.checkpoint_dir = "/tmp";
              f.save = "/tmp/lta_model.pt";
            }),
            "--checkpoint-dir '/tmp' replaces --save and --resume: give one or the other");
  EXPECT_EQ(error_with([](auto& f) { f.checkpoint_dir = "/proc/self/status"; }),
            "--checkpoint-dir '/proc/self/status': it is a file, not a folder");
  EXPECT_EQ(error_with([](auto& f) { f.stop_after_steps = -1; }),
            "--stop-after-steps must be a positive integer, got -1");
  examples::CommonFlags saving_every;
  saving_every.save = "/tmp/lta_model.pt";
  saving_every.save_every = 3;
  saving_every.stop_after_steps = 7;
  examples::check_common_flags(saving_every);
}

// What the examples record to resume exactly: the flags that fix the data order, the position, the generator (the
// bytes' round trip is run::RunState's: tests/run/run_state_test.cpp).
TEST(CaptureRunStateTest, RecordsTheFlagsThatFixTheDataOrder) {
  examples::CommonFlags flags;
  flags.seed = 0xfedcba9876543210ULL;
  flags.global_batch_size = 96;
  torch::manual_seed(11);
  const auto state = examples::capture_run_state(flags, 4, 1234, run::TrainingPosition{3, 7, 40}, {2, 0, 1});
  EXPECT_EQ(state.position.batches_done, 7);
  EXPECT_EQ(state.seed, flags.seed);
  EXPECT_EQ(state.batch_size, 24) << "the batch per process: 96 over 4";
  EXPECT_EQ(state.global_batch_size, 96);
  EXPECT_EQ(state.world_size, 4);
  EXPECT_EQ(state.train_samples, 1234);
  EXPECT_EQ(state.ddp_gradient_order, (std::vector<int64_t>{2, 0, 1}));
  EXPECT_TRUE(torch::equal(state.cpu_generator_state, run::cpu_generator_state()));
}

// The CPU generator is part of the resume: after resume_position, torch's draws continue as in the saved run.
TEST(ResumePositionTest, RestoresTheDefaultCpuGenerator) {
  examples::CommonFlags flags;
  torch::manual_seed(21);
  torch::rand({5});
  const auto state = examples::capture_run_state(flags, 1, 100, run::TrainingPosition{2, 1, 9});
  const torch::Tensor expected = torch::rand({5});
  torch::manual_seed(22);
  const auto position = examples::resume_position("x.pt", state, flags, 1, 100, examples::Rank{});
  EXPECT_EQ(position.steps, 9);
  EXPECT_TRUE(torch::equal(torch::rand({5}), expected));
}

TEST(TrainEpochsTest, SavesEveryKStepsOfTheRunAndStopsMidEpoch) {
  examples::CommonFlags flags;
  flags.epochs = 2;
  flags.batch_size = 4;
  flags.save = "unused";
  flags.save_every = 3;
  flags.stop_after_steps = 4;
  examples::ImageSplit train{torch::zeros({20, 1, 28, 28}), torch::zeros({20}, torch::kInt64)};  // 5 batches
  std::vector<int64_t> saved_at;
  std::vector<int64_t> ended;
  examples::Loop loop;
  loop.step = [](const torch::Tensor&, const torch::Tensor&, run::StepPhases&) { return torch::zeros({}); };
  loop.save = [&](const run::TrainingPosition& at) { saved_at.push_back(at.steps); };
  loop.end_epoch = [&](int64_t epoch, double) -> std::optional<double> {
    ended.push_back(epoch);
    return std::nullopt;
  };
  // From step 2 (epoch 1, batch 2): steps 3..6 run; the save at step 3 is inside epoch 1, at 6 inside epoch 2.
  const auto start = run::TrainingPosition{1, 2, 2};
  const auto end = examples::train_epochs(flags, train, torch::kCPU, examples::Rank{}, start, loop);
  EXPECT_EQ(saved_at, (std::vector<int64_t>{3, 6}));
  EXPECT_EQ(ended, (std::vector<int64_t>{1}));
  EXPECT_EQ(end.epoch, 2);
  EXPECT_EQ(end.batches_done, 1);
  EXPECT_EQ(end.steps, 6);
  EXPECT_FALSE(examples::final_save_needed(flags, start, end));  // step 6 was just saved
  flags.save_every = 4;
  EXPECT_TRUE(examples::final_save_needed(flags, start, end));
}

// --global-batch-size: each step of an epoch trains on the same samples whatever the number of ranks (their parts are
// disjoint and together the step's batch), so a run resumes on another number; the epochs still shuffle.
TEST(TrainEpochsTest, AGlobalBatchGivesEachStepTheSameSamplesOnAnyNumberOfRanks) {
  examples::CommonFlags flags;
  flags.epochs = 2;
  flags.global_batch_size = 12;
  flags.quiet = true;
  constexpr int64_t kSamples = 30;  // 2 steps of 12 per epoch; 6 samples left out
  const examples::ImageSplit train{torch::zeros({kSamples, 1, 28, 28}), torch::arange(kSamples, torch::kInt64)};
  using Steps = std::vector<std::vector<int64_t>>;  // per step of the run: the samples (labels) it trained on
  const auto run = [&](int world_size) {
    Steps steps;
    for (int rank = 0; rank < world_size; ++rank) {
      size_t step = 0;
      examples::Loop loop;
      loop.step = [&](const torch::Tensor&, const torch::Tensor& labels, run::StepPhases&) {
        EXPECT_EQ(labels.numel(), 12 / world_size);
        if (steps.size() <= step) steps.resize(step + 1);
        for (int64_t i = 0; i < labels.numel(); ++i) steps[step].push_back(labels[i].item<int64_t>());
        ++step;
        return torch::zeros({});
      };
      examples::train_epochs(flags, train, torch::kCPU, examples::Rank{rank, world_size}, {}, loop);
    }
    for (auto& samples : steps) std::sort(samples.begin(), samples.end());
    return steps;
  };
  const Steps one = run(1);
  ASSERT_EQ(one.size(), 4u);  // 2 epochs of 2 steps
  EXPECT_NE(one[0], one[2]) << "epoch 2 repeats epoch 1's order";
  for (const auto& samples : one) EXPECT_EQ(std::adjacent_find(samples.begin(), samples.end()), samples.end());
  for (const int world_size : {2, 3, 4, 6}) EXPECT_EQ(run(world_size), one) << world_size << " ranks";
  try {
    run(5);
    ADD_FAILURE() << "5 ranks for a global batch of 12 were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "--global-batch-size 12 does not split evenly among 5 processes");
  }
  // The checkpoint records the global batch and this process's part of it.
  const auto state = examples::capture_run_state(flags, 4, kSamples, run::TrainingPosition{});
  const auto back = run::decode_run_state(run::encode_run_state(state));
  EXPECT_EQ(back.global_batch_size, 12);
  EXPECT_EQ(back.batch_size, 3);
}

TEST(ParseFlagsTest, ABadCommandLineIsOneLineAndANonZeroStatus) {
  examples::CommonFlags flags;
  CLI::App app{"test"};
  examples::add_common_flags(app, flags);
  char program[] = "/path/to/example";
  char flag[] = "--no-such-flag";
  char* argv[] = {program, flag};
  testing::internal::CaptureStderr();
  const auto status = examples::parse_flags(app, 2, argv);
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(status.has_value());
  EXPECT_NE(*status, 0);
  EXPECT_EQ(err, "example: unknown flag --no-such-flag (see --help)\n");
}

TEST(ParseFlagsTest, UnknownFlagsAreNamedInCommandLineOrder) {
  const auto error_of = [](std::vector<std::string> args) {
    examples::CommonFlags flags;
    CLI::App app{"test"};
    examples::add_common_flags(app, flags);
    args.insert(args.begin(), "example");
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    testing::internal::CaptureStderr();
    const auto status = examples::parse_flags(app, static_cast<int>(argv.size()), argv.data());
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_TRUE(status.has_value() && *status != 0);
    return err;
  };
  // CLI11's own line was "The following arguments were not expected: x --what 1 --bogus".
  EXPECT_EQ(error_of({"--bogus", "1", "--epochs", "2", "--what", "x"}),
            "example: unknown flags --bogus, --what (see --help)\n");
  EXPECT_EQ(error_of({"stray", "-1"}), "example: unexpected arguments stray -1 (see --help)\n");
}

}  // namespace
