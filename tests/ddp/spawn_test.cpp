#include <ddp/launch/spawn.h>

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <stdexcept>
#include <thread>

#include <ddp/launch/launch_env.h>
#include <gtest/gtest.h>

#include "ddp/ddp_test_util.h"

namespace {

using ddp_test::contains_all;
using ddp_test::error_of;

TEST(SpawnTest, EveryWorkerGetsTheEnvironmentContract) {
  ddp_test::ScratchDir dir;
  ddp::spawn(3, [&](int local_rank, int nprocs) {
    const ddp::LaunchEnv env = ddp::launch_env_from_environment();
    std::ofstream(dir.file("rank" + std::to_string(local_rank)))
        << env.rank << " " << env.world_size << " " << env.local_rank << " " << env.local_world_size << " "
        << env.master_addr << " " << nprocs;
  });
  for (int r = 0; r < 3; ++r) {
    std::ifstream in(dir.file("rank" + std::to_string(r)));
    int rank = -1, world = -1, local_rank = -1, local_world = -1, nprocs = -1;
    std::string addr;
    in >> rank >> world >> local_rank >> local_world >> addr >> nprocs;
    EXPECT_EQ(rank, r);
    EXPECT_EQ(world, 3);
    EXPECT_EQ(local_rank, r);
    EXPECT_EQ(local_world, 3);
    EXPECT_EQ(addr, "127.0.0.1");
    EXPECT_EQ(nprocs, 3);
  }
}

TEST(SpawnTest, AnExceptionInOneWorkerNamesItsRankAndStopsTheOthers) {
  const auto start = std::chrono::steady_clock::now();
  const std::string message = error_of([] {
    ddp::spawn(2, [](int local_rank, int) {
      if (local_rank == 1) throw std::runtime_error("loss became NaN at step 3");
      std::this_thread::sleep_for(std::chrono::seconds(60));  // a peer that would wait forever
    });
  });
  EXPECT_TRUE(
      contains_all(message, {"ddp::spawn: rank 1 of 2 (pid ", "exited with code 1", ": loss became NaN at step 3"}));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

// An error every rank hits alike (a bad flag, a damaged --resume each rank reads) is said once, every rank named.
TEST(SpawnTest, AnErrorEveryRankHitsAlikeIsSaidOnceNamingEveryRank) {
  const std::string message = error_of([] {
    ddp::spawn(2, [](int, int) { throw std::runtime_error("--resume 'x.pt': cannot read it as a checkpoint"); });
  });
  EXPECT_TRUE(contains_all(message, {"ddp::spawn: ranks 0, 1 of 2 (pids ", ") exited with code 1: --resume 'x.pt'"}))
      << message;
  EXPECT_EQ(message.find("cannot read"), message.rfind("cannot read")) << "said once: " << message;
}

TEST(SpawnTest, ExitCodesAndSignalsAreReported) {
  EXPECT_TRUE(contains_all(error_of([] {
                             ddp::spawn(2, [](int local_rank, int) {
                               if (local_rank == 0) ::_exit(7);
                               std::this_thread::sleep_for(std::chrono::seconds(60));
                             });
                           }),
                           {"rank 0 of 2", "exited with code 7"}));
  EXPECT_TRUE(contains_all(error_of([] {
                             ddp::spawn(2, [](int local_rank, int) {
                               if (local_rank == 1) std::raise(SIGKILL);
                               std::this_thread::sleep_for(std::chrono::seconds(60));
                             });
                           }),
                           {"rank 1 of 2", "was killed by signal 9"}));
}

TEST(SpawnTest, AWorkerIgnoringSigtermIsKilledAfterTheGrace) {
  const auto start = std::chrono::steady_clock::now();
  error_of([] {
    ddp::spawn(
        2,
        [](int local_rank, int) {
          if (local_rank == 0) ::_exit(3);
          std::signal(SIGTERM, SIG_IGN);
          std::this_thread::sleep_for(std::chrono::seconds(60));
        },
        ddp::SpawnOptions().kill_grace(std::chrono::milliseconds(300)));
  });
  // 2 s for the others to end on their own, 0.3 s of grace after SIGTERM, process start-up on a loaded machine.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST(SpawnTest, RejectsBadArguments) {
  EXPECT_TRUE(contains_all(error_of([] { ddp::spawn(0, [](int, int) {}); }), {"nprocs must be >= 1, got 0"}));
  EXPECT_TRUE(contains_all(error_of([] {
                             ddp::spawn(
                                 1, [](int, int) {}, ddp::SpawnOptions().master_port(70000));
                           }),
                           {"master_port must be in [0, 65535], got 70000"}));
}

}  // namespace
