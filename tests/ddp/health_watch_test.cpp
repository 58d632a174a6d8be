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

const std::vector<bool> kBothRun = {true, true};

/// Two workers that began two training steps (watched from then on), at 0 and 10 ms.
void two_steps(FakeWorker& a, FakeWorker& b) {
  for (const int t : {0, 10}) {
    a.step(at(t));
    b.step(at(t));
  }
}

TEST(HealthWatchTest, TheFirstStepIsNotTimedThenTheRankTheOthersWaitForIsNamed) {
  ddp_test::ScratchDir dir;
  HealthWatch watch(dir.path(), 0, {4, 5}, milliseconds(1000));
  FakeWorker w0(watch.file(0)), w1(watch.file(1));
  w0.step(at(0));
  w1.step(at(0));
  w0.event(at(10), "broadcast", 0, 1);  // waits a minute in its first step (rank 5 sets up slowly): not timed
  EXPECT_FALSE(watch.check(at(60000), kBothRun));
  w0.step(at(60000));
  w1.step(at(60000));
  w1.event(at(60100), "allreduce of gradient bucket 2 of 3", 0, 1);
  w1.event(at(60200), "allreduce of gradient bucket 2 of 3", 0, 0);  // done; then rank 5 stops
  w0.event(at(60300), "allreduce of gradient bucket 0 of 3", 0, 1);  // rank 4 waits for it
  EXPECT_FALSE(watch.check(at(61200), kBothRun));
  const auto hang = watch.check(at(61300), kBothRun);
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(hang->local_rank, 1);
  EXPECT_EQ(hang->message,
            "made no progress for 1.1 s (--hang-timeout-s 1) while rank 4 waited for it; last seen after allreduce of "
            "gradient bucket 2 of 3 in training step 2");
  EXPECT_EQ(hang->last_progress, at(60200));
}

TEST(HealthWatchTest, LongWorkWithoutCollectivesIsNeverAHang) {
  ddp_test::ScratchDir dir;
  HealthWatch watch(dir.path(), 0, {0, 1}, milliseconds(1000));
  FakeWorker w0(watch.file(0)), w1(watch.file(1));
  two_steps(w0, w1);
  w0.event(at(20), "allreduce of gradient bucket 0 of 1", 0, 0);  // an evaluation on every rank, an export
  w1.event(at(20), "allreduce of gradient bucket 0 of 1", 0, 0);
  EXPECT_FALSE(watch.check(at(3600000), kBothRun));
}

TEST(HealthWatchTest, WhenEveryRankWaitsTheOldestIsNamedAsWaiting) {
  ddp_test::ScratchDir dir;  // (the rank they wait for is on another node)
  HealthWatch watch(dir.path(), 0, {0, 1}, milliseconds(500));
  FakeWorker w0(watch.file(0)), w1(watch.file(1));
  two_steps(w0, w1);
  w0.event(at(30), "barrier", 0, 1);
  w1.event(at(20), "barrier", 0, 1);
  const auto hang = watch.check(at(600), kBothRun);
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(hang->local_rank, 1);
  EXPECT_EQ(hang->message,
            "made no progress for 0.58 s (--hang-timeout-s 0.5) while rank 0 waited for it; last seen waiting for "
            "barrier in training step 2");
}

TEST(HealthWatchTest, APausedWorkerHoldsTheOthersWaitsUntilThePauseEnds) {
  ddp_test::ScratchDir dir;
  HealthWatch watch(dir.path(), 0, {0, 1}, milliseconds(1000));
  FakeWorker w0(watch.file(0)), w1(watch.file(1));
  two_steps(w0, w1);
  w0.event(at(100), "a long evaluation", 0, -1, +1);  // rank 0 evaluates alone, rank 1 waits for it
  w1.event(at(100), "allreduce of gradient bucket 0 of 1", 0, 1);
  for (int t = 500; t <= 4500; t += 500) EXPECT_FALSE(watch.check(at(t), kBothRun)) << t << " ms";
  w0.event(at(4600), "a long evaluation", 0, -1, -1);  // done: the waits are timed again from here
  EXPECT_FALSE(watch.check(at(5000), kBothRun)) << "rank 1 waited for the pause, it did not hang";
  const auto hang = watch.check(at(5600), kBothRun);  // and then rank 0 stopped
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(hang->local_rank, 0);
}

TEST(HealthWatchTest, APauseLongerThanItsLimitIsAHangOfThePausedWorker) {
  ddp_test::ScratchDir dir;
  HealthWatch watch(dir.path(), 0, {0, 1}, milliseconds(1000));
  FakeWorker w0(watch.file(0)), w1(watch.file(1));
  two_steps(w0, w1);
  w0.event(at(100), "a checkpoint save", 0, -1, +1);  // a save to a mount that stopped answering
  w1.event(at(100), "allreduce of gradient bucket 0 of 1", 0, 1);
  EXPECT_FALSE(watch.check(at(5000), kBothRun));
  const auto hang = watch.check(at(5200), kBothRun);
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(hang->local_rank, 0);
  EXPECT_EQ(hang->message,
            "stayed in a checkpoint save for 5.1 s (5 x --hang-timeout-s 1); last seen in a checkpoint save in "
            "training step 2");
}

TEST(HealthWatchTest, AWorkerStoppedInTheMiddleOfAWriteIsStillNamed) {
  ddp_test::ScratchDir dir;
  HealthWatch watch(dir.path(), 0, {0, 1}, milliseconds(1000));
  FakeWorker w0(watch.file(0)), w1(watch.file(1));
  two_steps(w0, w1);
  w1.event(at(20), "allreduce of gradient bucket 0 of 1", 0, 0);
  EXPECT_FALSE(watch.check(at(25), kBothRun));
  w1.stop_mid_write();
  w0.event(at(30), "allreduce of gradient bucket 0 of 1", 0, 1);
  const auto hang = watch.check(at(1100), kBothRun);
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(hang->local_rank, 1);
  EXPECT_NE(hang->message.find("last seen after allreduce of gradient bucket 0 of 1 in training step 2"),
            std::string::npos)
      << hang->message;
}

TEST(HealthWatchTest, AWorkerThatEndedIsNotWatched) {
  ddp_test::ScratchDir dir;
  HealthWatch watch(dir.path(), 0, {0, 1}, milliseconds(1000));
  FakeWorker w0(watch.file(0)), w1(watch.file(1));
  two_steps(w0, w1);
  w1.event(at(20), "the forward of a training step");  // then it exited (0, or failed: the group reports that)
  w0.event(at(30), "allreduce of gradient bucket 0 of 1", 0, 1);
  const auto hang = watch.check(at(1100), {true, false});
  ASSERT_TRUE(hang.has_value());
  EXPECT_EQ(hang->local_rank, 0) << "an ended worker cannot be the one that hangs";
}

TEST(HealthWatchTest, AWorkerThatNeverReportsIsNeverWatched) {
  ddp_test::ScratchDir dir;
  HealthWatch watch(dir.path(), 0, {0}, milliseconds(1));
  EXPECT_FALSE(watch.check(at(1000000), {true}));  // a program without DistributedDataParallel
  EXPECT_FALSE(watch.file(0).empty());
}

}  // namespace
