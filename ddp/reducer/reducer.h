#pragma once

// DistributedDataParallel's reducer, kept apart from the module wrapper as PyTorch keeps its Reducer: the bucket
// layout (built, rebuilt from the observed gradient order, restored, frozen), the autograd hooks that mark gradients
// ready, launching each bucket's collective as soon as its last gradient is ready, and the end-of-backward callback
// that waits for them and hands each reduced bucket to the consumer or writes the average back. Internal to ddp/
// (ddp::detail); the tests' home is tests/ddp/reducer_test.cpp.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>
#include <ddp/reducer/gradient_sharding.h>
#include <ddp/shard_layout.h>
#include <ddp/timeline.h>

namespace torch::autograd {
struct Node;
}

namespace ddp::detail {

class Reducer {
 public:
  /// `params`: (name, parameter) of every parameter that requires grad, in registration order. Registers a hook on
  /// each one's gradient accumulator (removed by the destructor); the first layout fills buckets in reverse
  /// registration order.
  Reducer(std::vector<std::pair<std::string, at::Tensor>> params, ProcessGroup pg,
          DistributedDataParallelOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  /// Before a forward: clears a backward that threw before its end, and rebuilds the buckets once, in the first
  /// training forward after this rank's first complete synchronized backward (collective then).
  void prepare_forward();
  /// no_sync(): false turns the hooks off until true again.
  void set_sync(bool enabled);

  std::vector<BucketInfo> bucket_infos() const;
  std::vector<int64_t> gradient_order() const;
  void restore_gradient_order(const std::vector<int64_t>& order);
  void freeze_bucket_layout();
  void set_gradient_sharding(bool enabled);
  bool gradient_sharding() const;
  const BackwardTimeline& timeline() const { return timeline_; }
  /// DistributedDataParallel::set_timeline.
  void set_recorder(std::shared_ptr<Timeline> recorder);

  std::function<void(const ReducedBucket&)> bucket_reduced_hook;
  std::function<bool(const ReducedBucket&)> bucket_consumer;
  std::string bucket_consumer_label = "consume";

 private:
  using Clock = std::chrono::steady_clock;
  struct Param {
    at::Tensor tensor;
    std::string name;
    int64_t bucket = -1;
    bool ready = false;  ///< its gradient was accumulated in the current backward pass
  };
  struct Bucket {
    std::vector<int64_t> params;
    at::Tensor buffer;
    int64_t pending = 0;  ///< parameters of the bucket whose gradient is not ready yet
    c10::intrusive_ptr<c10d::Work> work;
    int64_t numel = 0;         ///< elements of all its gradients
    BucketShards shards;       ///< gradient sharding only: the split
    ShardedReduction sharded;  ///< gradient sharding only: the buffers of the current backward's reduction
    /// Recording a timeline: when the collective started (the bucket copied), and (CPU) when the communication
    /// thread completed it.
    Timeline::Mark issued;
    std::shared_ptr<CompletionTime> completed;
  };

  void build_buckets(const std::vector<int64_t>& order);
  void rebuild_buckets(const std::vector<int64_t>& proposed, bool restoring);
  bool is_permutation(const std::vector<int64_t>& order) const;
  void register_hooks();
  void on_gradient_ready(int64_t index);
  void launch_ready_buckets();
  void launch(size_t index);
  void record_issue(size_t index, const Timeline::Mark& ready);
  void record_completion(size_t index);
  /// The caller's current stream on the communication stream's device; nullopt on the CPU.
  std::optional<c10::Stream> current_stream() const;
  std::string bucket_name(size_t index) const;
  void finish_backward();
  void reset_iteration();

  ProcessGroup pg_;
  DistributedDataParallelOptions options_;
  BackwardTimeline timeline_;
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks_;
  mutable std::mutex mutex_;
  size_t next_bucket_ = 0;
  bool in_backward_ = false;
  bool sync_enabled_ = true;
  std::vector<int64_t> ready_order_;     ///< parameters in the order this backward pass produced their gradients
  std::vector<int64_t> observed_order_;  ///< the order of the last complete synchronized pass, until rebuilt
  std::vector<int64_t> rebuilt_order_;   ///< the order the rebuilt buckets follow (empty: not rebuilt from one)
  bool rebuilt_ = false;
  bool frozen_ = false;                     ///< freeze_bucket_layout(): never rebuilt or restored again
  bool sharded_ = false;                    ///< set_gradient_sharding(true): buckets are reduce-scattered
  std::optional<c10::Stream> comm_stream_;  ///< CUDA only
  std::optional<c10::Event> join_event_;    ///< orders the caller's stream after the write-back (CUDA only)
  std::shared_ptr<Timeline> recorder_;      ///< set_recorder(); null: no timeline
  bool recording_ = false;                  ///< this backward pass is recorded into recorder_
};

}  // namespace ddp::detail
