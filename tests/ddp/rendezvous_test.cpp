// detail::Rendezvous (and JobStore's lost-node rule): the elastic membership of ddp-launch's attempts (--nnodes
// MIN:MAX), agreed through node 0's job store. Node 0 and the other nodes are threads of this process, each with its
// own connection to the store.
#include <ddp/launch/rendezvous.h>

#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>
#include <ddp/launch/job_store.h>
#include <gtest/gtest.h>

namespace {

using ddp::detail::JobStore;
using ddp::detail::Rendezvous;
using ddp::detail::RoundOutcome;
using std::chrono::milliseconds;

constexpr milliseconds kLong{60000};  // a wait the test must never sit out

struct Job {
  std::unique_ptr<JobStore> host_store = JobStore::host("127.0.0.1", 0, /*one_node=*/true);
  std::unique_ptr<JobStore> connect() { return JobStore::connect("127.0.0.1", host_store->port(), kLong); }
};

Rendezvous::Options options(int id, int min_nodes, int max_nodes, milliseconds rejoin_wait,
                            milliseconds timeout = kLong) {
  Rendezvous::Options o;
  o.id = id;
  o.min_nodes = min_nodes;
  o.max_nodes = max_nodes;
  o.rejoin_wait = rejoin_wait;
  o.timeout = timeout;
  return o;
}

TEST(RendezvousTest, OutcomesSurviveTheStore) {
  RoundOutcome members;
  members.members = {0, 2, 5};
  members.message = "ddp-launch: restart 1 of 3 after: x\n";
  const RoundOutcome back = ddp::detail::decode_outcome(4, ddp::detail::encode_outcome(members));
  EXPECT_EQ(back.round, 4);
  EXPECT_FALSE(back.ended);
  EXPECT_EQ(back.members, members.members);
  EXPECT_EQ(back.message, members.message);
  EXPECT_EQ(back.node_rank_of(2), 1);
  EXPECT_EQ(back.node_rank_of(3), -1);
  RoundOutcome end;
  end.ended = true;
  end.exit_code = 3;
  end.message = "gave up\nfailures\n";
  const RoundOutcome end_back = ddp::detail::decode_outcome(1, ddp::detail::encode_outcome(end));
  EXPECT_TRUE(end_back.ended);
  EXPECT_EQ(end_back.exit_code, 3);
  EXPECT_EQ(end_back.message, end.message);
  EXPECT_THROW(ddp::detail::decode_outcome(0, "nonsense"), c10::Error);
}

TEST(RendezvousTest, NodeZeroClosesTheRoundAsSoonAsAllMaxNodesJoined) {
  Job job;
  auto store1 = job.connect();
  auto store2 = job.connect();
  auto joined1 = std::async(std::launch::async, [&] { return Rendezvous(*store1, options(1, 1, 3, kLong)).join(0); });
  auto joined2 = std::async(std::launch::async, [&] { return Rendezvous(*store2, options(2, 1, 3, kLong)).join(0); });
  const auto hosted = Rendezvous(*job.host_store, options(0, 1, 3, kLong)).host(0, "hello\n");
  ASSERT_TRUE(hosted.has_value());
  EXPECT_EQ(hosted->members, (std::vector<int>{0, 1, 2}));
  for (auto* joined : {&joined1, &joined2}) {
    const auto outcome = joined->get();
    ASSERT_TRUE(outcome.has_value());
    EXPECT_EQ(outcome->round, 0);
    EXPECT_EQ(outcome->members, (std::vector<int>{0, 1, 2}));
    EXPECT_EQ(outcome->message, "hello\n");
  }
}

TEST(RendezvousTest, WithAtLeastMinNodesNodeZeroClosesAfterTheRejoinWaitAndALateNodeIsAdmittedNext) {
  Job job;
  auto store2 = job.connect();
  auto joined2 =
      std::async(std::launch::async, [&] { return Rendezvous(*store2, options(2, 2, 3, milliseconds(200))).join(0); });
  Rendezvous host(*job.host_store, options(0, 2, 3, milliseconds(200)));
  const auto round0 = host.host(0, "");
  ASSERT_TRUE(round0.has_value());
  EXPECT_EQ(round0->members, (std::vector<int>{0, 2}));  // node 1 never came: 2 of 3, after the wait
  EXPECT_EQ(joined2.get()->node_rank_of(2), 1);
  EXPECT_FALSE(host.newcomer(1).has_value());

  // Node 1 arrives while attempt 0 runs: it joins round 0, finds it closed without it, and waits in round 1.
  auto store1 = job.connect();
  auto joined1 = std::async(std::launch::async, [&] { return Rendezvous(*store1, options(1, 2, 3, kLong)).join(0); });
  std::optional<std::string> newcomer;
  while (!(newcomer = host.newcomer(1))) std::this_thread::sleep_for(milliseconds(10));
  EXPECT_EQ(*newcomer, "membership change: node 1 asked to join (--nnodes 2:3)");
  auto rejoined2 = std::async(std::launch::async, [&] { return Rendezvous(*store2, options(2, 2, 3, kLong)).join(1); });
  // (All 3 are expected now: a long rejoin wait, so that round 1 waits for node 2 however slow its thread is.)
  const auto round1 = Rendezvous(*job.host_store, options(0, 2, 3, kLong)).host(1, "restart\n");
  ASSERT_TRUE(round1.has_value());
  EXPECT_EQ(round1->members, (std::vector<int>{0, 1, 2}));
  const auto admitted = joined1.get();
  ASSERT_TRUE(admitted.has_value());
  EXPECT_EQ(admitted->round, 1);
  EXPECT_EQ(admitted->node_rank_of(1), 1);
  EXPECT_EQ(admitted->message, "restart\n");
  EXPECT_EQ(rejoined2.get()->node_rank_of(2), 2);
}

TEST(RendezvousTest, FewerThanMinNodesWithinTheTimeoutIsOneLine) {
  Job job;
  try {
    Rendezvous(*job.host_store, options(0, 2, 2, milliseconds(0), milliseconds(300))).host(0, "");
    ADD_FAILURE() << "the round closed without node 1";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "only 1 of at least 2 nodes (--nnodes 2:2) joined within 0.3 s (--rendezvous-timeout-s): node ids 0");
  }
}

