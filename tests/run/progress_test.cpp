// run::Progress: the progress output fits where it goes (issue 24, item 1): one rewritten line on a terminal, plain
// lines at an interval in a log or a pipe (never a carriage return), nothing with --quiet. The clock is the test's own.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <run/progress.h>
#include "python_free_examples/example_process.h"  // lines_of

namespace {

using run::Progress;
using run::ProgressStyle;
using std::chrono::seconds;

/// What a Progress wrote to a temporary file.
class Captured {
 public:
  Captured() : file_(std::tmpfile()) {}
  ~Captured() { std::fclose(file_); }
  Captured(const Captured&) = delete;
  Captured& operator=(const Captured&) = delete;
  std::FILE* file() const { return file_; }
  std::string text() const {
    std::fflush(file_);
    std::string all;
    std::rewind(file_);
    char buffer[4096];
    size_t n = 0;
    while ((n = std::fread(buffer, 1, sizeof buffer, file_)) > 0) all.append(buffer, n);
    return all;
  }

 private:
  std::FILE* file_;
};

using example_test::lines_of;

/// An epoch of `steps` one-second steps from `first` on, each shown with `last` false.
void run_epoch(Progress& progress, int64_t steps, int64_t first = 0) {
  const Progress::Clock::time_point t0{};
  progress.begin_epoch(1, 2, steps, first, t0);
  for (int64_t done = first + 1; done <= steps; ++done) {
    progress.step_done(done, 2.0 / static_cast<double>(done), 100.0, t0 + seconds(done - first), false);
  }
  progress.end_epoch();
}

TEST(ProgressTest, InALogALineEveryIntervalAndAtTheEpochsEndWithNoCarriageReturn) {
  Captured out;
  Progress progress(ProgressStyle::kLines, 10.0, out.file());
  run_epoch(progress, 25);
  const std::string text = out.text();
  EXPECT_EQ(text.find('\r'), std::string::npos) << text;
  // Steps end at 1 s, 2 s, ...: due at 10 s and 20 s, and the epoch's last step.
  EXPECT_EQ(lines_of(text), (std::vector<std::string>{
                                "epoch 1/2 step 10/25 mean loss 0.2000 | 100 samples/s | ETA 0:15",
                                "epoch 1/2 step 20/25 mean loss 0.1000 | 100 samples/s | ETA 0:05",
                                "epoch 1/2 step 25/25 mean loss 0.0800 | 100 samples/s | ETA 0:00",
                            }));
}

TEST(ProgressTest, IntervalZeroIsEveryStepAndAStoppedLoopShowsWhereItStopped) {
  Captured every;
  Progress each_step(ProgressStyle::kLines, 0.0, every.file());
  run_epoch(each_step, 4);
  EXPECT_EQ(lines_of(every.text()).size(), 4U) << every.text();

  Captured stopped;
  Progress progress(ProgressStyle::kLines, 10.0, stopped.file());
  const Progress::Clock::time_point t0{};
  progress.begin_epoch(3, 3, 100, 0, t0);
  progress.step_done(1, 1.0, 50.0, t0 + seconds(1), false);  // not due
  progress.step_done(2, 1.0, 50.0, t0 + seconds(2), true);   // the loop stops here (--stop-after-steps)
  progress.end_epoch();
  EXPECT_EQ(stopped.text(), "epoch 3/3 step 2/100 mean loss 1.0000 | 50 samples/s | ETA 1:38\n");
}

TEST(ProgressTest, TheEtaOfAResumedEpochCountsOnlyTheStepsThisRunTimed) {
  Captured out;
  Progress progress(ProgressStyle::kLines, 0.0, out.file());
  const Progress::Clock::time_point t0{};
  progress.begin_epoch(1, 1, 4000, 1000, t0);                    // resumed at step 1000 of 4000
  progress.step_done(1010, 0.5, 10.0, t0 + seconds(20), false);  // 10 steps in 20 s: 2 s a step, 2990 to go
  EXPECT_EQ(out.text(), "epoch 1/1 step 1010/4000 mean loss 0.5000 | 10 samples/s | ETA 1:39:40\n");
}

TEST(ProgressTest, OnATerminalOneLineRewritesItselfAndEndsWithANewline) {
  Captured out;
  Progress progress(ProgressStyle::kTerminal, 10.0, out.file());
  run_epoch(progress, 3);
  const std::string text = out.text();
  // The first step is drawn at once, each later one after the 0.2 s redraw interval (1 s apart here).
  EXPECT_EQ(text,
            "\repoch 1/2 [##########....................] 1/3 mean loss 2.0000 | 100 samples/s | ETA 0:02"
            "\repoch 1/2 [####################..........] 2/3 mean loss 1.0000 | 100 samples/s | ETA 0:01"
            "\repoch 1/2 [##############################] 3/3 mean loss 0.6667 | 100 samples/s | ETA 0:00\n");
}

TEST(ProgressTest, OnATerminalAShorterLineErasesTheLongerOneAndASaveGetsItsOwnLine) {
  Captured out;
  Progress progress(ProgressStyle::kTerminal, 10.0, out.file());
  const Progress::Clock::time_point t0{};
  progress.begin_epoch(1, 1, 2, 0, t0);
  progress.step_done(1, 1.0, 12345.0, t0 + seconds(1), false);
  progress.interrupt();  // a save's line comes next
  progress.interrupt();  // nothing open: nothing more
  progress.step_done(2, 1.0, 5.0, t0 + seconds(2), false);
  progress.end_epoch();
  const std::string text = out.text();
  const std::string first =
      "epoch 1/1 [###############...............] 1/2 mean loss 1.0000 | 12345 samples/s | ETA 0:01";
  const std::string second = "epoch 1/1 [##############################] 2/2 mean loss 1.0000 | 5 samples/s | ETA 0:00";
  EXPECT_EQ(text, "\r" + first + "\n\r" + second + "\n");

  Captured rewritten;
  Progress terminal(ProgressStyle::kTerminal, 10.0, rewritten.file());
  terminal.begin_epoch(1, 1, 2, 0, t0);
  terminal.step_done(1, 1.0, 12345.0, t0 + seconds(1), false);
  terminal.step_done(2, 1.0, 5.0, t0 + seconds(2), false);
  terminal.end_epoch();
  EXPECT_EQ(rewritten.text(), "\r" + first + "\r" + second + std::string(first.size() - second.size(), ' ') + "\n");
}

TEST(ProgressTest, QuietShowsNothingAndTheStyleFollowsTheDestination) {
  Captured out;
  Progress progress(ProgressStyle::kQuiet, 0.0, out.file());
  run_epoch(progress, 5);
  progress.interrupt();
  EXPECT_EQ(out.text(), "");
  EXPECT_EQ(run::progress_style(true, out.file()), ProgressStyle::kQuiet);
  EXPECT_EQ(run::progress_style(false, out.file()), ProgressStyle::kLines);  // a file is not a terminal
}

}  // namespace
