// The examples' progress output, their stdout a pipe (run::Progress itself: tests/run/progress_test.cpp).
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>
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

// What a log needs reaches it at once (issue 39): an example whose stdout is a file (a log, a cluster's output file)
// has its header and each "saved ..." line in the file while it runs, not at the next progress tick or at exit, and a
// SIGTERM loses none of them. `launcher` non-empty: the example runs under it with 2 processes, their stdout a pipe to
// the launcher, and the launcher is the one terminated.
void expect_log_lines_reach_the_file_at_once(const std::vector<std::string>& launcher, const char* example,
                                             const std::string& saved_line) {
  example_test::Scratch scratch;
  const std::string log = scratch.file("run.log");
  const std::string dir = scratch.file("checkpoints");
  const auto checkpoint = [&](int step) { return dir + "/step-" + fmt::format("{:012d}", step) + ".pt"; };
  // The shell's only part is the redirection: exec replaces it, so the pid below is the program's (or launcher's).
  std::vector<std::string> argv = {"/bin/sh", "-c", "exec \"$0\" \"$@\" >" + log};
  argv.insert(argv.end(), launcher.begin(), launcher.end());
  argv.insert(argv.end(),
              {example, "--synthetic", "--limit-train", "4096", "--batch-size", "32", "--epochs", "20", "--device",
               "cpu", "--checkpoint-dir", dir, "--save-every", "2", "--keep-last", "1000", "--progress-every", "1000"});
  std::string mid_run;  // the log when the step-4 checkpoint appeared: the step-2 save's line must be in it
  bool terminated = false;
  const example_test::ProcessResult run = example_test::run_process(argv, {}, RLIM_INFINITY, 120, [&](pid_t pid) {
    struct stat info {};
    if (terminated || ::stat(checkpoint(4).c_str(), &info) != 0) return;
    mid_run = example_test::read_file(log);
    terminated = ::kill(pid, SIGTERM) == 0;
  });
  ASSERT_TRUE(terminated) << run.describe();
  EXPECT_NE(mid_run.find("training samples"), std::string::npos) << "the header, mid-run:\n" << mid_run;
  EXPECT_NE(mid_run.find(saved_line + checkpoint(2) + "\n"), std::string::npos) << "the step-2 save's line, mid-run:\n"
                                                                                << mid_run;
  // After the SIGTERM: a line for every save but the newest (killed between its rename and its line, maybe).
  const std::string after = example_test::read_file(log);
  const std::vector<std::string> saved = example_test::folder_entries(dir);
  ASSERT_GE(saved.size(), 2u) << after;
  for (size_t i = 0; i + 1 < saved.size(); ++i) {
    EXPECT_NE(after.find(saved_line + dir + "/" + saved[i] + "\n"), std::string::npos) << saved[i] << ":\n" << after;
  }
}

TEST(LogLinesTest, AProgramWritingToAFileHasEveryLineThereAtOnceAndAfterSigterm) {
  expect_log_lines_reach_the_file_at_once({}, LTA_EXAMPLE_TRAIN_FASHION_MNIST,
                                          "saved model, optimizer and training position to ");
}

#ifdef LTA_DDP_LAUNCH
TEST(LogLinesTest, WorkersUnderTheLauncherLoseNoLineToItsSigterm) {
  expect_log_lines_reach_the_file_at_once({LTA_DDP_LAUNCH, "--nproc-per-node", "2", "--master-port", "0"},
                                          LTA_EXAMPLE_DDP_LAUNCH, "saved model, optimizer and training position to ");
}

// amp's overflow lines: the ranks' gradients are allreduced, so they overflow alike and rank 0 reports for all; before,
// each rank printed each line. With stdout and stderr in one file (2>&1, as a cluster's output file), the lines come
// in the order they were printed: the header, then the overflows of the steps after it, then the epoch's result.
TEST(LogLinesTest, AnOverflowEveryRankSeesIsReportedOnceAndInItsPlace) {
  const example_test::ProcessResult run = example_test::run_process({"/bin/sh",
                                                                     "-c",
                                                                     "exec \"$0\" \"$@\" 2>&1",
                                                                     LTA_DDP_LAUNCH,
                                                                     "--nproc-per-node",
                                                                     "2",
                                                                     "--master-port",
                                                                     "0",
                                                                     LTA_EXAMPLE_AMP_DDP,
                                                                     "--synthetic",
                                                                     "--limit-train",
                                                                     "512",
                                                                     "--batch-size",
                                                                     "64",
                                                                     "--device",
                                                                     "cpu",
                                                                     "--dtype",
                                                                     "fp16",
                                                                     "--opt-level",
                                                                     "O2",
                                                                     "--quiet"});
  ASSERT_EQ(run.exit_code(), 0) << run.describe();
  const std::vector<std::string> lines = lines_of(run.out);
  std::vector<std::string> overflows;
  size_t header = lines.size(), first_overflow = lines.size(), result = lines.size();
  for (size_t i = 0; i < lines.size(); ++i) {
    if (lines[i].find(" training samples, ") != std::string::npos) header = std::min(header, i);
    if (lines[i].rfind("epoch 1/1: mean loss ", 0) == 0) result = std::min(result, i);
    if (lines[i].rfind("amp: gradient overflow at step ", 0) != 0) continue;
    overflows.push_back(lines[i]);
    first_overflow = std::min(first_overflow, i);
  }
  ASSERT_FALSE(overflows.empty()) << "fp16 from a loss scale of 65536 overflows in its first steps\n" << run.out;
  std::vector<std::string> unique = overflows;
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  EXPECT_EQ(unique.size(), overflows.size()) << "each overflow once:\n" << run.out;
  EXPECT_LT(header, first_overflow) << run.out;
  EXPECT_LT(first_overflow, result) << run.out;
}
#endif

}  // namespace
