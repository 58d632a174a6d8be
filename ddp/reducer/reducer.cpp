#include <ddp/reducer/reducer.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>

#include <ATen/Functions.h>
#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <ddp/recompute.h>
#include <ddp/reducer/bucket_copy.h>
#include <ddp/reducer/model_sync.h>

namespace ddp::detail {
namespace {
constexpr double kBytesPerMb = 1024.0 * 1024.0;
}  // namespace

Reducer::Reducer(std::vector<std::pair<std::string, at::Tensor>> params, ProcessGroup pg,
                 DistributedDataParallelOptions options)
    : pg_(std::move(pg)), options_(std::move(options)) {
  for (auto& [name, tensor] : params) params_.push_back({std::move(tensor), std::move(name), -1, false});
  std::vector<int64_t> reverse_registration(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) reverse_registration[i] = static_cast<int64_t>(params_.size() - 1 - i);
  build_buckets(reverse_registration);
  rebuilt_ = !options_.rebuild_buckets();  // the layout is final: nothing to record or agree on
  register_hooks();
  if (!params_.empty() && params_.front().tensor.is_cuda()) {
    const c10::Device device = params_.front().tensor.device();
    comm_stream_ = c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device, /*isHighPriority=*/true);
  }
}

Reducer::~Reducer() {
  for (auto& [accumulator, key] : hooks_) accumulator->del_post_hook(key);
}

void Reducer::prepare_forward() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (in_backward_) reset_iteration();  // the previous backward threw before its end-of-backward callback
  // Only in a training forward after this rank's first complete synchronized backward: synchronized backward
  // passes are collective, so every rank reaches this point in the same forward, and an eval or no_sync
  // forward stays free of collectives (as without rebuild_buckets).
  if (!rebuilt_ && !observed_order_.empty() && sync_enabled_ && c10::GradMode::is_enabled()) {
    rebuild_buckets(observed_order_, /*restoring=*/false);
  }
}

void Reducer::set_sync(bool enabled) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(enabled || sync_enabled_, "DistributedDataParallel::no_sync() scopes do not nest");
  sync_enabled_ = enabled;
}

std::vector<BucketInfo> Reducer::bucket_infos() const {
  std::vector<BucketInfo> infos;
  for (const Bucket& b : buckets_) {
    BucketInfo info;
    for (int64_t p : b.params) info.parameter_names.push_back(params_[p].name);
    info.num_elements = b.numel;
    info.bytes = static_cast<int64_t>(b.buffer.nbytes()) +
                 (b.sharded.shard.defined() ? static_cast<int64_t>(b.sharded.shard.nbytes()) : 0);
    info.dtype = b.buffer.scalar_type();
    info.device = b.buffer.device();
    infos.push_back(std::move(info));
  }
  return infos;
}

std::vector<int64_t> Reducer::gradient_order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return rebuilt_ ? rebuilt_order_ : observed_order_;
}

void Reducer::restore_gradient_order(const std::vector<int64_t>& order) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!in_backward_, "DistributedDataParallel::restore_gradient_order: called during a backward pass");
  TORCH_CHECK(!frozen_,
              "DistributedDataParallel::restore_gradient_order: the bucket layout is frozen (ZeRO attached "
              "to it); restore the order before amp::Optimizer::attach");
  rebuild_buckets(order, /*restoring=*/true);
}

void Reducer::freeze_bucket_layout() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!in_backward_, "DistributedDataParallel::freeze_bucket_layout: called during a backward pass");
  rebuilt_ = true;  // no rebuild, no collective for it
  observed_order_.clear();
  frozen_ = true;
}

void Reducer::set_gradient_sharding(bool enabled) {
  freeze_bucket_layout();
  std::lock_guard<std::mutex> lock(mutex_);
  sharded_ = enabled;
  for (Bucket& b : buckets_) {
    if (!enabled) {
      b.buffer = at::empty({b.numel}, b.buffer.options());
      b.sharded = ShardedReduction{};
      continue;
    }
    // Between backward passes a rank keeps only its slice of each bucket: the flat bucket and the padded wire
    // buffer live from the bucket's launch to the end of backward (launch()).
    b.shards = shard_bucket(b.numel, pg_.size());
    b.buffer = at::empty({0}, b.buffer.options());
  }
}

bool Reducer::gradient_sharding() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return sharded_;
}

