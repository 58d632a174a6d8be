#pragma once

// The state FullyShardedDataParallel and its units share: the flat units (the root's first), the order the units
// ran in, and what happens when (gathers and prefetches in forward and backward, reductions in a fixed order, the end
// of backward). Internal to ddp/fsdp (ddp::detail); Note [sharding a LibTorch module] in ddp/fsdp/sharded_unit.h.

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <ddp/fsdp/flat_unit.h>
#include <ddp/fsdp/fully_sharded.h>
#include <ddp/process_group.h>

namespace ddp::detail {

/// A unit as construction found it: its path in the model ("" for the root), its parameters by name, and its
/// wrapper (null for the root).
struct FoundUnit {
  std::string name;
  std::vector<std::pair<std::string, at::Tensor>> params;
  std::shared_ptr<ShardedUnitImpl> wrapper;
};

class ShardedRun : public std::enable_shared_from_this<ShardedRun> {
 public:
  ShardedRun(ProcessGroup pg, FullyShardOptions options);
  ~ShardedRun();
  ShardedRun(const ShardedRun&) = delete;
  ShardedRun& operator=(const ShardedRun&) = delete;

  /// Registers the gradient hooks (while the parameters are full), shards every unit and attaches the wrappers.
  /// Once, right after construction, on every rank alike.
  void shard(std::vector<FoundUnit> found);

  /// The root's forward begins: drops a failed pass, frees what is gathered (the shards may have stepped since),
  /// gathers the root's parameters. Collective.
  void begin_forward();
  /// The root's forward ended (`completed`: without a throw). The first completed one fixes the units' order.
  void end_forward(bool completed);
  /// A unit's forward: its parameters gathered around `fn(input)` (see FullyShardedDataParallel).
  at::Tensor run_unit(size_t index, const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input);
  /// Autograd reached the unit's output: its parameters are gathered again, the next unit's prefetched.
  void before_backward_of(size_t index);
  /// Registers the hook that calls before_backward_of(index) when `output`'s gradient is computed (the root: index 0,
  /// on the model's output). Nothing when no backward can reach it.
  void track_output(size_t index, const at::Tensor& output);

  /// Whether the forward of some FullyShardedDataParallel of this process is running (for units it did not find).
  static bool forward_running();

  /// Reductions off (FullyShardedDataParallel::NoSyncGuard) or on again; turning them off while off throws.
  void set_sync(bool on);
  bool sync() const { return sync_; }

  /// Every unit records its collectives and the waits for them into `timeline` (null: none).
  void set_timeline(const std::shared_ptr<Timeline>& timeline);

  const std::vector<std::unique_ptr<FlatUnit>>& units() const { return units_; }
  std::vector<std::unique_ptr<FlatUnit>>& units() { return units_; }
  const ProcessGroup& process_group() const { return pg_; }
  const FullyShardOptions& options() const { return options_; }
  int64_t gathered_bytes() const;
  int64_t peak_gathered_bytes() const { return peak_gathered_; }
  void reset_peak() {
    peak_gathered_ = gathered_bytes();
    peak_reduction_ = reduction_bytes();
  }
  /// Bytes of the reductions' full-size gradient buffers now in flight.
  int64_t reduction_bytes() const;
  int64_t peak_reduction_bytes() const { return peak_reduction_; }

 private:
  void on_grad_ready(size_t unit, size_t param);
  void begin_backward_pass();
  void launch_ready_reductions(bool all);
  void finish_backward();
  void clear_pass() noexcept;
  void note_peak();  ///< peak_gathered_ over what is gathered now
  void prefetch(size_t index);
  int position_of(size_t index) const;

  ProcessGroup pg_;
  FullyShardOptions options_;
  std::vector<std::unique_ptr<FlatUnit>> units_;
  std::vector<std::weak_ptr<ShardedUnitImpl>> wrappers_;
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks_;

  std::recursive_mutex mutex_;  // hooks run on autograd's threads (CUDA); the autograd function re-enters
  bool in_forward_ = false;
  bool sync_ = true;
  bool in_backward_ = false;
  std::vector<size_t> order_;  ///< the reductions' order, reversed: the root, units that did not run, the rest
  std::vector<size_t> ran_;    ///< the units of the first completed forward in the order they ran (root first)
  bool order_known_ = false;
  std::vector<size_t> seen_;  ///< the units of the forward now running, in order (until the order is known)
  size_t launched_ = 0;       ///< reductions launched this pass, in reverse order_
  int64_t peak_gathered_ = 0;
  int64_t peak_reduction_ = 0;
  FlatUnit* in_flight_ = nullptr;  ///< the last reduction launched and not yet finished
};

}  // namespace ddp::detail
