// run::Monitor, fed by a loop of the test's own: the progress lines, the metrics lines (logged steps, each epoch),
// the report, a resumed run's step numbers and appended metrics, and misuse.
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <run/monitor.h>
#include <run/observer.h>
#include "json_lines.h"
#include "python_free_examples/example_process.h"

namespace {

using test_json::Json;
using test_json::lines_of_type;
using test_json::number;

std::string text_of(std::FILE* file) {
  std::fflush(file);
  std::rewind(file);
  std::string all;
  char buffer[4096];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof buffer, file)) > 0) all.append(buffer, n);
  return all;
}

/// Epochs `first_epoch`..`epochs` of 5 steps (losses 1, 2, ...: the step number), from step `first_step` on; an
/// epoch's accuracy is epoch / 10.
void train(run::Monitor& monitor, int64_t first_epoch, int64_t epochs, int64_t first_batch = 0) {
  for (int64_t epoch = first_epoch; epoch <= epochs; ++epoch) {
    monitor.begin_epoch(epoch, 5, epoch == first_epoch ? first_batch : 0);
    for (int64_t batch = epoch == first_epoch ? first_batch : 0; batch < 5; ++batch) {
      run::StepPhases& phases = monitor.begin_step();
      phases.end(run::Phase::kForward);
      phases.end(run::Phase::kBackward);
      phases.end(run::Phase::kOptimizer);
      monitor.step(static_cast<double>(monitor.next_step()), 32);
    }
    monitor.end_epoch(static_cast<double>(epoch) / 10.0);
  }
  monitor.finish();
}

TEST(MonitorTest, ALoopOfItsOwnGetsProgressMetricsAndReport) {
  example_test::Scratch scratch;
  run::MonitorOptions options;
  options.progress = run::ProgressStyle::kLines;
  options.progress_every_seconds = 0;  // a line per step
  options.epochs = 2;
  options.observe.metrics = scratch.file("metrics.jsonl");
  options.observe.metrics_every = 2;
  options.observe.report = scratch.file("report.html");
  options.first_step = 1;
  options.last_step = 10;
  std::FILE* out = std::tmpfile();
  {
    const auto values = [] {
      run::StepValues v;
      v.lr = 0.5;
      return v;
    };
    run::Monitor monitor(options, 0, 1, torch::kCPU, {"a test run", values}, out);
    train(monitor, 1, 2);
    EXPECT_EQ(monitor.next_step(), 11);
  }
  const auto progress = example_test::lines_of(text_of(out));
  std::fclose(out);
  ASSERT_EQ(progress.size(), 10u);
  EXPECT_EQ(progress[2].rfind("epoch 1/2 step 3/5 mean loss 2.0000 | ", 0), 0u) << progress[2];  // (1 + 2 + 3) / 3
  EXPECT_EQ(progress[9].rfind("epoch 2/2 step 5/5 mean loss 8.0000 | ", 0), 0u) << progress[9];  // steps 6..10

  std::vector<double> steps, epochs;
  for (const Json& line : lines_of_type(example_test::read_file(options.observe.metrics))) {
    if (line["type"] == "step") {
      steps.push_back(number(line, "step"));
      EXPECT_EQ(number(line, "loss"), number(line, "step")) << line.dump();
      EXPECT_EQ(number(line, "lr"), 0.5) << line.dump();
      EXPECT_GT(number(line, "samples_per_s"), 0) << line.dump();
    } else {
      EXPECT_EQ(line["type"], "epoch") << line.dump();
      epochs.push_back(number(line, "mean_loss"));
      EXPECT_EQ(number(line, "test_accuracy"), number(line, "epoch") / 10.0) << line.dump();
    }
  }
  EXPECT_EQ(steps, (std::vector<double>{2, 4, 6, 8, 10}));
  EXPECT_EQ(epochs, (std::vector<double>{3, 8}));
  const std::string report = example_test::read_file(options.observe.report);
  EXPECT_NE(report.find("id=\"fig-loss\""), std::string::npos);
  EXPECT_NE(report.find("id=\"fig-accuracy\""), std::string::npos);
  EXPECT_NE(report.find("a test run"), std::string::npos);
}

