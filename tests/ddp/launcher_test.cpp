#include <ddp/launcher.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <ddp/worker_group.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"

// ddp-launch and its library part are built when CLI11 is present; LTA_DDP_LAUNCH says so.
#ifdef LTA_DDP_LAUNCH

namespace {

using ddp_test::contains_all;
using Clock = std::chrono::steady_clock;

ddp::ParsedLaunchArgs parse(std::vector<std::string> args) {
  args.insert(args.begin(), "ddp-launch");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return ddp::parse_launch_args(static_cast<int>(argv.size()), argv.data());
}

TEST(LaunchArgsTest, OptionsEndAtTheProgramWhoseArgumentsPassThrough) {
  const auto parsed = parse({"--nproc-per-node", "4", "--nnodes=2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                             "--master_port", "1234", "--local-rank-arg", "./train", "--nproc-per-node", "x", "-v"});
  ASSERT_TRUE(parsed.config.has_value()) << parsed.output;
  const ddp::LaunchConfig& c = *parsed.config;
  EXPECT_EQ(c.nproc_per_node, 4);
  EXPECT_EQ(c.nnodes, 2);
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.master_addr, "10.0.0.1");
  EXPECT_EQ(c.master_port, 1234);
  EXPECT_TRUE(c.local_rank_arg);
  EXPECT_EQ(c.command, (std::vector<std::string>{"./train", "--nproc-per-node", "x", "-v"}));
}

TEST(LaunchArgsTest, BadCommandLinesAreNamed) {
  const auto missing = parse({"./train"});
  EXPECT_FALSE(missing.config.has_value());
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_TRUE(contains_all(missing.output, {"--nproc-per-node"}));

  const auto node_rank = parse({"--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", "./train"});
  EXPECT_FALSE(node_rank.config.has_value());
  EXPECT_TRUE(contains_all(node_rank.output, {"--node-rank must be in [0, 2) for --nnodes 2, got 2"}));

  const auto port0 = parse({"--nproc-per-node", "1", "--nnodes", "2", "--master-port", "0", "./train"});
  EXPECT_TRUE(contains_all(port0.output, {"--master-port 0 (pick a free port) works only with --nnodes 1"}));

  const auto no_program = parse({"--nproc-per-node", "2"});
  EXPECT_TRUE(contains_all(no_program.output, {"no program given"}));

  const auto help = parse({"--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_TRUE(contains_all(help.output, {"--nproc-per-node", "--local-rank-arg"}));
}

TEST(LaunchArgsTest, WorkerEnvironmentAndCommandFollowTheTorchrunContract) {
  ddp::LaunchConfig c;
  c.nproc_per_node = 3;
  c.nnodes = 2;
  c.node_rank = 1;
  c.master_addr = "node0";
  c.local_rank_arg = true;
  c.command = {"./train", "--epochs", "2"};
  ddp_test::EnvGuard guard({"OMP_NUM_THREADS"});
  ::unsetenv("OMP_NUM_THREADS");
  const auto env_list = ddp::worker_environment(c, 2, 4321);
  const std::map<std::string, std::string> env(env_list.begin(), env_list.end());
  EXPECT_EQ(env.at("MASTER_ADDR"), "node0");
  EXPECT_EQ(env.at("MASTER_PORT"), "4321");
  EXPECT_EQ(env.at("RANK"), "5");
  EXPECT_EQ(env.at("WORLD_SIZE"), "6");
  EXPECT_EQ(env.at("LOCAL_RANK"), "2");
  EXPECT_EQ(env.at("LOCAL_WORLD_SIZE"), "3");
  EXPECT_EQ(env.at("GROUP_RANK"), "1");
  EXPECT_EQ(env.at("OMP_NUM_THREADS"), "1");
  EXPECT_EQ(ddp::worker_command(c, 2), (std::vector<std::string>{"./train", "--local-rank=2", "--epochs", "2"}));
  ::setenv("OMP_NUM_THREADS", "4", 1);  // the user's choice is kept
  const auto kept = ddp::worker_environment(c, 0, 4321);
  for (const auto& [key, value] : kept) EXPECT_NE(key, "OMP_NUM_THREADS");
}

/// A command started in the background with its output in a file.
class Process {
 public:
  explicit Process(const std::string& command) : log_(dir_.file("log")) {
    pid_ = ::fork();
    if (pid_ == 0) {
      const std::string line = "exec " + command + " > " + log_ + " 2>&1";
      ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~Process() {
    if (pid_ > 0 && !status_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  /// Waits up to `limit`; returns the exit status (or nullopt after killing it when it ran too long).
  std::optional<int> wait(std::chrono::seconds limit) {
    const auto deadline = Clock::now() + limit;
    while (Clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        status_ = status;
        return status_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return std::nullopt;
  }
  std::string output() const {
    std::ifstream in(log_);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  pid_t pid() const { return pid_; }

 private:
  ddp_test::ScratchDir dir_;
  std::string log_;
  pid_t pid_ = -1;
  std::optional<int> status_;
};

const std::string kLaunch = LTA_DDP_LAUNCH;
const std::string kWorker = LTA_DDP_TEST_WORKER;
constexpr std::chrono::seconds kLimit{60};

int exit_code(const std::optional<int>& status) { return status && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1; }

TEST(DdpLaunchTest, TwoAndFourWorkersTrainTogetherAndEndBitIdentical) {
  LTA_REQUIRE_GLOO();
  for (const int n : {2, 4}) {
    ddp_test::ScratchDir out;
    Process launch(kLaunch + " --nproc-per-node " + std::to_string(n) + " --master-port 0 " + kWorker +
                   " train --steps 3 --out " + out.path());
    ASSERT_EQ(exit_code(launch.wait(kLimit)), 0) << launch.output();
    std::vector<std::string> done;
    for (int r = 0; r < n; ++r) done.push_back("rank " + std::to_string(r) + " of " + std::to_string(n) + " done");
    EXPECT_TRUE(contains_all(launch.output(), done));
    std::vector<torch::Tensor> r0;
    torch::load(r0, out.file("rank0.pt"));
    for (int r = 1; r < n; ++r) {
      std::vector<torch::Tensor> rn;
      torch::load(rn, out.file("rank" + std::to_string(r) + ".pt"));
      ASSERT_EQ(r0.size(), rn.size());
      for (size_t i = 0; i < r0.size(); ++i) {
        EXPECT_TRUE(torch::equal(r0[i], rn[i])) << n << " workers: parameter " << i << " of rank " << r;
      }
    }
  }
}

TEST(DdpLaunchTest, AFailedWorkerIsNamedTheOthersStoppedAndItsCodeReturned) {
  LTA_REQUIRE_GLOO();
  const auto start = Clock::now();
  Process launch(kLaunch + " --nproc-per-node 2 --master-port 0 --kill-grace-s 1 " + kWorker +
                 " fail --fail-rank 1 --code 7");
  EXPECT_EQ(exit_code(launch.wait(kLimit)), 7) << launch.output();
  EXPECT_TRUE(std::regex_search(launch.output(),
                                std::regex("ddp-launch: rank 1 \\(local rank 1, pid [0-9]+\\) exited with code 7")))
      << launch.output();
  // The surviving worker sleeps for a minute: it was stopped, not waited for.
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(20));
}

TEST(DdpLaunchTest, AProgramThatCannotStartIsReported) {
  Process launch(kLaunch + " --nproc-per-node 1 --master-port 0 /nonexistent/program");
  EXPECT_EQ(exit_code(launch.wait(kLimit)), 127);
  EXPECT_TRUE(contains_all(launch.output(), {"cannot run '/nonexistent/program'", "exited with code 127"}));
}

TEST(DdpLaunchTest, WorkersGetTheContractAndTheLocalRankArgument) {
  ddp_test::ScratchDir out;
  Process launch(kLaunch + " --nproc-per-node 2 --master-port 0 --local-rank-arg " + kWorker + " env --out " +
                 out.path());
  ASSERT_EQ(exit_code(launch.wait(kLimit)), 0) << launch.output();
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream in(out.file("env" + std::to_string(rank)));
    std::string line;
    std::getline(in, line);
    EXPECT_EQ(line, c10::str(rank, " 2 ", rank, " 2 127.0.0.1 0 ", rank));
  }
}

TEST(DdpLaunchTest, SigtermIsForwardedToTheWorkers) {
  ddp_test::ScratchDir out;
  Process launch(kLaunch + " --nproc-per-node 2 --master-port 0 " + kWorker + " sleep --out " + out.path());
  const auto deadline = Clock::now() + kLimit;
  auto ready = [&] { return std::ifstream(out.file("ready0")).good() && std::ifstream(out.file("ready1")).good(); };
  while (!ready() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(ready()) << launch.output();
  const auto start = Clock::now();
  ::kill(launch.pid(), SIGTERM);
  EXPECT_EQ(exit_code(launch.wait(kLimit)), 128 + SIGTERM) << launch.output();
  EXPECT_TRUE(contains_all(launch.output(), {"was killed by signal 15"}));
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
}

TEST(DdpLaunchTest, TwoNodesOnLocalhostTrainTogether) {
  LTA_REQUIRE_GLOO();
  ddp_test::ScratchDir out;
  const std::string port = std::to_string(ddp::detail::find_free_port());
  const std::string common = " --nnodes 2 --nproc-per-node 1 --master-addr 127.0.0.1 --master-port " + port;
  const std::string worker = " " + kWorker + " train --steps 3 --out " + out.path();
  Process node0(kLaunch + common + " --node-rank 0" + worker);
  Process node1(kLaunch + common + " --node-rank 1" + worker);
  ASSERT_EQ(exit_code(node0.wait(kLimit)), 0) << node0.output();
  ASSERT_EQ(exit_code(node1.wait(kLimit)), 0) << node1.output();
  EXPECT_TRUE(contains_all(node0.output(), {"rank 0 of 2 done"}));
  EXPECT_TRUE(contains_all(node1.output(), {"rank 1 of 2 done"}));
  std::vector<torch::Tensor> r0, r1;
  torch::load(r0, out.file("rank0.pt"));
  torch::load(r1, out.file("rank1.pt"));
  ASSERT_EQ(r0.size(), r1.size());
  for (size_t i = 0; i < r0.size(); ++i) EXPECT_TRUE(torch::equal(r0[i], r1[i])) << "parameter " << i;
}

}  // namespace

#endif  // LTA_DDP_LAUNCH
