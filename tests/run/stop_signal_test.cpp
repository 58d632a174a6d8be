// run::StopSignal (Note [agreeing on the stop step]): the ranks of a job stop after the same step, at most two
// steps after the one in which any rank got the signal, with no collective of their own; one process stops at the
// next boundary; the signal's names; --requeue outside Slurm, with scontrol failing, and scontrol signalled by the
// cancellation its requeue causes.
#include <run/stop_signal.h>

#include <signal.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ddp/launch/spawn.h>
#include <ddp/process_group.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

TEST(StopSignalTest, TakesTheNamesOfTheStopSignals) {
  EXPECT_EQ(run::parse_stop_signal("TERM"), SIGTERM);
  EXPECT_EQ(run::parse_stop_signal("sigusr1"), SIGUSR1);
  EXPECT_EQ(run::parse_stop_signal("USR2"), SIGUSR2);
  EXPECT_EQ(run::parse_stop_signal(std::to_string(SIGINT)), SIGINT);
  EXPECT_EQ(run::stop_signal_name(SIGUSR1), "SIGUSR1");
  try {
    run::parse_stop_signal("KILL");
    ADD_FAILURE() << "SIGKILL cannot be caught: it is no stop signal";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "--stop-signal 'KILL' is not a stop signal: use TERM, INT, HUP, QUIT, USR1 or USR2");
  }
}

TEST(StopSignalTest, OneProcessStopsAtTheNextBoundaryAndASecondSignalIsNoted) {
  struct sigaction before {};
  ::sigaction(SIGUSR2, nullptr, &before);
  {
    run::StopSignal stop(SIGUSR2);
    EXPECT_FALSE(stop.stop_after(0));
    EXPECT_FALSE(stop.stop_after(1));
    ::raise(SIGUSR2);  // the process lives on: the handler records it
    EXPECT_TRUE(stop.received());
    ::raise(SIGUSR2);  // a second one, as during the save
    EXPECT_TRUE(stop.stop_after(2));
    ASSERT_TRUE(stop.decision().has_value());
    EXPECT_EQ(stop.decision()->step, 2);
    EXPECT_EQ(stop.describe(), "SIGUSR2 (rank 0 got it in step 2): every rank stopped after step 2");
    EXPECT_THROW(run::StopSignal another(SIGTERM), std::logic_error);
  }
  struct sigaction after {};
  ::sigaction(SIGUSR2, nullptr, &after);
  // The process is on its way out after its stop: a repeated signal must not kill it in its teardown.
  EXPECT_EQ(after.sa_handler, SIG_IGN) << "after the signal came, it stays ignored";
  ::sigaction(SIGUSR2, &before, nullptr);
}

TEST(StopSignalTest, WithoutTheSignalThePreviousHandlerComesBack) {
  struct sigaction before {};
  ::sigaction(SIGUSR2, nullptr, &before);
  {
    run::StopSignal stop(SIGUSR2);
    EXPECT_FALSE(stop.stop_after(1));
  }
  struct sigaction after {};
  ::sigaction(SIGUSR2, nullptr, &after);
  EXPECT_EQ(after.sa_handler, before.sa_handler);
}

TEST(StopSignalTest, RequeueOutsideSlurmIsOneLine) {
  const char* job = std::getenv("SLURM_JOB_ID");
  if (job != nullptr) GTEST_SKIP() << "runs inside a Slurm job (SLURM_JOB_ID=" << job << ")";
  try {
    run::requeue_slurm_job();
    ADD_FAILURE() << "requeued outside Slurm";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "--requeue: SLURM_JOB_ID is not set: this is not a Slurm job");
  }
}

