// ddp-launch and a preempted job (docs/clusters.md, "Preemption"): the stop signals it forwards (SIGUSR1 as Slurm
// sends ahead of the time limit), workers that stop resumable (exit 75: ddp::kExitResumable) ending the job without a
// restart, one worker's resumable exit not cutting short another that is still saving, and --stop-grace-s for
// workers that do not stop.
#include <signal.h>

#include <chrono>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>

#include <ddp/launch/exit_codes.h>
#include <ddp/launch/spawn.h>
#include <gtest/gtest.h>

#include "ddp/ddp_test_util.h"
#include "ddp/launch_process.h"

namespace {

using ddp_test::Clock;
using ddp_test::kLimit;

bool ready(const ddp_test::ScratchDir& out, int workers) {
  for (int r = 0; r < workers; ++r) {
    if (!std::ifstream(out.file("ready" + std::to_string(r))).good()) return false;
  }
  return true;
}

}  // namespace

#ifdef LTA_DDP_LAUNCH

namespace {

using ddp_test::exit_code;
using ddp_test::kLaunch;
using ddp_test::kWorker;
using ddp_test::Process;

/// Waits until every worker of `launch` wrote its ready file.
void wait_ready(const Process& launch, const ddp_test::ScratchDir& out, int workers) {
  const auto deadline = Clock::now() + kLimit;
  while (!ready(out, workers) && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(ready(out, workers)) << launch.output();
}

pid_t worker_pid(const ddp_test::ScratchDir& out, int rank) {
  pid_t pid = 0;
  std::ifstream(out.file("ready" + std::to_string(rank))) >> pid;
  return pid;
}

TEST(DdpLaunchStopTest, AForwardedUsr1EndsTheJobResumableAndIsNotRestarted) {
  ddp_test::ScratchDir out;
  Process launch(kLaunch + " --nproc-per-node 2 --master-port 0 --max-restarts 2 " + kWorker +
                 " stop_on_signal --signal " + std::to_string(SIGUSR1) + " --out " + out.path());
  wait_ready(launch, out, 2);
  ::kill(launch.pid(), SIGUSR1);  // before this change: the launcher died of it, and its workers with it
  EXPECT_EQ(exit_code(launch.wait(kLimit)), ddp::kExitResumable) << launch.output();
  EXPECT_EQ(ddp_test::last_line(launch.output()),
            "ddp-launch: the workers stopped at a step boundary and saved (exit code 75: resumable); the same command "
            "continues the job")
      << launch.output();
  EXPECT_EQ(launch.output().find("restart"), std::string::npos) << "a stop is no failure: " << launch.output();
  EXPECT_TRUE(std::ifstream(out.file("saved0")).good() && std::ifstream(out.file("saved1")).good());
}

TEST(DdpLaunchStopTest, OneWorkersResumableExitDoesNotStopAnotherThatIsStillSaving) {
  ddp_test::ScratchDir out;
  // Signalled directly, as Slurm signals every process of a step: the launcher itself got nothing.
  Process launch(kLaunch + " --nproc-per-node 2 --master-port 0 --max-restarts 1 " + kWorker +
                 " stop_on_signal --save-ms 1500 --signal " + std::to_string(SIGUSR1) + " --out " + out.path());
  wait_ready(launch, out, 2);
  ::kill(worker_pid(out, 1), SIGUSR1);  // rank 1 "saves" at once and exits 75
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ::kill(worker_pid(out, 0), SIGUSR1);  // rank 0 takes 1.5 s
  EXPECT_EQ(exit_code(launch.wait(kLimit)), ddp::kExitResumable) << launch.output();
  EXPECT_TRUE(std::ifstream(out.file("saved0")).good()) << "rank 0 was stopped before its save: " << launch.output();
  EXPECT_EQ(launch.output().find("root cause"), std::string::npos) << launch.output();
  EXPECT_EQ(launch.output().find("restart"), std::string::npos) << launch.output();
}

TEST(DdpLaunchStopTest, WorkersThatOutliveTheStopGraceAreKilled) {
  ddp_test::ScratchDir out;
  Process launch(kLaunch + " --nproc-per-node 2 --master-port 0 --stop-grace-s 1 " + kWorker +
                 " stop_on_signal --ignore 1 --signal " + std::to_string(SIGTERM) + " --out " + out.path());
  wait_ready(launch, out, 2);
  const auto start = Clock::now();
  ::kill(launch.pid(), SIGTERM);
  EXPECT_EQ(exit_code(launch.wait(kLimit)), 128 + SIGTERM) << launch.output();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(20)) << launch.output();
  EXPECT_NE(launch.output().find(
                "ddp-launch: the workers did not end within --stop-grace-s 1 s of the forwarded signal: killed them"),
            std::string::npos)
      << launch.output();
}

TEST(DdpLaunchStopTest, AWorkerThatSavesWhenTheGroupStopsItAfterAFailureIsStoppedNotResumable) {
  // Rank 1 fails; rank 0 saves on the group's SIGTERM and exits 75. Before: counted as a resumable stop, so an
  // attempt that had failed could end as "stopped, resumable" instead of being restarted.
  ddp_test::ScratchDir out;
  Process launch(kLaunch + " --nproc-per-node 2 --master-port 0 --kill-grace-s 5 " + kWorker +
                 " stop_on_signal --signal " + std::to_string(SIGTERM) + " --out " + out.path());
  wait_ready(launch, out, 2);
  ::kill(worker_pid(out, 1), SIGKILL);  // rank 1 dies; the group stops rank 0 with SIGTERM, which it saves on
  EXPECT_EQ(exit_code(launch.wait(kLimit)), 128 + SIGKILL) << launch.output();
  EXPECT_NE(launch.output().find("ddp-launch: root cause: rank 1"), std::string::npos) << launch.output();
  EXPECT_NE(launch.output().find("ddp-launch: consequence: rank 0 (local rank 0, pid " +
                                 std::to_string(worker_pid(out, 0)) + ") exited with code 75"),
            std::string::npos)
      << launch.output();
  EXPECT_EQ(launch.output().find("resumable"), std::string::npos) << launch.output();
}

TEST(DdpLaunchStopTest, StopGraceMustBePositive) {
  Process launch(kLaunch + " --nproc-per-node 1 --stop-grace-s 0 " + kWorker + " sleep");
  EXPECT_EQ(exit_code(launch.wait(kLimit)), 2) << launch.output();
  EXPECT_EQ(ddp_test::last_line(launch.output()),
            "ddp-launch: --stop-grace-s must be a positive number of seconds, got 0 (run ddp-launch --help for usage)")
      << launch.output();
}

}  // namespace

