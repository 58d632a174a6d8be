#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>
#include <torch/arg.h>
#include <torch/detail/static.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <ddp/module_forward.h>
#include <ddp/process_group.h>
#include <ddp/timeline.h>

namespace ddp {

/// Options of DistributedDataParallel: bucket caps, what is synchronized and how. The constructor checks them and
/// throws c10::Error for a cap or predivide factor <= 0, or an allreduce_dtype other than Float, Half, BFloat16 or
/// Double.
struct DistributedDataParallelOptions {
  /// Largest bucket, in MB (2^20 bytes) of gradient in the allreduce dtype. A parameter larger than the cap gets
  /// a bucket of its own.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Cap of the first bucket (the last layers' gradients, ready first): small, so communication starts early.
  TORCH_ARG(double, first_bucket_mb) = 1.0;
  /// Broadcast the module's buffers (BatchNorm statistics) from rank 0 before every forward().
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Allow parameters that get no gradient in a backward pass: they contribute zeros to the average (their
  /// buckets are then reduced at the end of backward). Without it, such a parameter is an error naming it.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Apex's delay_allreduce: reduce all buckets after backward instead of overlapping with it (a baseline).
  TORCH_ARG(bool, delay_allreduce) = false;
  /// Gradients are divided by this before the allreduce and by world_size / factor after it (Apex's
  /// gradient_predivide_factor): > 1 keeps fp16 sums of many ranks in range. Must be > 0.
  TORCH_ARG(double, gradient_predivide_factor) = 1.0;
  /// dtype of the buckets on the wire: the gradients' own (nullopt), kFloat (reduce fp16/bf16 gradients in
  /// fp32), or kBFloat16 / kHalf (compress fp32 gradients to half the bytes).
  TORCH_ARG(std::optional<c10::ScalarType>, allreduce_dtype) = std::nullopt;
  /// Rebuild the buckets once, at the first training forward() (grad mode on, outside no_sync) after a synchronized
  /// backward pass, from the order in which that pass produced the gradients (rank 0's order, broadcast, so every
  /// rank builds the same layout): buckets then fill in the order backward really fills them, even when
  /// registration order is not use order. Same caps.
  TORCH_ARG(bool, rebuild_buckets) = true;
};

/// One bucket's layout, for inspection.
struct BucketInfo {
  std::vector<std::string> parameter_names;  ///< in bucket order (reverse registration order until rebuilt)
  /// Gradient elements of all its parameters together.
  int64_t num_elements = 0;
  c10::ScalarType dtype = c10::kFloat;  ///< the allreduce dtype
  /// The device of the bucket and of its parameters.
  c10::Device device = c10::kCPU;
  /// Storage the bucket keeps between backward passes: its flat buffer; none under gradient sharding (the flat
  /// buffer, the padded wire buffer and the received slice then live from its launch to the end of backward).
  int64_t bytes = 0;
};

/// When things happened in the last synchronized backward pass (steady clock), to verify overlap.
struct BackwardTimeline {
  using TimePoint = std::chrono::steady_clock::time_point;  ///< a steady_clock instant
  TimePoint first_gradient_ready;        ///< the first parameter's gradient hook ran (the pass started)
  TimePoint last_gradient_ready;         ///< the last parameter's gradient hook ran
  TimePoint backward_finished;           ///< the end-of-backward callback started
  std::vector<TimePoint> bucket_issued;  ///< per bucket: its allreduce was started
  /// The end-of-backward callback ended: every allreduce waited for and written back (or handed to the consumer).
  /// allreduces_done - backward_finished is the time backward blocked the host on communication (the CPU; on CUDA
  /// the wait is on the streams, so this is only the launch time).
  TimePoint allreduces_done;
};

/// What the bucket hooks see; see DistributedDataParallel::set_bucket_reduced_hook and set_bucket_consumer.
struct ReducedBucket {
  int64_t index = 0;  ///< the bucket's position in buckets(), 0 first
  /// The flat bucket after the allreduce: the sum over ranks of gradient / gradient_predivide_factor, in the
  /// allreduce dtype; grads[i] occupies the next grads[i].numel() elements (no padding), in bucket order.
  at::Tensor buffer;
  /// The bucket's parameters, in bucket order.
  std::vector<at::Tensor> params;
  /// Their .grad tensors (always defined). A consumer sees them holding this rank's local gradients; the reduced
  /// hook sees them after the write-back, holding the average over ranks, or, when a consumer took the bucket,
  /// whatever it left there (amp leaves the unscaled average in masterless gradients).
  std::vector<at::Tensor> grads;
  /// Under gradient sharding (set_gradient_sharding, ZeRO stage 2) buffer holds only this rank's slice of the
  /// reduced bucket: its elements [offset, offset + buffer.numel()) (ddp/shard_layout.h), and grads[] hold the local
  /// gradients only. 0 otherwise.
  int64_t offset = 0;
  /// The factor that turns buffer into the average: gradient_predivide_factor / world_size.
  double average_scale = 1.0;
  /// CUDA: the stream that was current when backward finished, which the caller's later work (the optimizer) runs
  /// on. The hooks themselves run on DDP's communication stream; a tensor a hook allocates and hands to the
  /// caller must be marked with tensor.record_stream(*caller_stream). nullopt on the CPU.
  std::optional<c10::Stream> caller_stream;
};

/// Data-parallel training of one module replicated in every process of `process_group` (one device per
/// process). At construction it checks that every rank has the same parameters and buffers (names, shapes,
/// dtypes; a mismatch throws on every rank naming the first differing one, without hanging) and broadcasts
/// them from rank 0. Then every backward pass through the module's parameters averages their gradients over
/// the ranks: autograd hooks copy gradients into buckets as they become ready and start each bucket's
/// allreduce as soon as its last gradient is ready (buckets start in the same order on every rank), so
/// communication overlaps the rest of backward; at the end of backward the averaged values are written back to
/// the parameters' .grad. loss.backward() returns with averaged gradients; a failed collective or an unused
/// parameter throws out of backward().
///
/// The module must not change its parameters (device, dtype, set) after construction. While the object lives,
/// every backward through the module's parameters synchronizes, except inside no_sync(). Not copyable; movable.
/// Buckets start in reverse parameter order and are rebuilt once from the observed gradient order (see
/// rebuild_buckets). On CUDA the averaged gradients are written back on a communication stream of DDP's own, which
/// the caller's stream waits for (without blocking the host) before backward returns.
class DistributedDataParallel {
 public:
  using Options = DistributedDataParallelOptions;  ///< the options type