/// Puts an executable `scontrol` (a shell script with `body`) first on PATH for one scope, with SLURM_JOB_ID set.
class ScontrolOnPath {
 public:
  explicit ScontrolOnPath(const std::string& body)
      : env_({"PATH", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"}) {
    {
      std::ofstream script(dir_.file("scontrol"));
      script << "#!/bin/sh\n" << body << "\n";
    }
    EXPECT_EQ(::chmod(dir_.file("scontrol").c_str(), 0755), 0);
    const char* path = std::getenv("PATH");
    ::setenv("PATH", (dir_.path() + ":" + (path != nullptr ? path : "/usr/bin:/bin")).c_str(), 1);
    ::setenv("SLURM_JOB_ID", "42", 1);
    ::unsetenv("SLURM_ARRAY_JOB_ID");
    ::unsetenv("SLURM_ARRAY_TASK_ID");
  }
  std::string file(const std::string& name) const { return dir_.file(name); }

 private:
  ddp_test::ScratchDir dir_;
  ddp_test::EnvGuard env_;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Note [scontrol outlives the requeue it asks for]: Slurm cancels the job it requeues and signals every process of
// the step, scontrol included, maybe before scontrol is done. The stand-in signals itself the way slurmstepd does;
// the real one is in tests/cluster/slurm_two_hosts_test.sh, where a loaded CI machine lost this race.
TEST(StopSignalTest, RequeueSurvivesTheSignalsOfTheCancellationItCauses) {
  ScontrolOnPath scontrol(
      "echo \"$@\" > \"$(dirname \"$0\")/args\"; kill -CONT $$; kill -TERM $$; kill -USR1 $$; exit 0");
  EXPECT_NO_THROW(run::requeue_slurm_job());
  EXPECT_EQ(read_file(scontrol.file("args")), "requeue 42\n");
  ::setenv("SLURM_ARRAY_JOB_ID", "7", 1);
  ::setenv("SLURM_ARRAY_TASK_ID", "3", 1);
  EXPECT_NO_THROW(run::requeue_slurm_job());
  EXPECT_EQ(read_file(scontrol.file("args")), "requeue 7_3\n") << "an array job's task is <job>_<task>";
}

TEST(StopSignalTest, AFailedRequeueIsOneLineWithScontrolsLastLine) {
  ScontrolOnPath scontrol(
      "echo 'scontrol: debug line' >&2; echo 'slurm_requeue error: Invalid job id specified' >&2; "
      "exit 1");
  try {
    run::requeue_slurm_job();
    ADD_FAILURE() << "a failing scontrol requeued";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(),
                 "--requeue: scontrol requeue 42 failed (exit code 1): slurm_requeue error: Invalid job id "
                 "specified");
  }
  ScontrolOnPath killed("kill -KILL $$");
  try {
    run::requeue_slurm_job();
    ADD_FAILURE() << "a killed scontrol requeued";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "--requeue: scontrol requeue 42 failed (killed by signal 9)");
  }
}

/// Each rank of a spawned job trains `steps` steps, each with an allreduce; rank r raises the signal in step
/// signal_steps[r] (0: never; -1: before the first boundary, as during the start), in the middle of the step (before
/// its collective), after a random pause so that the ranks reach their boundaries in varied order. Returns the step
/// each rank stopped after (0: ran to the end).
std::vector<int64_t> stop_steps(int world, const std::vector<int64_t>& signal_steps, int64_t steps, uint64_t seed) {
  ddp_test::ScratchDir dir;
  const std::string folder = dir.path();
  ddp::spawn(world, [&](int rank, int) {
    run::StopSignal stop(SIGUSR1);
    ddp::ProcessGroup group = ddp::init_process_group(ddp::InitOptions().backend("gloo"));
    stop.join(group);
    std::mt19937_64 random(seed + static_cast<uint64_t>(rank));
    if (signal_steps[static_cast<size_t>(rank)] == -1) ::raise(SIGUSR1);
    int64_t stopped = 0;
    if (!stop.stop_after(0)) {
      for (int64_t step = 1; step <= steps; ++step) {
        std::this_thread::sleep_for(std::chrono::microseconds(random() % 3000));
        if (step == signal_steps[static_cast<size_t>(rank)]) ::raise(SIGUSR1);
        torch::Tensor t = torch::ones({4});
        group.allreduce_sum_(t, "the step");
        if (stop.stop_after(step)) {
          stopped = step;
          break;
        }
      }
    }
    std::ofstream(folder + "/rank" + std::to_string(rank)) << stopped;
  });
  std::vector<int64_t> result;
  for (int r = 0; r < world; ++r) {
    int64_t stopped = -1;
    std::ifstream(folder + "/rank" + std::to_string(r)) >> stopped;
    result.push_back(stopped);
  }
  return result;
}

