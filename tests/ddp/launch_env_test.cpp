#include <ddp/launch/launch_env.h>

#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "ddp/scoped_env.h"

namespace {

// Sets exactly the given launcher variables for one test and restores the process environment afterwards.
class LaunchEnvTest : public ::testing::Test {
 protected:
  static void set(const std::map<std::string, std::string>& vars) { ddp_test::ScopedEnv::set(vars); }
  void expect_error(const std::string& fragment) {
    try {
      ddp::launch_env_from_environment();
      ADD_FAILURE() << "expected an error containing: " << fragment;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  }
  ddp_test::ScopedEnv env_{ddp_test::kLaunchVariables};
};

const std::map<std::string, std::string> kTwoNodes = {
    {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}, {"RANK", "3"},
    {"WORLD_SIZE", "4"},          {"LOCAL_RANK", "1"},      {"LOCAL_WORLD_SIZE", "2"}};

TEST_F(LaunchEnvTest, ReadsTheTorchrunContract) {
  set(kTwoNodes);
  const ddp::LaunchEnv env = ddp::launch_env_from_environment();
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_TRUE(ddp::launched_by_launcher());
}

TEST_F(LaunchEnvTest, LocalVariablesDefaultForSingleNodeLaunchers) {
  set({{"MASTER_ADDR", "localhost"}, {"MASTER_PORT", "1234"}, {"RANK", "2"}, {"WORLD_SIZE", "3"}});
  const ddp::LaunchEnv env = ddp::launch_env_from_environment();
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.local_world_size, 3);
}

TEST_F(LaunchEnvTest, MissingVariableIsNamed) {
  auto vars = kTwoNodes;
  vars.erase("MASTER_PORT");
  set(vars);
  expect_error("environment variable MASTER_PORT is not set");
  EXPECT_TRUE(ddp::launched_by_launcher());
}

TEST_F(LaunchEnvTest, MalformedIntegerIsNamedWithItsValue) {
  auto vars = kTwoNodes;
  vars["WORLD_SIZE"] = "4x";
  set(vars);
  expect_error("WORLD_SIZE must be an integer, got '4x'");
}

TEST_F(LaunchEnvTest, RankOutsideWorldIsNamed) {
  auto vars = kTwoNodes;
  vars["RANK"] = "4";
  set(vars);
  expect_error("RANK must be in [0, 3], got 4");
}

TEST_F(LaunchEnvTest, PortOutOfRangeIsNamed) {
  auto vars = kTwoNodes;
  vars["MASTER_PORT"] = "70000";
  set(vars);
  expect_error("MASTER_PORT must be in [1, 65535], got 70000");
}

TEST_F(LaunchEnvTest, NotLaunchedWithoutRankAndWorldSize) { EXPECT_FALSE(ddp::launched_by_launcher()); }

std::optional<int> parse(std::vector<const char*> args) {
  args.insert(args.begin(), "prog");
  return ddp::parse_local_rank_arg(static_cast<int>(args.size()), args.data());
}

TEST(LocalRankArgTest, AcceptsBothSpellingsAndBothForms) {
  EXPECT_EQ(parse({"--local_rank=2"}), 2);
  EXPECT_EQ(parse({"--epochs", "3", "--local-rank=5"}), 5);
  EXPECT_EQ(parse({"--local_rank", "1"}), 1);
  EXPECT_EQ(parse({"--local-rank", "0", "--other"}), 0);
  EXPECT_EQ(parse({"--epochs", "3"}), std::nullopt);
}

TEST(LocalRankArgTest, BadValueIsNamed) {
  try {
    parse({"--local_rank=-1"});
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--local_rank must be in [0, "), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse({"--local-rank"}), c10::Error);
  EXPECT_THROW(parse({"--local-rank=two"}), c10::Error);
}

}  // namespace