/// Buckets of one dtype and device each, filled in `order` (a permutation of the parameter indices: the order in
/// which backward is expected to produce gradients): the first bucket of each kind is capped at first_bucket_mb,
/// the others at bucket_cap_mb, and a bucket closes once it reaches its cap.
void Reducer::build_buckets(const std::vector<int64_t>& order) {
  std::vector<Bucket> buckets;  // built aside and swapped in at the end: a failure leaves the old layout intact
  std::vector<int64_t> owner(params_.size(), -1);
  struct Open {
    std::vector<int64_t> params;
    int64_t bytes = 0;
    int closed = 0;
    size_t order;  // position of the bucket among all buckets, by when it was opened
  };
  std::map<std::tuple<c10::ScalarType, c10::DeviceType, c10::DeviceIndex>, Open> open;
  std::vector<std::pair<size_t, std::vector<int64_t>>> done;  // (opening order, params)
  size_t opened = 0;
  for (const int64_t i : order) {
    const at::Tensor& t = params_[i].tensor;
    const c10::ScalarType wire = options_.allreduce_dtype().value_or(t.scalar_type());
    Open& o = open[{t.scalar_type(), t.device().type(), t.device().index()}];
    if (o.params.empty()) o.order = opened++;
    o.params.push_back(i);
    o.bytes += t.numel() * static_cast<int64_t>(c10::elementSize(wire));
    const double cap_mb = o.closed == 0 ? options_.first_bucket_mb() : options_.bucket_cap_mb();
    if (static_cast<double>(o.bytes) >= cap_mb * kBytesPerMb) {
      done.emplace_back(o.order, std::move(o.params));
      o.params.clear();
      o.bytes = 0;
      ++o.closed;
    }
  }
  for (auto& [key, o] : open) {
    if (!o.params.empty()) done.emplace_back(o.order, std::move(o.params));
  }
  std::sort(done.begin(), done.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [order, members] : done) {
    Bucket b;
    b.params = std::move(members);
    int64_t numel = 0;
    for (int64_t p : b.params) {
      numel += params_[p].tensor.numel();
      owner[p] = static_cast<int64_t>(buckets.size());
    }
    const at::Tensor& first = params_[b.params.front()].tensor;
    b.buffer = at::empty({numel}, first.options().dtype(options_.allreduce_dtype().value_or(first.scalar_type())));
    b.numel = numel;
    b.pending = static_cast<int64_t>(b.params.size());
    buckets.push_back(std::move(b));
  }
  buckets_ = std::move(buckets);
  for (size_t i = 0; i < params_.size(); ++i) params_[i].bucket = owner[i];
  timeline_.bucket_issued.assign(buckets_.size(), BackwardTimeline::TimePoint{});
}

/// Every rank rebuilds its buckets in rank 0's `proposed` order (its observed gradient order, or a saved one when
/// `restoring`). Collective: one broadcast of rank 0's order with a flag (none, an order, or, when restoring, an
/// order that does not fit), so the ranks never disagree on the layout, whatever each observed or loaded. A host
/// sync, once.
void Reducer::rebuild_buckets(const std::vector<int64_t>& proposed, bool restoring) {
  enum Flag : int64_t { kNone = 0, kOrder = 1, kUnfit = 2 };
  const auto n = static_cast<int64_t>(params_.size());
  at::Tensor message = at::zeros({n + 1}, at::kLong);  // [flag, order...]
  if (pg_.rank() == kRoot) {
    if (is_permutation(proposed)) {
      message[0] = kOrder;
      std::memcpy(message.data_ptr<int64_t>() + 1, proposed.data(), sizeof(int64_t) * static_cast<size_t>(n));
    } else if (restoring && !proposed.empty()) {
      message[0] = kUnfit;
      message[1] = static_cast<int64_t>(proposed.size());
    }
  }
  if (pg_.size() > 1) {
    at::Tensor on_device = message.to(pg_.device());
    pg_.broadcast_(on_device, kRoot);
    message = on_device.cpu();
  }
  const int64_t flag = message[0].item<int64_t>();
  TORCH_CHECK(flag != kUnfit, "DistributedDataParallel::restore_gradient_order: rank 0's saved gradient order (",
              message[1].item<int64_t>(), " entries) is not an order of this module's ", n,
              " parameters that require grad (a checkpoint of another model?); the layout is unchanged");
  if (flag == kNone && restoring) return;  // nothing saved: rebuild after the first backward as usual
  rebuilt_ = true;                         // whatever rank 0 sent: never another collective here
  observed_order_.clear();
  if (flag == kNone) return;
  std::vector<int64_t> order(message.data_ptr<int64_t>() + 1, message.data_ptr<int64_t>() + 1 + n);
  TORCH_CHECK(is_permutation(order), "DistributedDataParallel: rank ", pg_.rank(),
              " received a corrupt gradient order from rank 0");
  build_buckets(order);
  rebuilt_order_ = std::move(order);
}

