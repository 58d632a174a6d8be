#include "common/example_flags.h"

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

// The flags a loop hands to the run layer: --save-every and --stop-after-steps (checkpoints_from, monitor_options,
// stop_requested), and the sampler of --batch-size or --global-batch-size (sampler_from).
TEST(RunFlagsTest, SaveEveryCountsTheRunsStepsAndStopAfterStepsEndsTheRun) {
  examples::CommonFlags flags;
  flags.epochs = 2;
  flags.save = "unused";
  flags.save_every = 3;
  flags.stop_after_steps = 4;
  // From step 2 (epoch 1, batch 2 of 5): steps 3..6 run, the run's step 6 is its last.
  const run::TrainingPosition start{1, 2, 2};
  run::TrainingPosition position = start;
  const run::Checkpoints checkpoints = examples::checkpoints_from(flags);
  std::vector<int64_t> saved_at;
  while (!examples::stop_requested(flags, start, position)) {
    position.step_done(position.batches_done + 1, 5, 1.0);
    if (checkpoints.due(position.steps)) saved_at.push_back(position.steps);
  }
  EXPECT_EQ(saved_at, (std::vector<int64_t>{3, 6}));
  EXPECT_EQ(position.epoch, 2);
  EXPECT_EQ(position.batches_done, 1);
  EXPECT_EQ(position.steps, 6);
  EXPECT_EQ(examples::monitor_options(flags, start, 5).first_step, 3);
  EXPECT_EQ(examples::monitor_options(flags, start, 5).last_step, 6) << "--stop-after-steps 4 from step 2";
  flags.stop_after_steps.reset();
  EXPECT_EQ(examples::monitor_options(flags, start, 5).last_step, 10) << "the end of epoch 2";
  EXPECT_FALSE(checkpoints.final_save_needed(start, position));  // step 6 was just saved
  flags.save_every = 4;
  EXPECT_TRUE(examples::checkpoints_from(flags).final_save_needed(start, position));
}

// --global-batch-size: each step of an epoch trains on the same samples whatever the number of ranks (their parts are
// disjoint and together the step's batch), so a run resumes on another number; the epochs still shuffle.
TEST(RunFlagsTest, AGlobalBatchGivesEachStepTheSameSamplesOnAnyNumberOfRanks) {
  examples::CommonFlags flags;
  flags.global_batch_size = 12;
  constexpr int64_t kSamples = 30;                  // 2 steps of 12 per epoch; 6 samples left out
  using Steps = std::vector<std::vector<int64_t>>;  // per step of the run: the samples it trained on
  const auto run = [&](int world_size) {
    Steps steps(4);
    for (int rank = 0; rank < world_size; ++rank) {
      run::DistributedSampler sampler = examples::sampler_from(flags, kSamples, examples::Rank{rank, world_size});
      size_t step = 0;
      for (int64_t epoch = 1; epoch <= 2; ++epoch) {
        sampler.set_epoch(epoch);
        while (const auto indices = sampler.next()) {
          EXPECT_EQ(indices->numel(), 12 / world_size);
          for (int64_t i = 0; i < indices->numel(); ++i) steps.at(step).push_back((*indices)[i].item<int64_t>());
          ++step;
        }
      }
      EXPECT_EQ(step, 4u) << "2 epochs of 2 steps";
    }
    for (auto& samples : steps) std::sort(samples.begin(), samples.end());
    return steps;
  };
  const Steps one = run(1);
  EXPECT_NE(one[0], one[2]) << "epoch 2 repeats epoch 1's order";
  for (const auto& samples : one) EXPECT_EQ(std::adjacent_find(samples.begin(), samples.end()), samples.end());
  for (const int world_size : {2, 3, 4, 6}) EXPECT_EQ(run(world_size), one) << world_size << " ranks";
  try {
    run(5);
    ADD_FAILURE() << "5 ranks for a global batch of 12 were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "--global-batch-size 12 does not split evenly among 5 processes");
  }
  try {
    examples::sampler_from(flags, 10, examples::Rank{});
    ADD_FAILURE() << "a global batch above the samples was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "--global-batch-size 12 is more than the 10 training samples");
  }
  // The checkpoint records the global batch and this process's part of it.
  const auto state = examples::capture_run_state(flags, 4, kSamples, run::TrainingPosition{});
  EXPECT_EQ(state.global_batch_size, 12);
  EXPECT_EQ(state.batch_size, 3);
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
