// --metrics, --report and --timeline (docs/observability.md): what the files say agrees with what the program
// printed and with amp's own counts; a 2-rank report holds every figure and both ranks' timelines.
#include <cmath>
#include <limits>
#include <regex>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/example_flags.h"
#include "common/small_cnn.h"
#include "json_lines.h"
#include "python_free_examples/example_process.h"

namespace {

using example_test::lines_of;
using test_json::Json;
using test_json::lines_of_type;
using test_json::number;

TEST(ObservabilityProgramTest, MetricsLinesAgreeWithWhatTheProgramPrinted) {
  example_test::Scratch scratch;
  const std::string metrics = scratch.file("metrics.jsonl");
  // 512 samples in batches of 64: 8 steps per epoch, 16 in all; logged at 3, 6, ..., 15 and the last, 16.
  const example_test::ProcessResult run = example_test::run_process(
      {LTA_EXAMPLE_TRAIN_FASHION_MNIST, "--synthetic", "--epochs", "2", "--limit-train", "512", "--batch-size", "64",
       "--device", "cpu", "--progress-every", "0", "--metrics", metrics, "--metrics-every", "3"});
  ASSERT_EQ(run.exit_code(), 0) << run.describe();
  EXPECT_EQ(run.out.find('\r'), std::string::npos) << "no carriage return into a pipe: " << run.out;
  const std::string text = example_test::read_file(metrics);

  const auto steps = lines_of_type(text, "step");
  ASSERT_EQ(steps.size(), 6u) << text;
  for (size_t i = 0; i < steps.size(); ++i) {
    SCOPED_TRACE(steps[i].dump());
    EXPECT_EQ(number(steps[i], "step"), i < 5 ? 3.0 * static_cast<double>(i + 1) : 16.0);
    EXPECT_EQ(number(steps[i], "epoch"), i < 2 ? 1.0 : 2.0);  // steps 1-8 are epoch 1
    EXPECT_EQ(number(steps[i], "lr"), 0.05);
    EXPECT_TRUE(std::isfinite(number(steps[i], "loss")));
    EXPECT_GT(number(steps[i], "samples_per_s"), 0.0);
    ASSERT_EQ(steps[i]["ranks"].size(), 1u);
    const Json& rank0 = steps[i]["ranks"][0];  // the step's times are each rank's
    EXPECT_EQ(number(rank0, "loss"), number(steps[i], "loss")) << "one rank: its loss is the step's";
    const double step_ms = number(rank0, "step_ms");
    const double phases = number(rank0, "forward_ms") + number(rank0, "backward_ms") + number(rank0, "optimizer_ms");
    EXPECT_GT(number(rank0, "forward_ms"), 0.0);
    EXPECT_GT(number(rank0, "backward_ms"), 0.0);
    EXPECT_GT(number(rank0, "optimizer_ms"), 0.0);
    EXPECT_LE(phases, step_ms + 1e-6) << "the phases are parts of the step";
    EXPECT_TRUE(std::isnan(number(steps[i], "loss_scale"))) << "no amp: null";
  }
  // Each epoch's line in the file says what the program printed for it.
  const auto epochs = lines_of_type(text, "epoch");
  ASSERT_EQ(epochs.size(), 2u) << text;
  const std::regex printed("epoch ([0-9]+)/2: mean loss ([0-9.]+) \\| test accuracy ([0-9.]+)%");
  int matched = 0;
  for (const std::string& line : lines_of(run.out)) {
    std::smatch m;
    if (!std::regex_search(line, m, printed)) continue;
    const size_t e = std::stoul(m[1]) - 1;
    ASSERT_LT(e, epochs.size());
    EXPECT_EQ(fmt::format("{:.4f}", number(epochs[e], "mean_loss")), m[2].str()) << epochs[e].dump();
    EXPECT_EQ(fmt::format("{:.2f}", 100 * number(epochs[e], "test_accuracy")), m[3].str()) << epochs[e].dump();
    EXPECT_EQ(number(epochs[e], "step"), 8.0 * static_cast<double>(e + 1));
    ++matched;
  }
  EXPECT_EQ(matched, 2) << run.out;
}

// The skipped steps --metrics logs are amp's own count: steps whose loss was made infinite are skipped, and each
// logged line says how many so far.
TEST(ObservabilityTest, SkippedStepsEqualTheStepsWhoseGradientsOverflowed) {
  example_test::Scratch scratch;
  torch::manual_seed(3);
  examples::CommonFlags flags;
  flags.batch_size = 32;
  flags.quiet = true;
  flags.observe.metrics = scratch.file("metrics.jsonl");
  flags.observe.metrics_every = 1;
  const examples::ImageSplit train = examples::synthetic_fashion_mnist(256, 3, /*train=*/true);  // 8 steps
  examples::SmallCnn net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01));
  auto mixed = amp::initialize(
      net, sgd, amp::Options().opt_level(amp::OptLevel::O1).half_dtype(at::kBFloat16).dynamic_loss_scale());
  const std::vector<int64_t> overflowing = {2, 5, 6};
  std::vector<int64_t> skipped_by_amp;  // after each step: the steps amp's step reports said it skipped, so far
  run::DistributedSampler sampler = examples::sampler_from(flags, train.images.size(0), examples::Rank{});
  run::Monitor monitor(examples::monitor_options(flags, {}, sampler.batches_per_epoch()), 0, 1, torch::kCPU,
                       {"", [&] { return run::step_values(sgd, &mixed.optimizer); }});
  sampler.set_epoch(1);
  monitor.begin_epoch(1, sampler.batches_per_epoch());
  for (int64_t step = 1; const auto indices = sampler.next(); ++step) {
    const auto [images, labels] = train.batch(*indices, torch::kCPU);
    monitor.begin_step();
    mixed.optimizer.zero_grad();
    auto loss = torch::cross_entropy_loss(mixed.model.forward(images), labels);
    if (std::count(overflowing.begin(), overflowing.end(), step) > 0)
      loss = loss * std::numeric_limits<float>::infinity();
    {
      auto scaled = amp::scale_loss(loss, mixed.optimizer);
      scaled.backward();
    }
    mixed.optimizer.step();
    const int64_t before = skipped_by_amp.empty() ? 0 : skipped_by_amp.back();
    skipped_by_amp.push_back(before + (mixed.optimizer.last_step_now().skipped ? 1 : 0));
    monitor.step(loss.item<double>(), indices->numel());
  }
  monitor.end_epoch();
  monitor.finish();

  const auto steps = lines_of_type(example_test::read_file(flags.observe.metrics), "step");
  ASSERT_EQ(steps.size(), 8u);
  int64_t injected = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    SCOPED_TRACE(steps[i].dump());
    injected += std::count(overflowing.begin(), overflowing.end(), static_cast<int64_t>(i + 1));
    EXPECT_EQ(number(steps[i], "skipped_steps"), static_cast<double>(injected));
    EXPECT_EQ(number(steps[i], "skipped_steps"), static_cast<double>(skipped_by_amp[i]));
    EXPECT_GT(number(steps[i], "loss_scale"), 0.0);
  }
  EXPECT_LT(number(steps.back(), "loss_scale"), number(steps.front(), "loss_scale"))
      << "each overflow halves the scale";
}