#endif  // LTA_DDP_LAUNCH

namespace {

TEST(SpawnStopTest, ForwardsAStopSignalAndReportsWorkersThatStoppedResumable) {
  ddp_test::ScratchDir out;
  const std::string folder = out.path();
  std::thread signaller([&] {  // once both workers wait: SIGUSR1 to this process, the parent
    const auto deadline = Clock::now() + kLimit;
    while (!ready(out, 2) && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ::kill(::getpid(), SIGUSR1);
  });
  // (Ignored until spawn forwards it: a signal that came before would otherwise end this test's process.)
  struct sigaction ignore {
  }, previous{};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGUSR1, &ignore, &previous);
  const ddp::SpawnOutcome outcome = ddp::spawn(2, [&](int rank, int) {
    static volatile std::sig_atomic_t got = 0;
    std::signal(SIGUSR1, [](int) { got = 1; });
    std::ofstream(folder + "/ready" + std::to_string(rank)) << ::getpid();
    const auto deadline = Clock::now() + kLimit;
    while (got == 0 && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (got == 0) throw std::runtime_error("no signal came");
    throw ddp::ResumableStop("stopped on SIGUSR1");
  });
  signaller.join();
  ::sigaction(SIGUSR1, &previous, nullptr);
  EXPECT_EQ(outcome, ddp::SpawnOutcome::kStoppedResumable);
}

}  // namespace