/// Whether `order` names each parameter index exactly once.
bool Reducer::is_permutation(const std::vector<int64_t>& order) const {
  if (order.size() != params_.size()) return false;
  std::vector<bool> seen(params_.size(), false);
  for (const int64_t i : order) {
    if (i < 0 || i >= static_cast<int64_t>(params_.size()) || seen[static_cast<size_t>(i)]) return false;
    seen[static_cast<size_t>(i)] = true;
  }
  return true;
}

void Reducer::register_hooks() {
  for (size_t i = 0; i < params_.size(); ++i) {
    std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::grad_accumulator(params_[i].tensor);
    TORCH_CHECK(accumulator, "DistributedDataParallel: parameter ", params_[i].name,
                " has no gradient accumulator (is it a leaf tensor that requires grad?)");
    const uintptr_t key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          on_gradient_ready(static_cast<int64_t>(i));
          return outputs;
        }));
    // Kept alive here: a parameter holds its accumulator weakly, and a new one would not carry our hook.
    hooks_.emplace_back(std::move(accumulator), key);
  }
}

/// Runs after autograd accumulated parameter `index`'s gradient into .grad.
void Reducer::on_gradient_ready(int64_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!sync_enabled_) return;
  const auto now = Clock::now();
  if (!in_backward_) {
    in_backward_ = true;
    recording_ = recorder_ && recorder_->recording();
    std::fill(timeline_.bucket_issued.begin(), timeline_.bucket_issued.end(), BackwardTimeline::TimePoint{});
    timeline_.first_gradient_ready = now;
    // At the end of the outermost backward: the first gradient may come from a nested one (an activation
    // checkpoint's rebuilt block), whose end is not the pass's (ddp/recompute.h).
    queue_end_of_backward([this] { finish_backward(); });
  }
  timeline_.last_gradient_ready = now;
  Param& p = params_[index];
  TORCH_CHECK(!p.ready, "DistributedDataParallel: parameter ", p.name,
              " received its gradient twice in one backward pass (reentrant backward or a shared leaf); this is "
              "not supported");
  p.ready = true;
  if (!rebuilt_) ready_order_.push_back(index);
  --buckets_[p.bucket].pending;
  if (!options_.delay_allreduce()) launch_ready_buckets();
}

/// Starts, in bucket order, every bucket whose gradients are all ready: the same order on every rank, which
/// is what pairs up each rank's collectives.
void Reducer::launch_ready_buckets() {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) launch(next_bucket_++);
}

void Reducer::launch(size_t index) {
  Bucket& b = buckets_[index];
  // Recording a timeline: the bucket is ready now (its last gradient arrived); its collective starts once it is
  // copied into the bucket (under sharding the copy is part of the launch: the start is taken here too).
  const Timeline::Mark ready = recording_ ? Timeline::mark(current_stream()) : Timeline::Mark{};
  std::vector<at::Tensor> grads;
  grads.reserve(b.params.size());
  for (int64_t pi : b.params) {
    // An unused parameter (find_unused_parameters), or one "ready" without a gradient (a custom autograd function
    // returned none for it), contributes zeros.
    at::Tensor& param = params_[pi].tensor;
    if (!param.grad().defined()) param.mutable_grad() = at::zeros_like(param);
    grads.push_back(param.grad());
  }
  const double prescale = 1.0 / options_.gradient_predivide_factor();
  if (sharded_) {
    // Kept until the end of backward (the collective reads the wire buffer): finish_backward hands on this rank's
    // slice.
    if (recording_) b.issued = ready;
    b.sharded = launch_sharded_reduction(pg_, b.shards, b.buffer.options(), grads, prescale);
    b.work = b.sharded.work;
  } else {
    copy_into_bucket(b.buffer, grads, prescale);
    if (recording_) b.issued = Timeline::mark(current_stream());
    b.work = pg_.allreduce_sum_async(b.buffer);
  }
  timeline_.bucket_issued[index] = Clock::now();
  if (recording_) record_issue(index, ready);
}

