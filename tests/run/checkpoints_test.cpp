// run::Checkpoints (where a run saves, how often, and what a restarted run continues from) and the position
// arithmetic a loop of the user's own does with it (TrainingPosition::step_done, run::last_step).
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <run/checkpoints.h>
#include "python_free_examples/example_process.h"

namespace {

void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

/// A check that reads a file written by write_text and refuses one that says "damaged".
void check_text(const std::string& path) {
  if (example_test::read_file(path) == "damaged") throw std::runtime_error("it is damaged");
}

TEST(CheckpointsTest, AFolderKeepsTheNewestAndARestartContinuesFromTheNewestThatReads) {
  example_test::Scratch scratch;
  run::CheckpointOptions options;
  options.folder = scratch.file("runs");
  options.keep_last = 2;
  options.every = 3;
  const run::Checkpoints checkpoints(options);
  EXPECT_FALSE(checkpoints.newest(check_text).has_value()) << "a fresh start: the folder does not exist yet";
  std::vector<int64_t> saved;
  for (int64_t step = 1; step <= 10; ++step) {
    if (!checkpoints.due(step)) continue;
    saved.push_back(step);
    checkpoints.save(step, [&](const std::string& path) { write_text(path, std::to_string(step)); });
  }
  EXPECT_EQ(saved, (std::vector<int64_t>{3, 6, 9}));
  EXPECT_EQ(example_test::folder_entries(options.folder),
            (std::vector<std::string>{"step-000000000006.pt", "step-000000000009.pt"}));
  EXPECT_EQ(checkpoints.newest(check_text), options.folder + "/step-000000000009.pt");

  write_text(options.folder + "/step-000000000009.pt", "damaged");
  std::vector<std::string> warnings;
  EXPECT_EQ(checkpoints.newest(check_text, [&](const std::string& line) { warnings.push_back(line); }),
            options.folder + "/step-000000000006.pt");
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("step-000000000009.pt: it is damaged"), std::string::npos) << warnings[0];
}

TEST(CheckpointsTest, OneFileIsRewrittenAndACollectiveSavesOtherRanksOnlyWrite) {
  example_test::Scratch scratch;
  run::CheckpointOptions options;
  options.file = scratch.file("last.pt");
  const run::Checkpoints file(options);
  EXPECT_FALSE(file.due(10)) << "no --save-every: only the final save";
  EXPECT_EQ(file.save(4, [](const std::string& path) { write_text(path, "4"); }), options.file);
  EXPECT_EQ(file.save(8, [](const std::string& path) { write_text(path, "8"); }), options.file);
  EXPECT_EQ(example_test::read_file(options.file), "8");
  EXPECT_FALSE(file.newest(check_text).has_value()) << "a file is resumed from by name (--resume), not found";

  run::CheckpointOptions folder_options;
  folder_options.folder = scratch.file("zero");
  folder_options.keep_last = 1;
  const run::Checkpoints folder(folder_options);
  folder.save(1, [](const std::string& path) { write_text(path, "1"); });
  std::string seen;
  folder.save(
      2, [&](const std::string& path) { seen = path; }, /*writer=*/false);
  EXPECT_EQ(seen, folder_options.folder + "/step-000000000002.pt") << "the path the writer writes";
  EXPECT_EQ(example_test::folder_entries(folder_options.folder), (std::vector<std::string>{"step-000000000001.pt"}))
      << "a rank that only takes part writes and prunes nothing";
}

TEST(CheckpointsTest, TheEndIsSavedUnlessTheLastDueSaveWroteIt) {
  run::CheckpointOptions options;
  options.file = "/tmp/unused.pt";
  options.every = 5;
  const run::Checkpoints checkpoints(options);
  const run::TrainingPosition start{1, 0, 0};
  EXPECT_FALSE(checkpoints.final_save_needed(start, {2, 3, 10})) << "step 10 was just saved";
  EXPECT_TRUE(checkpoints.final_save_needed(start, {2, 4, 11}));
  EXPECT_TRUE(checkpoints.final_save_needed({2, 0, 10}, {2, 0, 10})) << "no step taken: the end was not saved here";
  EXPECT_FALSE(run::Checkpoints(run::CheckpointOptions{}).final_save_needed(start, {2, 4, 11})) << "nowhere to save";
}

TEST(CheckpointsTest, BadOptionsAreOneLine) {
  const auto message = [](const run::CheckpointOptions& options) {
    try {
      run::Checkpoints checkpoints(options);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  run::CheckpointOptions keep;
  keep.keep_last = 0;
  EXPECT_EQ(message(keep), "keep_last must be positive, got 0");
  run::CheckpointOptions every;
  every.every = -2;
  EXPECT_EQ(message(every), "every must be a positive number of steps, got -2");
}

TEST(TrainingPositionTest, StepsCrossIntoTheNextEpochAndTheLastStepIsCounted) {
  run::TrainingPosition position{1, 3, 3, {6.0, 3}};
  position.step_done(4, 5, 1.5);
  EXPECT_EQ(position.epoch, 1);
  EXPECT_EQ(position.batches_done, 4);
  EXPECT_EQ(position.steps, 4);
  EXPECT_EQ(position.epoch_loss.mean(), 7.5 / 4) << "the epoch's losses so far, the 4th added";
  position.step_done(5, 5, 0.5);
  EXPECT_EQ(position.epoch, 2);
  EXPECT_EQ(position.batches_done, 0);
  EXPECT_EQ(position.steps, 5);
  EXPECT_EQ(position.epoch_loss.steps, 0) << "a new epoch starts with none";
  EXPECT_EQ(run::last_step({1, 0, 0}, 3, 5), 15);
  EXPECT_EQ(run::last_step({2, 2, 7}, 3, 5), 15) << "resumed mid-epoch: the same last step";
  EXPECT_EQ(run::last_step({4, 0, 15}, 3, 5), 15) << "past the last epoch: no step left";
}

}  // namespace
