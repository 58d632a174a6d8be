// ddp-launch's hang detection, the launcher's half (HealthWatch): progress records written here by hand, as a
// worker's library writes them (Note [progress records]), and read at chosen times: no processes, no sleeps.
#include <ddp/launch/health_watch.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include <ddp/launch/progress_record.h>
#include <gtest/gtest.h>

#include "ddp/ddp_test_util.h"

namespace {

using ddp::detail::HealthWatch;
using ddp::detail::ProgressRecord;
using Clock = HealthWatch::Clock;
using std::chrono::milliseconds;

/// A worker's side of one progress file: writes records as ddp/progress.cpp does, with the times the test chooses.
class FakeWorker {
 public:
  explicit FakeWorker(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDWR);
    EXPECT_GE(fd, 0) << path;
    void* memory = ::mmap(nullptr, sizeof(ProgressRecord), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    EXPECT_NE(memory, MAP_FAILED);
    r_ = static_cast<ProgressRecord*>(memory);
    r_->magic.store(ProgressRecord::kMagic);
  }
  ~FakeWorker() { ::munmap(r_, sizeof(ProgressRecord)); }

  /// One event at `at`: a step begun, a collective entered or left, a pause begun or ended.
  void event(Clock::time_point at, const char* where, int steps_added = 0, int in_collective = -1, int pause = 0) {
    r_->sequence.fetch_add(1);
    r_->steps.fetch_add(steps_added);
    if (in_collective >= 0) r_->in_collective.store(in_collective);
    r_->paused.fetch_add(pause);
    r_->at_ns.store(std::chrono::duration_cast<std::chrono::nanoseconds>(at.time_since_epoch()).count());
    std::strncpy(r_->where, where, sizeof(r_->where) - 1);
    r_->sequence.fetch_add(1);
  }
  void step(Clock::time_point at) { event(at, "the forward of a training step", 1); }
  /// Stopped in the middle of a write: the sequence stays odd.
  void stop_mid_write() { r_->sequence.fetch_add(1); }

 private:
  ProgressRecord* r_ = nullptr;
};

const Clock::time_point t0 = Clock::now();
Clock::time_point at(int ms) { return t0 + milliseconds(ms); }

TEST(HealthWatchTest, TheFirstStepIsNotTimedThenTheOldestStuckWorkerIsNamedWithWhereItWas) {
  ddp_test::ScratchDir dir;
  HealthWatch watch(dir.path(), 0, {4, 5}, milliseconds(1000));
  FakeWorker w0(watch.file(0)), w1(watch.file(1));
  w0.step(at(0));
  w1.step(at(0));
  EXPECT_FALSE(watch.check(at(60000))) << "a first step of a minute is not a hang";
  w0.step(at(60000));
  w1.step(at(60000));
  w1.event(at(60100), "allreduce of gradient bucket 2 of 3", 0, 1);
  w1.event(at(60200), "allreduce of gradient bucket 2 of 3", 0, 0);  // done; then rank 5 stops
  w0.event(at(60300), "allreduce of gradient bucket 0 of 3", 0, 1);  // rank 4 waits for it
  EXPECT_FALSE(watch.check(at(61100)));
  const auto hang = watch.check(at(61300));
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(hang->local_rank, 1);
  EXPECT_EQ(hang->message,
            "made no progress for 1.1 s (--hang-timeout-s 1); last seen after allreduce of gradient bucket 2 of 3 in "
            "training step 2");
}

TEST(HealthWatchTest, AWorkerWaitingInACollectiveIsSaidToWait) {
  ddp_test::ScratchDir dir;
  HealthWatch watch(dir.path(), 0, {0}, milliseconds(500));
  FakeWorker w(watch.file(0));
  w.step(at(0));
  w.step(at(10));
  w.event(at(20), "barrier", 0, 1);
  const auto hang = watch.check(at(600));
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(hang->message,
            "made no progress for 0.58 s (--hang-timeout-s 0.5); last seen waiting for barrier in training step 2");
}

TEST(HealthWatchTest, APausedWorkerHoldsEveryWorkerOfTheNodeUntilThePauseEnds) {
  ddp_test::ScratchDir dir;
  HealthWatch watch(dir.path(), 0, {0, 1}, milliseconds(1000));
  FakeWorker w0(watch.file(0)), w1(watch.file(1));
  for (const int t : {0, 10}) {
    w0.step(at(t));
    w1.step(at(t));
  }
  w0.event(at(100), "a long evaluation", 0, -1, +1);  // rank 0 evaluates alone
  w1.event(at(100), "allreduce of gradient bucket 0 of 1", 0, 1);
  for (int t = 500; t <= 30000; t += 500) EXPECT_FALSE(watch.check(at(t))) << t << " ms";
  w0.event(at(30100), "a long evaluation", 0, -1, -1);  // done: the clocks start again
  EXPECT_FALSE(watch.check(at(30500))) << "rank 1 waited for the pause, it did not hang";
  const auto hang = watch.check(at(31200));  // neither made progress since
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(hang->local_rank, 1);
}

TEST(HealthWatchTest, AWorkerStoppedInTheMiddleOfAWriteStillHangs) {
  ddp_test::ScratchDir dir;
  HealthWatch watch(dir.path(), 0, {0}, milliseconds(1000));
  FakeWorker w(watch.file(0));
  w.step(at(0));
  w.step(at(10));
  EXPECT_FALSE(watch.check(at(20)));
  w.stop_mid_write();
  const auto hang = watch.check(at(1100));
  ASSERT_TRUE(hang.has_value());
  EXPECT_NE(hang->message.find("in training step 2"), std::string::npos) << hang->message;
}

TEST(HealthWatchTest, AWorkerThatNeverReportsIsNeverWatched) {
  ddp_test::ScratchDir dir;
  HealthWatch watch(dir.path(), 0, {0}, milliseconds(1));
  EXPECT_FALSE(watch.check(at(1000000)));  // a program without DistributedDataParallel
  EXPECT_FALSE(watch.file(0).empty());
}

}  // namespace