void Reducer::set_recorder(std::shared_ptr<Timeline> recorder) {
  // Never throws: RunObserver's destructor detaches its timeline, also while an exception leaves a backward pass
  // that never reached its end (in_backward_ stays set until the next forward clears it).
  std::lock_guard<std::mutex> lock(mutex_);
  recorder_ = std::move(recorder);
  if (!recorder_) recording_ = false;
}

std::optional<c10::Stream> Reducer::current_stream() const {
  if (!comm_stream_) return std::nullopt;
  return c10::impl::VirtualGuardImpl(comm_stream_->device_type()).getStream(comm_stream_->device());
}

/// Recording a timeline: bucket `index`, `ready` at that mark, has just had its collective issued. On the CPU its end
/// is taken on the communication thread, when the work completes; on CUDA from an event after the wait
/// (finish_backward).
void Reducer::record_issue(size_t index, const Timeline::Mark& ready) {
  Bucket& b = buckets_[index];
  recorder_->add(c10::str("bucket ", index, " ready"), "buckets", ready, ready, static_cast<int64_t>(index));
  b.completed.reset();
  if (comm_stream_) return;
  b.completed = CompletionTime::watch(b.work);  // null for a work without a future: its end is the wait's return
}

/// Recording a timeline: bucket `index`'s collective has been waited for (on CUDA the communication stream now
/// waits for it): its interval goes into the "comm" lane.
void Reducer::record_completion(size_t index) {
  Bucket& b = buckets_[index];
  Timeline::Mark end;
  if (b.completed) {
    end.host = b.completed->at_or(Clock::now());
  } else {
    end = Timeline::mark(comm_stream_);
  }
  recorder_->add(c10::str(sharded_ ? "reduce-scatter" : "allreduce", " bucket ", index), "comm", b.issued, end,
                 static_cast<int64_t>(index));
}

std::string Reducer::bucket_name(size_t index) const {
  const Bucket& b = buckets_[index];
  return c10::str(sharded_ ? "reduce-scatter" : "allreduce", " of gradient bucket ", index, " of ", buckets_.size(),
                  " (", b.params.size(), " parameters, ", params_[b.params.front()].name, " .. ",
                  params_[b.params.back()].name, ")");
}

