#include <ddp/timeline.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <ddp/distributed_data_parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_mlp_test_util.h"
#include "ddp/ddp_test_util.h"
#include "json_lines.h"
#include "test_util.h"

namespace {

using namespace ddp_mlp;  // NOLINT(google-build-using-namespace): the shared test model
using Clock = ddp::Timeline::Clock;

Clock::time_point at_us(int64_t microseconds) { return Clock::time_point(std::chrono::microseconds(microseconds)); }

ddp::TimelineEvent event(const std::string& name, const std::string& lane, int64_t step, double start, double end) {
  return ddp::TimelineEvent{name, lane, step, -1, start, end};
}

TEST(TimelineTest, KeepsOnlyTheStepsOfItsWindow) {
  ddp::Timeline timeline(ddp::TimelineWindow{2, 3});
  for (int64_t step = 1; step <= 4; ++step) {
    timeline.begin_step(step);
    EXPECT_EQ(timeline.recording(), step == 2 || step == 3) << "step " << step;
    timeline.add("forward", "step", at_us(10 * step), at_us(10 * step + 5));
    timeline.end_step();
    EXPECT_FALSE(timeline.recording());
    EXPECT_EQ(timeline.finished(), step >= 3) << "step " << step;
  }
  timeline.add("outside", "step", at_us(0), at_us(1));  // between steps: dropped
  const auto events = timeline.resolve();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].step, 2);
  EXPECT_EQ(events[1].step, 3);
  EXPECT_DOUBLE_EQ(events[0].start_us, 20.0);
  EXPECT_DOUBLE_EQ(events[0].end_us, 25.0);
}

TEST(TimelineTest, RefusesAWindowThatIsEmptyOrBeforeStepOne) {
  EXPECT_THROW(ddp::Timeline(ddp::TimelineWindow{0, 2}), std::invalid_argument);
  EXPECT_THROW(ddp::Timeline(ddp::TimelineWindow{3, 2}), std::invalid_argument);
  EXPECT_NO_THROW(ddp::Timeline(ddp::TimelineWindow{5, 5}));
}

TEST(TimelineTest, ChromeTraceHasAProcessPerRankAThreadPerLaneAndStartsAtZero) {
  const std::vector<std::vector<ddp::TimelineEvent>> per_rank = {
      {event("forward", "step", 1, 1000, 1500), event("allreduce bucket 0", "comm", 1, 1400, 1700)},
      {event("forward", "step", 1, 1100, 1600), event("say \"hi\"", "step", 1, 1600, 1601),
       event("bucket 0 ready", "buckets", 1, 1500, 1500)}};
  const std::string json = ddp::chrome_trace_json(per_rank);
  const test_json::Json trace = test_json::parse(json);
  EXPECT_EQ(trace["displayTimeUnit"], "ms");
  const test_json::Json& events = trace["traceEvents"];
  EXPECT_EQ(test_json::count_where(events, "name", "process_name"), 2u);
  EXPECT_EQ(test_json::count_where(events, "name", "thread_name"), 4u);  // rank 0: step, comm; rank 1: step, buckets
  EXPECT_EQ(test_json::count_where(events, "ph", "X"), 4u);
  EXPECT_EQ(test_json::count_where(events, "ph", "i"), 1u) << "an instant: " << json;
  std::map<std::string, test_json::Json> by_name;  // the last event of each name
  for (const test_json::Json& e : events) by_name[e["name"]] = e;
  EXPECT_EQ(by_name["bucket 0 ready"]["ph"], "i");
  EXPECT_EQ(by_name["bucket 0 ready"]["s"], "t");
  EXPECT_EQ(by_name["bucket 0 ready"]["cat"], "buckets");
  EXPECT_EQ(by_name["allreduce bucket 0"]["ts"], 400.0) << json;  // times from the earliest event, which is at 0
  EXPECT_EQ(by_name["allreduce bucket 0"]["dur"], 300.0) << json;
  EXPECT_EQ(by_name["allreduce bucket 0"]["pid"], 0);
  EXPECT_EQ(by_name["allreduce bucket 0"]["args"]["step"], 1);
  EXPECT_EQ(by_name["say \"hi\""]["pid"], 1) << "names are escaped: " << json;
  double earliest = 1e300;
  for (const test_json::Json& e : events)
    earliest = e.contains("ts") ? std::min(earliest, e["ts"].get<double>()) : earliest;
  EXPECT_EQ(earliest, 0.0);
  EXPECT_EQ(std::count(json.begin(), json.end(), '\n'), static_cast<std::ptrdiff_t>(events.size()) + 2)
      << "an event a line: " << json;
}