TEST(StopSignalTest, TheRanksStopAfterTheSameStepTwoStepsAfterTheSignal) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  std::mt19937_64 draw(seed);
  for (int trial = 0; trial < 6; ++trial) {
    const int world = trial % 2 == 0 ? 2 : 3;
    std::vector<int64_t> signal_steps(static_cast<size_t>(world), 0);
    const int victim = static_cast<int>(draw() % static_cast<uint64_t>(world));
    const int64_t at = 1 + static_cast<int64_t>(draw() % 8);
    signal_steps[static_cast<size_t>(victim)] = at;
    if (trial >= 4) {  // every rank gets it, each in its own step (as Slurm signals every task)
      for (auto& s : signal_steps) s = 1 + static_cast<int64_t>(draw() % 8);
    }
    int64_t first = 1000;
    for (const int64_t s : signal_steps) first = s > 0 ? std::min(first, s) : first;
    const std::vector<int64_t> stopped = stop_steps(world, signal_steps, 40, seed + static_cast<uint64_t>(trial));
    const std::string what = "seed " + std::to_string(seed) + ", trial " + std::to_string(trial) +
                             ", first signal in step " + std::to_string(first);
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(stopped[static_cast<size_t>(r)], stopped[0]) << "rank " << r << " disagrees; " << what;
    }
    // The first signal's rank wrote its step, s, at the boundary after it (any later one finds it there: it won
    // compareSet); every rank reads it after step s + 1 and stops at the next boundary.
    EXPECT_EQ(stopped[0], first + 2) << what;
  }
}

TEST(StopSignalTest, ASignalBeforeTheFirstStepStopsEveryRankAfterTheSecond) {
  LTA_REQUIRE_GLOO();
  EXPECT_EQ(stop_steps(2, {0, -1}, 20, 3), (std::vector<int64_t>{2, 2}));
}

TEST(StopSignalTest, WatchesEachOfSeveralSignalsAndNamesTheOneThatCame) {
  EXPECT_EQ(run::parse_stop_signals("USR1,term,USR1"), (std::vector<int>{SIGUSR1, SIGTERM}));
  struct sigaction before_usr1 {
  }, before_term{};
  ::sigaction(SIGUSR1, nullptr, &before_usr1);
  ::sigaction(SIGTERM, nullptr, &before_term);
  {
    run::StopSignal stop({SIGUSR1, SIGTERM});
    EXPECT_FALSE(stop.stop_after(0));
    ::raise(SIGTERM);  // Slurm's at the time limit: the process lives on
    EXPECT_TRUE(stop.stop_after(1));
    EXPECT_EQ(stop.signal(), SIGTERM);
    EXPECT_EQ(stop.describe(), "SIGTERM (rank 0 got it in step 1): every rank stopped after step 1");
  }
  ::sigaction(SIGUSR1, &before_usr1, nullptr);
  ::sigaction(SIGTERM, &before_term, nullptr);
}

TEST(StopSignalTest, WithoutASignalTheRanksRunToTheEnd) {
  LTA_REQUIRE_GLOO();
  EXPECT_EQ(stop_steps(2, {0, 0}, 20, 7), (std::vector<int64_t>{0, 0}));
}

}  // namespace