// Without metrics_every a run logs about 100 steps whatever its length (issue 39: a 16-step run's charts had 2 points).
TEST(MonitorTest, WithoutAnIntervalAShortRunLogsEveryStepAndALongOneAbout100) {
  EXPECT_EQ(run::default_metrics_every(16), 1);
  EXPECT_EQ(run::default_metrics_every(100), 1);
  EXPECT_EQ(run::default_metrics_every(101), 2);
  EXPECT_EQ(run::default_metrics_every(1000), 10);
  EXPECT_EQ(run::default_metrics_every(100000), 1000);
  example_test::Scratch scratch;
  run::MonitorOptions options;
  options.progress = run::ProgressStyle::kQuiet;
  options.epochs = 4;
  options.observe.metrics = scratch.file("metrics.jsonl");
  options.observe.report = scratch.file("report.html");
  options.first_step = 1;
  options.last_step = 20;
  {
    run::Monitor monitor(options, 0, 1, torch::kCPU);
    train(monitor, 1, 4);
  }
  std::vector<double> steps;
  for (const Json& line : lines_of_type(example_test::read_file(options.observe.metrics), "step")) {
    steps.push_back(number(line, "step"));
  }
  EXPECT_EQ(steps.size(), 20u) << "every step of a 20-step run";
  EXPECT_EQ(steps.front(), 1.0);
}

TEST(MonitorTest, AResumedRunNumbersItsStepsOnAndAppendsToItsMetrics) {
  example_test::Scratch scratch;
  run::MonitorOptions options;
  options.progress = run::ProgressStyle::kQuiet;
  options.epochs = 2;
  options.observe.metrics = scratch.file("metrics.jsonl");
  options.observe.metrics_every = 2;
  options.last_step = 10;
  {
    // The first run stops after step 7 (epoch 2, batch 2): as if killed after a checkpoint at step 7.
    options.last_step = 7;
    run::Monitor monitor(options, 0, 1, torch::kCPU);
    monitor.begin_epoch(1, 5);
    for (int i = 0; i < 5; ++i) {
      monitor.begin_step();
      monitor.step(1.0, 8);
    }
    monitor.end_epoch();
    monitor.begin_epoch(2, 5);
    for (int i = 0; i < 2; ++i) {
      monitor.begin_step();
      monitor.step(1.0, 8, /*last=*/i == 1);
    }
    monitor.finish();
  }
  options.observe.resumed = true;
  options.first_step = 8;
  options.last_step = 10;
  {
    run::Monitor monitor(options, 0, 1, torch::kCPU);
    EXPECT_EQ(monitor.next_step(), 8);
    train(monitor, 2, 2, /*first_batch=*/2);
  }
  std::vector<double> steps;
  for (const Json& line : lines_of_type(example_test::read_file(options.observe.metrics))) {
    steps.push_back(number(line, "step"));
  }
  // Steps 2, 4, 6 and the first run's last (7), epoch 1 (at step 5), then 8, 10 and epoch 2 (at step 10).
  EXPECT_EQ(steps, (std::vector<double>{2, 4, 5, 6, 7, 8, 10, 10}));
}

// A run resumed inside an epoch prints the mean loss of the whole epoch, as the unbroken run does: the losses before
// the checkpoint come with its position.
TEST(MonitorTest, AResumedEpochsMeanLossCoversTheStepsBeforeTheResume) {
  run::MonitorOptions options;
  options.progress = run::ProgressStyle::kQuiet;
  options.last_step = 4;
  run::Monitor unbroken(options, 0, 1, torch::kCPU);
  unbroken.begin_epoch(1, 4);
  run::TrainingPosition position;
  for (const double loss : {0.1, 0.7, 0.3, 0.9}) {
    unbroken.begin_step();
    unbroken.step(loss, 8);
    if (position.steps < 2) position.step_done(position.batches_done + 1, 4, loss);  // the checkpoint: after step 2
  }
  options.first_step = 3;
  run::Monitor resumed(options, 0, 1, torch::kCPU);
  resumed.begin_epoch(1, 4, position.batches_done, position.epoch_loss);
  for (const double loss : {0.3, 0.9}) {
    resumed.begin_step();
    resumed.step(loss, 8);
  }
  EXPECT_EQ(resumed.epoch_trained(), unbroken.epoch_trained()) << "bit for bit: the same sum in the same order";
  EXPECT_EQ(unbroken.epoch_mean_loss(), (0.1 + 0.7 + 0.3 + 0.9) / 4);
}

TEST(MonitorTest, AStepWithoutBeginStepIsRefused) {
  run::MonitorOptions options;
  options.progress = run::ProgressStyle::kQuiet;
  run::Monitor monitor(options, 0, 1, torch::kCPU);
  monitor.begin_epoch(1, 1);
  EXPECT_THROW(monitor.step(1.0, 1), std::logic_error);
}

}  // namespace