TEST(TimelineTest, OverlapIsTheShareOfAllreduceTimeBeforeBackwardWaitsForIt) {
  // Autograd finished at 100 (the wait began): allreduce [0, 50] was hidden entirely, [50, 150] half.
  std::vector<ddp::TimelineEvent> events = {event(ddp::kAllreduceWaitEvent, "step", 1, 100, 150),
                                            event("allreduce bucket 0", "comm", 1, 0, 50),
                                            event("allreduce bucket 1", "comm", 1, 50, 150)};
  EXPECT_NEAR(*ddp::allreduce_overlap(events), 100.0 / 150.0, 1e-12);
  events[1].start_us = 120;  // now entirely after
  events[1].end_us = 140;
  EXPECT_NEAR(*ddp::allreduce_overlap(events), 50.0 / 120.0, 1e-12);
  EXPECT_FALSE(ddp::allreduce_overlap({event("forward", "step", 1, 0, 1)}).has_value());
}

TEST(TimelineTest, HiddenShareIsOneLessTheWaitsOverTheCollectivesTime) {
  // Two all-gathers of 100 us in all; the host waited 25 us for them: 75% hid. A reduce-scatter and its wait, and
  // events of other lanes, do not count.
  std::vector<ddp::TimelineEvent> events = {
      event("all-gather unit 'a'", "comm", 1, 0, 60),        event("all-gather the root", "comm", 1, 100, 140),
      event("wait all-gather unit 'a'", "wait", 1, 50, 60),  event("wait all-gather the root", "wait", 1, 125, 140),
      event("reduce-scatter unit 'a'", "comm", 1, 200, 300), event("wait reduce-scatter unit 'a'", "wait", 1, 200, 300),
      event("all-gather unit 'a'", "step", 1, 0, 1000)};
  EXPECT_NEAR(*ddp::collective_hidden_share(events, "all-gather"), 0.75, 1e-12);
  EXPECT_NEAR(*ddp::collective_hidden_share(events, "reduce-scatter"), 0.0, 1e-12);
  // A wait longer than the collective (it was issued inside the wait) hides nothing, never less.
  events[2].start_us = -100;
  EXPECT_EQ(*ddp::collective_hidden_share(events, "all-gather"), 0.0);
  EXPECT_FALSE(ddp::collective_hidden_share(events, "allreduce").has_value());
}

// On CUDA an interval is a pair of timing events, read after the window and placed on the host clock through a final
// event resolve() waits for: device work of known order must come out in that order, with its length, inside the
// host time around the window.
TEST(TimelineCudaTest, DeviceIntervalsArePlacedOnTheHostClockInStreamOrder) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs a CUDA GPU; none is present";
  const torch::Device device(torch::kCUDA, 0);
  const c10::Stream stream = c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(device);
  const auto a = torch::randn({2048, 2048}, torch::TensorOptions().device(device));
  ddp::Timeline timeline(ddp::TimelineWindow{1, 2});
  const double before_us = ddp::steady_microseconds(Clock::now());
  for (int64_t step = 1; step <= 2; ++step) {
    timeline.begin_step(step);
    const auto start = ddp::Timeline::mark(stream);
    auto b = a;
    for (int i = 0; i < 20; ++i) b = torch::mm(b, a).div_(2048.0);  // tens of ms of device work, launched at once
    const auto end = ddp::Timeline::mark(stream);
    timeline.add("matmuls", "step", start, end);
    timeline.end_step();
  }
  const auto events = timeline.resolve();  // waits for the device
  const double after_us = ddp::steady_microseconds(Clock::now());
  ASSERT_EQ(events.size(), 2u);
  for (const auto& e : events) {
    EXPECT_GT(e.end_us - e.start_us, 100.0) << "20 GEMMs of 2048^2 take more than 0.1 ms";
    EXPECT_GE(e.start_us, before_us - 1000.0);
    EXPECT_LE(e.end_us, after_us + 1000.0);
  }
  EXPECT_GE(events[1].start_us, events[0].end_us - 1.0) << "step 2's work ran after step 1's on the stream";
}