// A resumed run continues --metrics: the lines the stopped run wrote after its checkpoint (the steps the resumed run
// takes again) are dropped, so each step appears once; a fresh run starts the file over.
TEST(ObservabilityTest, AResumedRunDropsTheStepsItTakesAgainFromItsMetrics) {
  example_test::Scratch scratch;
  run::ObserveOptions flags;
  flags.metrics = scratch.file("metrics.jsonl");
  flags.metrics_every = 2;
  std::string before;
  for (int step = 2; step <= 10; step += 2) before += fmt::format("{{\"type\": \"step\", \"step\": {}}}\n", step);
  before += "{\"type\": \"epoch\", \"epoch\": 1, \"step\": 8, \"mean_loss\": 1}\n";
  example_test::write_file(flags.metrics, before);
  flags.resumed = true;
  {
    // The checkpoint was at step 5: this run takes steps 6..12.
    run::RunObserver observer(flags, 0, 1, torch::kCPU, {}, 6, 12);
    for (int64_t step = 6; step <= 12; ++step) {
      run::StepPhases phases = observer.begin_step(step);
      phases.begin();
      phases.finish();
      observer.end_step(step, 2, 1.0, phases, 64);
    }
  }
  std::vector<double> steps;
  for (const Json& line : lines_of_type(example_test::read_file(flags.metrics))) steps.push_back(number(line, "step"));
  EXPECT_EQ(steps, (std::vector<double>{2, 4, 6, 8, 10, 12}));

  flags.resumed = false;
  { run::RunObserver fresh(flags, 0, 1, torch::kCPU, {}, 1, 3); }
  EXPECT_EQ(example_test::read_file(flags.metrics), "") << "a fresh run starts the file over";
}

#ifdef LTA_DDP_LAUNCH
// What a user of the 2-rank report relies on: every figure is there, the timeline holds both ranks' buckets, and the
// metrics lines carry both ranks' times. (tests/report/check_report_in_browser.sh opens such a report in chromium.)
TEST(ObservabilityProgramTest, ATwoRankRunWritesEveryFigureAndBothRanksTimelines) {
  example_test::Scratch scratch;
  const std::string report = scratch.file("report.html");
  const std::string trace = scratch.file("trace.json");
  const std::string metrics = scratch.file("metrics.jsonl");
  const example_test::ProcessResult run = example_test::run_process(
      {LTA_DDP_LAUNCH, "--nproc-per-node", "2",   "--master-port", "0",     LTA_EXAMPLE_AMP_DDP,
       "--synthetic",  "--epochs",         "1",   "--limit-train", "1024",  "--batch-size",
       "64",           "--device",         "cpu", "--opt-level",   "O2",    "--report",
       report,         "--timeline",       trace, "--metrics",     metrics, "--timeline-steps",
       "4:5"});
  ASSERT_EQ(run.exit_code(), 0) << run.describe();
  const std::string html = example_test::read_file(report);
  for (const char* id :
       {"summary", "fig-loss", "fig-accuracy", "fig-throughput", "fig-scale", "fig-rank-step-time", "fig-timeline"}) {
    EXPECT_NE(html.find(std::string("id=\"") + id + "\""), std::string::npos) << id;
  }
  EXPECT_NE(html.find("rank 1 comm"), std::string::npos) << "rank 1's allreduces are drawn";
  EXPECT_NE(html.find("unscale bucket 0"), std::string::npos) << "amp's unscale is drawn";
  const Json events = test_json::parse(example_test::read_file(trace))["traceEvents"];
  EXPECT_EQ(test_json::count_where(events, "name", "process_name"), 2u);
  EXPECT_EQ(test_json::count_where(events, "name", "allreduce bucket 0"), 4u) << "2 ranks x steps 4 and 5";
  EXPECT_EQ(test_json::count_where(events, "name", "optimizer step"), 4u);
  for (const Json& line : lines_of_type(example_test::read_file(metrics), "step")) {
    ASSERT_EQ(line["ranks"].size(), 2u) << line.dump();
    // The wait for the allreduces is part of each rank's backward.
    for (const Json& rank : line["ranks"]) {
      EXPECT_LE(number(rank, "comm_wait_ms"), number(rank, "backward_ms")) << line.dump();
    }
  }
}
#endif

}  // namespace