  /// Wraps `module` (a shared_ptr to any torch::nn::Module subclass). When the module has a single forward(),
  /// DistributedDataParallel::forward() calls it.
  template <typename ModuleType>
  DistributedDataParallel(std::shared_ptr<ModuleType> module, ProcessGroup process_group, Options options = {})
      : DistributedDataParallel(std::static_pointer_cast<torch::nn::Module>(module), detail::ModuleForward::of(module),
                                std::move(process_group), std::move(options)) {}

  /// Wraps the module held by a ModuleHolder (torch::nn::Linear, TORCH_MODULE(Net), ...).
  template <typename ModuleType>
  DistributedDataParallel(const torch::nn::ModuleHolder<ModuleType>& module, ProcessGroup process_group,
                          Options options = {})
      : DistributedDataParallel(module.ptr(), std::move(process_group), std::move(options)) {}

  /// Takes over the source's module, hooks and buckets; the source may then only be destroyed or assigned to.
  DistributedDataParallel(DistributedDataParallel&&) noexcept;
  /// Takes over the right-hand side's module, hooks and buckets, releasing this object's own.
  DistributedDataParallel& operator=(DistributedDataParallel&&) noexcept;
  ~DistributedDataParallel();

  /// Calls before_forward(), then the module's forward(args...). Needs a module with a single forward(), or a
  /// torch::nn::Sequential.
  template <typename ReturnType = at::Tensor, typename... Args>
  ReturnType forward(Args&&... args) {
    TORCH_CHECK(forward_.callable(),
                "DistributedDataParallel::forward: the module has no single forward(); call before_forward() and "
                "then the module's own forward");
    before_forward();
    return forward_.call<ReturnType>(std::forward<Args>(args)...);
  }

  /// What forward() does before calling the module: once, in the first training forward after a synchronized
  /// backward, agrees on and applies rank 0's observed gradient order (rebuild_buckets); broadcasts buffers from
  /// rank 0 when broadcast_buffers is set; and discards the state of a backward pass that did not finish (it
  /// threw). Collective when it broadcasts: call it on every rank, or on none. Blocks the host until the
  /// broadcasts are done.
  void before_forward();

  /// RAII scope in which backward passes accumulate gradients locally, without communication (gradient
  /// accumulation); the first backward after the scope averages the accumulated gradients. Not nestable.
  class NoSyncGuard {
   public:
    /// Turns synchronization of `ddp` off until the guard is destroyed. Throws c10::Error when a guard of `ddp` is
    /// already alive. Local: no collective.
    explicit NoSyncGuard(DistributedDataParallel& ddp);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel& ddp_;
  };
  /// A NoSyncGuard for this object: keep it alive for the scope (`auto guard = ddp.no_sync();`).
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  /// An observer of reduced gradients: `hook` runs once per bucket, in bucket order, on the thread that finishes
  /// backward, after the bucket's allreduce completed and its averaged gradients were written back (CUDA: on the
  /// communication stream). An empty function removes the hook.
  void set_bucket_reduced_hook(std::function<void(const ReducedBucket&)> hook);

