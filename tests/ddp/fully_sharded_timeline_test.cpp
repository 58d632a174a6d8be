// Full sharding on the timeline (FullyShardedDataParallel::set_timeline): every unit's all-gather and reduce-scatter
// from issue to completion, the host's waits for them, and the share of the all-gathers that hid behind compute.
#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ddp/fsdp/fully_sharded.h>
#include <ddp/timeline.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"
#include "ddp/fully_sharded_test_util.h"
#include "test_util.h"

namespace {

using ddp_test::run_ranks;

using namespace fsdp_test;  // NOLINT(google-build-using-namespace): the shared test model

/// Step 2 of three SGD steps through full sharding with `options`, recorded: this rank's events.
std::vector<ddp::TimelineEvent> record_step_two(int rank, const ddp::ProcessGroup& pg,
                                                const ddp::FullyShardOptions& options) {
  Net model = make_net(5, rank, /*sharded=*/true);
  ddp::FullyShardedDataParallel fsdp(model, pg, options);
  torch::optim::SGD sgd(fsdp.parameters(), fsdp_test::sgd());
  auto timeline = std::make_shared<ddp::Timeline>(ddp::TimelineWindow{2, 2});
  fsdp.set_timeline(timeline);
  for (int step = 1; step <= 3; ++step) {
    timeline->begin_step(step);
    sgd.zero_grad();
    const Batch b = batch(5, rank, step);
    torch::mse_loss(fsdp.forward(b.x), b.y).backward();
    sgd.step();
    timeline->end_step();
  }
  fsdp.set_timeline(nullptr);
  return timeline->resolve();
}

struct Interval {
  double start = 0, end = 0;
};

/// The events of `lane` named `name`, in the order they were recorded.
std::vector<Interval> named(const std::vector<ddp::TimelineEvent>& events, const std::string& lane,
                            const std::string& name) {
  std::vector<Interval> out;
  for (const auto& e : events) {
    if (e.lane == lane && e.name == name) out.push_back({e.start_us, e.end_us});
  }
  return out;
}

const std::vector<std::string>& unit_labels() {
  static const std::vector<std::string> labels = {"the root", "unit 'blocks.0'", "unit 'blocks.1'", "unit 'blocks.2'"};
  return labels;
}

// Each step gathers the root once (it stays gathered until the end of backward) and every block twice (forward, and
// again for its backward), and reduces every unit once; each collective has the host's wait after it, which ends no
// earlier than the collective.
TEST(FullyShardedTimelineTest, RecordsEveryUnitsGatherAndReductionAndTheWaitForIt) {
  LTA_REQUIRE_GLOO();
  run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        for (const bool prefetch : {true, false}) {
          SCOPED_TRACE(prefetch ? "prefetch on" : "prefetch off");
          const auto events = record_step_two(rank, pg, ddp::FullyShardOptions().prefetch(prefetch));
          for (const auto& e : events) EXPECT_EQ(e.step, 2) << e.name;
          for (const std::string& label : unit_labels()) {
            for (const char* collective : {"all-gather", "reduce-scatter"}) {
              const std::string name = std::string(collective) + " " + label;
              const auto comm = named(events, "comm", name);
              const auto waits = named(events, "wait", "wait " + name);
              const size_t expected = std::string(collective) == "reduce-scatter" || label == "the root" ? 1 : 2;
              ASSERT_EQ(comm.size(), expected) << name;
              ASSERT_EQ(waits.size(), expected) << name;
              for (size_t i = 0; i < comm.size(); ++i) {
                EXPECT_LE(comm[i].start, comm[i].end) << name;
                EXPECT_LE(comm[i].end, waits[i].end) << name << ": completed after the wait returned";
              }
            }
          }
        }
      },
      2);
}

