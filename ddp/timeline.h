#pragma once

// A timeline of chosen training steps (docs/observability.md): per rank, when each phase of a step ran (forward,
// backward, the optimizer step), when each gradient bucket became ready, when its allreduce started and ended, and
// when amp unscaled it. DistributedDataParallel::set_timeline records the buckets; the training loop records its
// phases. Exported as Chrome trace JSON (Perfetto, chrome://tracing: the format PyTorch's profiler writes).
//
// Clocks: on the CPU every time is the host's steady clock, taken on the thread that saw it happen (an allreduce's
// end on Gloo's communication thread, in the work's completion callback). On CUDA an interval is a pair of timing
// events on the stream it ran on, read only by resolve() after the window (never inside a step: no host sync in the
// window), and placed on the host clock through one final event that resolve() records and waits for.

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace ddp {

class ProcessGroup;

/// One interval of a rank's timeline (an instant when start_us == end_us).
struct TimelineEvent {
  std::string name;     ///< "forward", "backward", "optimizer step", "allreduce bucket 2", "unscale bucket 2", ...
  std::string lane;     ///< the row it is drawn on: "step" (the loop's phases), "buckets" (readiness), "comm", "amp"
  int64_t step = 0;     ///< the training step (1-based, of the run) it belongs to
  int64_t bucket = -1;  ///< the gradient bucket, or -1
  double start_us = 0;  ///< microseconds on the host's steady clock (gather_timeline may shift it, see there)
  double end_us = 0;    ///< as start_us; equal to it for an instant
};

/// The most steps a TimelineWindow may span: a window is for a close look at a few steps (each keeps its events, on
/// CUDA their timing events, until resolve()).
constexpr int64_t kMaxTimelineSteps = 50;
/// Steps [first_step, last_step] (1-based, inclusive) of a run are recorded; at most kMaxTimelineSteps steps.
struct TimelineWindow {
  int64_t first_step = 1;  ///< the first step recorded, >= 1
  int64_t last_step = 1;   ///< the last step recorded, >= first_step
};

/// Records the events of the steps of its window. Thread-safe: the communication thread adds events too.
class Timeline {
 public:
  using Clock = std::chrono::steady_clock;  ///< the host clock of every time

  /// Records steps `window.first_step`..`window.last_step`. Throws std::invalid_argument when first_step < 1,
  /// last_step < first_step, or the window is longer than kMaxTimelineSteps.
  explicit Timeline(TimelineWindow window);

  /// The steps it records, as given.
  const TimelineWindow& window() const { return window_; }
  /// Step `step` (1-based, of the run) begins.
  void begin_step(int64_t step);
  /// The step begun last has ended: nothing is recorded until the next begin_step inside the window.
  void end_step();
  /// Whether a step inside the window is in progress (events are kept only then).
  bool recording() const;
  /// Whether the window's last step has ended.
  bool finished() const;
  /// The step in progress (0 before the first).
  int64_t step() const;

  /// A point in time: the host clock now (CPU), or a timing event recorded on `stream` now (CUDA).
  struct Mark {
    std::optional<Clock::time_point> host;  ///< the host time (CPU); nullopt for a device mark
    std::shared_ptr<c10::Event> event;      ///< the recorded timing event (CUDA); null for a host mark
  };
  /// Now on the host, or on `stream` when it is a CUDA stream (the event completes when the stream gets there).
  static Mark mark(const std::optional<c10::Stream>& stream = std::nullopt);
  /// Adds the interval [start, end] of the step in progress to `lane` (nothing when not recording). Never throws for
  /// what it is given (DDP calls it from its autograd hooks).
  void add(const std::string& name, const std::string& lane, const Mark& start, const Mark& end, int64_t bucket = -1);
  /// The same with host times.
  void add(const std::string& name, const std::string& lane, Clock::time_point start, Clock::time_point end,
           int64_t bucket = -1);

  /// Turns the device events of the window into host times and returns every event, in the order they were added: a
  /// device mark's time is the moment a final event, recorded now on its device's current stream and waited for (a
  /// host sync: call it after the window), completed, less the device time from the mark to that event. Without
  /// device events it only copies.
  std::vector<TimelineEvent> resolve();

 private:
  struct Pending {
    TimelineEvent event;
    Mark start;
    Mark end;
  };

  TimelineWindow window_;
  mutable std::mutex mutex_;
  int64_t step_ = 0;
  bool in_step_ = false;
  bool finished_ = false;
  std::vector<Pending> pending_;
};

/// When a collective completed, taken on the thread that completed it (Gloo's communication thread, in its future's
/// callback): what a timeline's "comm" lane shows as the collective's end, where the host learns it only at the wait.
class CompletionTime {
 public:
  /// Starts watching `work`; null when the work has no future (NCCL's: the caller takes its end another way).
  static std::shared_ptr<CompletionTime> watch(const c10::intrusive_ptr<c10d::Work>& work);
  /// When the work completed; `fallback` when the callback has not run yet (it may run just after the wait returns).
  Timeline::Clock::time_point at_or(Timeline::Clock::time_point fallback) const;

 private:
  mutable std::mutex mutex_;
  std::optional<Timeline::Clock::time_point> at_;
};

/// Microseconds of `time` on the steady clock (the unit of TimelineEvent's times).
double steady_microseconds(Timeline::Clock::time_point time);

/// Every rank's events, gathered to every rank (collective over `group`; two allgathers of bytes). Rank r's events
/// are element r. Each rank's times stay on its own host's steady clock: ranks on one host share it (CLOCK_MONOTONIC);
/// on several hosts the rows are each shifted to begin at the window's first step (see gather_timeline's note in
/// docs/observability.md).
std::vector<std::vector<TimelineEvent>> gather_timeline(const ProcessGroup& group,
                                                        const std::vector<TimelineEvent>& events);

/// Chrome trace JSON ("traceEvents": complete events "ph": "X", instants "ph": "i", in microseconds) of per-rank
/// events: one process per rank ("rank r"), one thread per lane. Times are shifted so that the earliest event starts at
/// 0.
std::string chrome_trace_json(const std::vector<std::vector<TimelineEvent>>& per_rank);

/// The event DistributedDataParallel adds to the "step" lane from the moment autograd has produced every gradient
/// (its end-of-backward callback) until every bucket's allreduce has ended and been written back: the time backward
/// waits on communication.
constexpr const char* kAllreduceWaitEvent = "allreduce wait";

/// The share (0..1) of `rank_events`' allreduce time ("comm" lane) that ran while autograd was still computing
/// gradients (before the step's kAllreduceWaitEvent began), over the window's steps: 1 means the communication hid
/// entirely behind backward, 0 that it all ran after. nullopt without allreduces of nonzero length.
std::optional<double> allreduce_overlap(const std::vector<TimelineEvent>& rank_events);

/// The share (0..1) of `rank_events`' time in collectives named `collective` ("all-gather", "reduce-scatter": full
/// sharding's, "comm" lane) during which the host did not wait for them ("wait" lane: "wait <collective> ..."): 1
/// minus the waits over the collectives' time. 1 means they hid entirely behind compute, 0 that the host waited
/// throughout. nullopt without such collectives of nonzero length.
std::optional<double> collective_hidden_share(const std::vector<TimelineEvent>& rank_events,
                                              const std::string& collective);

}  // namespace ddp