TEST(RendezvousTest, TheEndOfTheJobReachesANodeWaitingToJoinAndNodeZeroWaitsUntilItRead) {
  Job job;
  auto store1 = job.connect();
  auto waiting = std::async(std::launch::async, [&] { return Rendezvous(*store1, options(1, 1, 2, kLong)).join(3); });
  Rendezvous host(*job.host_store, options(0, 1, 2, kLong));
  while (!host.newcomer(3)) std::this_thread::sleep_for(milliseconds(10));
  host.end(3, 7, "ddp-launch: gave up\n", /*expected=*/1, kLong);  // returns once node 1 has read it
  const auto outcome = waiting.get();
  ASSERT_TRUE(outcome.has_value());
  EXPECT_TRUE(outcome->ended);
  EXPECT_EQ(outcome->exit_code, 7);
  EXPECT_EQ(outcome->message, "ddp-launch: gave up\n");
  EXPECT_EQ(job.host_store->round_leavers(3), 1);
}

TEST(RendezvousTest, TwoNodesWithTheSameIdAreRefused) {
  Job job;
  auto first = job.connect();
  auto second = job.connect();
  EXPECT_EQ(first->join_round(0, 1), 1);
  try {
    Rendezvous(*second, options(1, 1, 2, kLong)).join(0);
    ADD_FAILURE() << "a second node 1 joined";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "another node joined with --node-rank 1: each node of an elastic job needs its own (in [1, 2); 0 is "
              "the store's host)");
  }
}

// A node that does not report an attempt's end: lost when its heartbeat has stopped (named after kSilentNode, not
// after the whole wait), merely slow while it beats (waited for until the wait's end).
TEST(JobStoreTest, ANodeThatStopsBeatingIsNamedLostWithoutWaitingOutTheWait) {
  Job job;
  const auto when = std::chrono::system_clock::now();
  job.host_store->report_failure(0, 0, when, "node 0: rank 0 exited with code 1");
  const auto start = std::chrono::steady_clock::now();
  const auto lost = job.host_store->cause_of(0, {0, 1}, kLong);  // node 1 never beat
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(lost.has_value());
  EXPECT_EQ(*lost,
            "node 1 lost: its launcher gave no sign of life for 5 s; first failure seen: node 0: rank 0 exited "
            "with code 1");
  EXPECT_LT(waited, 30.0);  // kSilentNode (5 s) and a poll, not the 60 s wait

  ddp::detail::Heartbeat beating(std::string("127.0.0.1"), job.host_store->port(), 1);
  job.host_store->report_failure(1, 0, when, "node 0: rank 0 exited with code 1");
  const auto slow = job.host_store->cause_of(1, {0, 1}, milliseconds(300));
  ASSERT_TRUE(slow.has_value());
  EXPECT_EQ(*slow,
            "node 1 lost: its launcher did not report the attempt's end within 0.3 s; first failure seen: node "
            "0: rank 0 exited with code 1");
}

}  // namespace