/// Per step of `events`: the named event's interval (each must be there once).
std::map<int64_t, std::pair<double, double>> intervals(const std::vector<ddp::TimelineEvent>& events,
                                                       const std::string& name) {
  std::map<int64_t, std::pair<double, double>> out;
  for (const auto& e : events) {
    if (e.name != name) continue;
    TORCH_CHECK(!out.count(e.step), name, " twice in step ", e.step);
    out[e.step] = {e.start_us, e.end_us};
  }
  return out;
}

// The DDP protocol as the timeline must show it, on each rank of a real 2-rank run: a bucket's allreduce starts when
// it is ready (after backward began) and in bucket order, ends before backward stops waiting for it, and the optimizer
// step starts after the last allreduce ended. Also checks gather_timeline: rank 0 sees every rank's events.
TEST(DistributedDataParallelTimelineTest, EventsAreOrderedAndNestedAsTheDdpProtocolSays) {
  LTA_REQUIRE_GLOO();
  const uint64_t seed = test_util::fresh_seed();
  constexpr int64_t kSteps = 4;
  run_ranks([seed](int rank, const ddp::ProcessGroup& pg) {
    const Data data = shard(make_data(seed + 3), rank, pg.size());
    Mlp model = make_model(seed, rank);
    ddp::DistributedDataParallel ddp(
        model, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(0.002).first_bucket_mb(0.002));  // 4 buckets
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01));
    auto timeline = std::make_shared<ddp::Timeline>(ddp::TimelineWindow{3, 4});  // after the bucket rebuild
    ddp.set_timeline(timeline);
    for (int64_t step = 1; step <= kSteps; ++step) {
      timeline->begin_step(step);
      const auto began = Clock::now();
      sgd.zero_grad();
      auto loss = torch::mse_loss(ddp.forward(data.x), data.y);
      const auto forward_done = Clock::now();
      timeline->add("forward", "step", began, forward_done);
      loss.backward();
      const auto backward_done = Clock::now();
      timeline->add("backward", "step", forward_done, backward_done);
      sgd.step();
      timeline->add("optimizer step", "step", backward_done, Clock::now());
      timeline->end_step();
    }
    const auto gathered = ddp::gather_timeline(pg, timeline->resolve());
    TORCH_CHECK(gathered.size() == 2u, "gathered ", gathered.size(), " ranks");
    const auto buckets = static_cast<int64_t>(ddp.buckets().size());
    TORCH_CHECK(buckets >= 3, "the test needs several buckets, got ", buckets);
    for (size_t r = 0; r < gathered.size(); ++r) {
      const auto& events = gathered[r];
      const auto backward = intervals(events, "backward");
      const auto wait = intervals(events, ddp::kAllreduceWaitEvent);
      const auto optimizer = intervals(events, "optimizer step");
      TORCH_CHECK(backward.size() == 2u && wait.size() == 2u && optimizer.size() == 2u, "rank ", r,
                  ": steps 3 and 4 each need backward, its wait and the optimizer step");
      for (int64_t step = 3; step <= 4; ++step) {
        const auto [b0, b1] = backward.at(step);
        const auto [w0, w1] = wait.at(step);
        TORCH_CHECK(b0 <= w0 && w1 <= b1, "rank ", r, " step ", step, ": the wait is not inside backward");
        double previous_start = b0;
        for (int64_t i = 0; i < buckets; ++i) {
          const auto ready = intervals(events, c10::str("bucket ", i, " ready")).at(step);
          const auto [a0, a1] = intervals(events, c10::str("allreduce bucket ", i)).at(step);
          TORCH_CHECK(ready.first == ready.second, "bucket readiness is an instant");
          TORCH_CHECK(ready.first < a0 && a0 <= a1, "rank ", r, " step ", step, " bucket ", i,
                      ": its allreduce does not start after it is ready (the bucket copied)");
          TORCH_CHECK(a0 >= previous_start, "rank ", r, " step ", step, ": bucket ", i, " started before bucket ",
                      i - 1, " or before backward");
          TORCH_CHECK(a1 <= w1, "rank ", r, " step ", step, ": allreduce of bucket ", i,
                      " ends after backward stopped waiting");
          TORCH_CHECK(a1 <= optimizer.at(step).first, "rank ", r, " step ", step,
                      ": the optimizer step starts before "
                      "the allreduce of bucket ",
                      i, " ended");
          previous_start = a0;
        }
      }
    }
    ddp.set_timeline(nullptr);
  });
}

}  // namespace