/// The end-of-backward callback: every bucket is started (late ones now), waited for, and its average written
/// back into .grad.
void Reducer::finish_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  timeline_.backward_finished = Clock::now();
  const Timeline::Mark wait_began = recording_ ? Timeline::mark(current_stream()) : Timeline::Mark{};
  struct ResetAtExit {
    Reducer* impl;
    ~ResetAtExit() { impl->reset_iteration(); }
  } reset_at_exit{this};

  std::vector<std::string> unused;
  for (const Param& p : params_) {
    if (!p.ready) unused.push_back(p.name);
  }
  if (!unused.empty()) {
    TORCH_CHECK(options_.find_unused_parameters(), "DistributedDataParallel: rank ", pg_.rank(), ": ", unused.size(),
                " parameter(s) got no gradient in this backward pass: ", c10::Join(", ", unused),
                ". Every parameter must take part in computing the loss on every rank, or construct "
                "DistributedDataParallel with find_unused_parameters(true).");
    for (Bucket& b : buckets_) b.pending = 0;
  }
  if (!rebuilt_) {
    // The order this pass produced gradients in; unused parameters last, in reverse registration order.
    observed_order_ = ready_order_;
    for (auto i = static_cast<int64_t>(params_.size()) - 1; i >= 0; --i) {
      if (!params_[i].ready) observed_order_.push_back(i);
    }
  }
  // Late buckets (with unused parameters) go out now; launch() gives a parameter without gradient zeros, on the
  // caller's stream, before anything is read or written on the communication stream.
  launch_ready_buckets();

  // CUDA: waits for the allreduces and writes back on the communication stream; the caller's stream waits for
  // that at the end (also when a wait throws), so nothing here blocks the host.
  std::optional<c10::Stream> caller_stream;
  std::optional<c10::StreamGuard> on_comm_stream;
  if (comm_stream_) {
    caller_stream = c10::impl::VirtualGuardImpl(comm_stream_->device_type()).getStream(comm_stream_->device());
    on_comm_stream.emplace(*comm_stream_);
  }
  struct JoinCallerStream {
    std::optional<c10::Event>& done;  // kept by DDP: no event created per backward
    const std::optional<c10::Stream>& comm;
    const std::optional<c10::Stream>& caller;
    ~JoinCallerStream() {
      if (!comm) return;
      try {
        if (!done) done.emplace(comm->device_type());
        done->record(*comm);
        done->block(*caller);
      } catch (const std::exception& e) {  // a destructor must not throw; the CUDA error resurfaces at the next call
        TORCH_WARN("DistributedDataParallel: could not order the caller's stream after the write-back: ", e.what());
      }
    }
  } join{join_event_, comm_stream_, caller_stream};

  const double average_scale = options_.gradient_predivide_factor() / static_cast<double>(pg_.size());
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    pg_.wait(b.work, bucket_name(i));
    if (recording_) record_completion(i);
    ReducedBucket reduced{static_cast<int64_t>(i), b.buffer, {}, {}, 0, average_scale, caller_stream};
    if (sharded_) {
      reduced.buffer = received_slice(pg_, b.shards, b.sharded);
      reduced.offset = b.shards.begin(pg_.rank());
    }
    for (int64_t pi : b.params) {
      reduced.params.push_back(params_[pi].tensor);
      reduced.grads.push_back(params_[pi].tensor.grad());
    }
    // The bucket and the gradients were allocated on other streams (the forward's and backward's may be any) and
    // are written here on the communication stream: the caching allocator must not hand their memory out again
    // before that work has run, whichever stream frees them (the join event orders only the caller's stream).
    if (comm_stream_) {
      b.buffer.record_stream(*comm_stream_);
      if (b.sharded.wire.defined()) b.sharded.wire.record_stream(*comm_stream_);
      if (b.sharded.shard.defined()) b.sharded.shard.record_stream(*comm_stream_);
      for (const at::Tensor& grad : reduced.grads) {
        if (grad.defined()) grad.record_stream(*comm_stream_);
      }
    }
    try {
      const Timeline::Mark consumer_began = recording_ ? Timeline::mark(comm_stream_) : Timeline::Mark{};
      const bool consumed = bucket_consumer && bucket_consumer(reduced);
      if (recording_ && consumed) {
        recorder_->add(c10::str(bucket_consumer_label, " bucket ", i), "amp", consumer_began,
                       Timeline::mark(comm_stream_), static_cast<int64_t>(i));
      }
      TORCH_CHECK(consumed || !sharded_, "DistributedDataParallel: bucket ", i,
                  " was reduce-scattered (gradient sharding, ZeRO stage 2) but no consumer took it: under ZeRO stage "
                  "2 every synchronized backward must run inside amp::scale_loss with delay_unscale=false "
                  "(accumulate under no_sync)");
      if (!consumed) copy_from_bucket(b.buffer, reduced.grads, average_scale);
      if (bucket_reduced_hook) bucket_reduced_hook(reduced);
    } catch (...) {
      // The collectives are healthy (every rank's consumer refuses alike): let the later buckets' allreduces
      // finish before the buffers can be written again by the next backward. A failed wait (the group itself
      // is broken) is only reported; the consumer's error is the one that surfaces.
      for (size_t j = i + 1; j < buckets_.size(); ++j) {
        if (!buckets_[j].work) continue;
        try {
          pg_.wait(buckets_[j].work, bucket_name(j));
        } catch (const std::exception& e) {
          TORCH_WARN("DistributedDataParallel: while unwinding: ", e.what());
        }
      }
      throw;
    }
  }
  timeline_.allreduces_done = Clock::now();
  if (recording_) recorder_->add(kAllreduceWaitEvent, "step", wait_began, Timeline::mark(comm_stream_));
}

void Reducer::reset_iteration() {
  for (Param& p : params_) p.ready = false;
  ready_order_.clear();
  for (Bucket& b : buckets_) {
    b.pending = static_cast<int64_t>(b.params.size());
    b.work.reset();
    b.sharded = ShardedReduction{};  // gradient sharding: the wire buffers live for one backward
  }
  next_bucket_ = 0;
  in_backward_ = false;
}

}  // namespace ddp::detail
