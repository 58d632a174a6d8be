// The examples' progress output, their stdout a pipe (run::Progress itself: tests/run/progress_test.cpp).
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "python_free_examples/example_process.h"

namespace {

using example_test::lines_of;

// The programs themselves, their stdout a pipe: plain progress lines only, one per step with --progress-every 0,
// and none with --quiet.
TEST(ProgressOutputTest, AnExampleWritingToAPipePrintsPlainLines) {
  const std::vector<std::string> quick = {
      LTA_EXAMPLE_TRAIN_FASHION_MNIST, "--synthetic", "--limit-train", "256", "--batch-size", "64", "--device", "cpu"};
  std::vector<std::string> every_step = quick;
  every_step.insert(every_step.end(), {"--progress-every", "0"});
  const example_test::ProcessResult run = example_test::run_process(every_step);
  ASSERT_EQ(run.exit_code(), 0) << run.describe();
  EXPECT_EQ(run.out.find('\r'), std::string::npos) << run.out;
  int progress_lines = 0;
  for (const std::string& line : lines_of(run.out)) {
    if (line.rfind("epoch 1/1 step ", 0) == 0) ++progress_lines;
  }
  EXPECT_EQ(progress_lines, 4) << run.out;  // 256 samples in batches of 64

  std::vector<std::string> quiet = quick;
  quiet.push_back("--quiet");
  const example_test::ProcessResult silent = example_test::run_process(quiet);
  ASSERT_EQ(silent.exit_code(), 0) << silent.describe();
  EXPECT_EQ(silent.out.find(" step "), std::string::npos) << silent.out;
  EXPECT_NE(silent.out.find("test accuracy"), std::string::npos) << silent.out;
}

}  // namespace