// A gather issued inside the wait (no prefetch) is waited for throughout: nothing of it hides. With prefetch the
// blocks after the first are gathered while the one before computes: issued before their wait began.
TEST(FullyShardedTimelineTest, APrefetchedGatherIsIssuedBeforeItsWaitAndAnUnprefetchedOneHidesNothing) {
  LTA_REQUIRE_GLOO();
  run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        const auto without = record_step_two(rank, pg, ddp::FullyShardOptions().prefetch(false));
        for (const std::string& label : unit_labels()) {
          const auto comm = named(without, "comm", "all-gather " + label);
          const auto waits = named(without, "wait", "wait all-gather " + label);
          ASSERT_EQ(comm.size(), waits.size()) << label;
          for (size_t i = 0; i < comm.size(); ++i) EXPECT_LE(waits[i].start, comm[i].start) << label;
        }
        ASSERT_TRUE(ddp::collective_hidden_share(without, "all-gather").has_value());
        EXPECT_EQ(*ddp::collective_hidden_share(without, "all-gather"), 0.0);

        const auto with = record_step_two(rank, pg, ddp::FullyShardOptions());
        for (const char* label : {"unit 'blocks.1'", "unit 'blocks.2'"}) {
          const auto comm = named(with, "comm", std::string("all-gather ") + label);
          const auto waits = named(with, "wait", std::string("wait all-gather ") + label);
          ASSERT_EQ(comm.size(), 2u) << label;
          EXPECT_LT(comm[0].start, waits[0].start) << label << "'s forward gather was not prefetched";
        }
        const auto first = named(with, "comm", "all-gather unit 'blocks.0'");
        const auto first_wait = named(with, "wait", "wait all-gather unit 'blocks.0'");
        ASSERT_EQ(first.size(), 2u);
        EXPECT_LE(first_wait[0].start, first[0].start) << "nothing runs before the first block to prefetch it";
        const auto share = ddp::collective_hidden_share(with, "all-gather");
        ASSERT_TRUE(share.has_value());
        EXPECT_GE(*share, 0.0);
        EXPECT_LE(*share, 1.0);
      },
      2);
}

// Steps outside the window record nothing.
TEST(FullyShardedTimelineTest, RecordsNothingOutsideItsWindow) {
  LTA_REQUIRE_GLOO();
  run_ranks(
      [](int rank, const ddp::ProcessGroup& pg) {
        Net model = make_net(5, rank, /*sharded=*/true);
        ddp::FullyShardedDataParallel fsdp(model, pg);
        auto later = std::make_shared<ddp::Timeline>(ddp::TimelineWindow{5, 5});
        fsdp.set_timeline(later);
        for (int step = 1; step <= 2; ++step) {
          later->begin_step(step);
          const Batch b = batch(5, rank, step);
          torch::mse_loss(fsdp.forward(b.x), b.y).backward();
          later->end_step();
        }
        EXPECT_TRUE(later->resolve().empty());
      },
      2);
}

/// A residual block that calls `on_forward` first: a way to act while the next block's gather is in flight.
struct CallbackBlockImpl : torch::nn::Module {
  CallbackBlockImpl() { fc = register_module("fc", torch::nn::Linear(kWidth, kWidth)); }
  torch::Tensor forward(const torch::Tensor& x) {
    if (on_forward) on_forward();
    return x + fc(x);
  }
  torch::nn::Linear fc{nullptr};
  std::function<void()> on_forward;
};
TORCH_MODULE(CallbackBlock);

// The timeline removed while a gather it recorded the issue of is in flight (the second block's, prefetched while the
// first computes): the gather goes to the timeline it was issued under when it is waited for, and nothing issued after
// the removal is recorded (backward's gathers and reductions).
TEST(FullyShardedTimelineTest, ACollectiveInFlightWhenTheTimelineIsRemovedEndsInTheOneItWasIssuedUnder) {
  LTA_REQUIRE_GLOO();
  run_ranks(
      [](int, const ddp::ProcessGroup& pg) {
        CallbackBlock first, second;
        torch::nn::Sequential net{ddp::ShardedUnit(first), ddp::ShardedUnit(second)};
        ddp::FullyShardedDataParallel fsdp(net, pg);
        const torch::Tensor x = torch::ones({4, kWidth});
        fsdp.forward(x).sum().backward();  // the first forward fixes the order: the next one prefetches
        auto timeline = std::make_shared<ddp::Timeline>(ddp::TimelineWindow{1, 1});
        fsdp.set_timeline(timeline);
        first->on_forward = [&] { fsdp.set_timeline(nullptr); };
        timeline->begin_step(1);
        fsdp.forward(x).sum().backward();
        timeline->end_step();
        const auto events = timeline->resolve();
        EXPECT_EQ(named(events, "comm", "all-gather unit '0'").size(), 1u);
        EXPECT_EQ(named(events, "comm", "all-gather unit '1'").size(), 1u) << "the prefetched gather was lost";
        EXPECT_EQ(named(events, "wait", "wait all-gather unit '1'").size(), 1u);
        for (const auto& e : events) EXPECT_EQ(e.name.find("reduce-scatter"), std::string::npos) << e.name;
      },
      2);
}

}  // namespace