  /// Takes over the write-back of reduced gradients (amp's fused unscale and overflow check, see
  /// amp::Optimizer::attach): `consumer` runs once per bucket, in bucket order, as soon as that bucket's allreduce
  /// completed, on the thread that finishes backward (CUDA: on the communication stream, ordered after the
  /// allreduce; the caller's stream waits for it before backward returns). It returns true when it consumed the
  /// bucket (then DDP does not write the average into .grad: the consumer wrote what it wants wherever it wants,
  /// e.g. unscaled into fp32 master gradients), false to let DDP write back as usual. Runs before the reduced
  /// hook. An empty function removes the consumer.
  void set_bucket_consumer(std::function<bool(const ReducedBucket&)> consumer);

  /// The wrapped module.
  const std::shared_ptr<torch::nn::Module>& module() const;
  /// The process group the gradients are averaged over.
  const ProcessGroup& process_group() const;
  /// The options given at construction.
  const Options& options() const;
  /// The current bucket layout, in bucket (launch) order. Local: no collective.
  std::vector<BucketInfo> buckets() const;

  /// The gradient order the buckets follow from the next training forward() on, as indices into the module's
  /// parameters that require grad (registration order): once the buckets are rebuilt, rank 0's observed order;
  /// after a synchronized backward that has not rebuilt them yet, the order that rebuild will use (on rank 0; other
  /// ranks return their own observation); empty while none is known (before the first synchronized backward, or
  /// with rebuild_buckets off). A checkpoint written by rank 0 records it so that a resumed run keeps the layout
  /// (restore_gradient_order): with more than 2 ranks the layout decides in which order each element's allreduce
  /// adds, and so its last bits.
  std::vector<int64_t> gradient_order() const;

  /// Rebuilds the buckets now in rank 0's `order` (what gradient_order() returned when the checkpoint was written)
  /// and never again: a resumed run keeps the layout of the run it continues. Collective (one broadcast, as the
  /// rebuild itself): call it on every rank, before the first forward(). An empty order on rank 0 changes nothing
  /// (the buckets are rebuilt after the first backward as usual). Throws on every rank, changing nothing, when rank
  /// 0's order is not a permutation of this module's parameter indices (a checkpoint of another model).
  void restore_gradient_order(const std::vector<int64_t>& order);
  /// Fixes the bucket layout as it is now: no rebuild from the observed gradient order later. ZeRO shards optimizer
  /// state along the buckets, so the layout must not move under it. Call it on every rank, outside backward; a
  /// later restore_gradient_order() is refused.
  void freeze_bucket_layout();
  /// ZeRO stage 2 (amp::Optimizer::attach with amp::ZeroStage::kTwo sets it): each bucket is reduce-scattered
  /// instead of all-reduced (with Gloo, whose reduce-scatter is an allreduce of the whole input: all-reduced, and
  /// the slice taken), as soon as its gradients are ready, and this rank receives only its slice
  /// (ddp::shard_bucket over world_size ranks) of the sum; a bucket consumer must take every bucket (nobody else can
  /// write a whole average back: a bucket nobody takes is an error out of backward). Freezes the bucket layout.
  /// Call it on every rank, outside backward.
  void set_gradient_sharding(bool enabled);
  /// Whether gradient sharding (set_gradient_sharding) is on. Default false.
  bool gradient_sharding() const;
  /// Timestamps of the last backward pass that synchronized.
  const BackwardTimeline& last_backward_timeline() const;
  /// Records every synchronized backward pass of the steps `timeline` records (ddp::Timeline::recording()) into it
  /// (nullptr: stop): per bucket "bucket i ready" (lane "buckets", an instant: its last gradient is ready and its
  /// allreduce is issued), "allreduce bucket i" (lane "comm": issued until ended; on the CPU the end is taken on the
  /// communication thread when the work completes, on CUDA by events on the streams), the consumer's pass over it
  /// ("<consumer_label> bucket i", lane "amp"), and kAllreduceWaitEvent (lane "step"). No host sync. Takes effect
  /// from the next backward pass (nullptr: at once); never throws.
  void set_timeline(std::shared_ptr<Timeline> timeline);
  /// How set_timeline names the bucket consumer's pass ("unscale" for amp's); default "consume".
  void set_bucket_consumer_label(std::string label);

 private:
  class Impl;

  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, detail::ModuleForward forward,
                          ProcessGroup process_group, Options options);

  detail::ModuleForward forward_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddp
