#include <ddp/distributed_data_parallel.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

#include <ATen/Functions.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <ddp/bucket_copy.h>
#include <ddp/hash.h>
#include <ddp/shard_layout.h>

namespace ddp {
namespace {

constexpr double kBytesPerMb = 1024.0 * 1024.0;
constexpr int kRoot = 0;  // the rank whose parameters and buffers every rank starts from

using Clock = std::chrono::steady_clock;

/// Tensors grouped by (dtype, device) in first-appearance order: one flat buffer, so one collective, per group.
std::vector<std::vector<at::Tensor>> group_by_dtype_and_device(const std::vector<at::Tensor>& tensors) {
  std::vector<std::vector<at::Tensor>> groups;
  std::vector<std::pair<c10::ScalarType, c10::Device>> keys;
  for (const at::Tensor& t : tensors) {
    const std::pair<c10::ScalarType, c10::Device> key{t.scalar_type(), t.device()};
    auto it = std::find(keys.begin(), keys.end(), key);
    if (it == keys.end()) {
      keys.push_back(key);
      groups.emplace_back();
      it = keys.end() - 1;
    }
    groups[static_cast<size_t>(it - keys.begin())].push_back(t);
  }
  return groups;
}

int64_t total_elements(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const at::Tensor& t : tensors) n += t.numel();
  return n;
}

/// Overwrites `tensors` on every rank with rank 0's values. Collective.
void broadcast_from_root(const ProcessGroup& pg, const std::vector<at::Tensor>& tensors) {
  if (pg.size() == 1 || tensors.empty()) return;
  c10::NoGradGuard no_grad;  // parameters are leaves that require grad; writing them is not part of the graph
  for (const auto& group : group_by_dtype_and_device(tensors)) {
    at::Tensor flat = at::empty({total_elements(group)}, group.front().options());
    if (pg.rank() == kRoot) detail::copy_into_bucket(flat, group, 1.0);
    pg.broadcast_(flat, kRoot);
    if (pg.rank() != kRoot) detail::copy_from_bucket(flat, group, 1.0);
  }
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

/// One line per parameter and buffer, then the options that shape the buckets: what must agree across ranks
/// (different bucket layouts would pair up unrelated allreduces).
std::vector<std::string> describe(const torch::nn::Module& module, const DistributedDataParallelOptions& o) {
  std::vector<std::string> lines;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    lines.push_back(c10::str("parameter ", p.key(), " ", p.value().sizes(), " ", p.value().scalar_type(),
                             p.value().requires_grad() ? "" : " (requires_grad=false)"));
  }
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    lines.push_back(c10::str("buffer ", b.key(), " ", b.value().sizes(), " ", b.value().scalar_type()));
  }
  lines.push_back(c10::str("option bucket_cap_mb=", o.bucket_cap_mb(), " first_bucket_mb=", o.first_bucket_mb(),
                           " allreduce_dtype=", o.allreduce_dtype() ? c10::toString(*o.allreduce_dtype()) : "grad",
                           " broadcast_buffers=", o.broadcast_buffers(), " delay_allreduce=", o.delay_allreduce(),
                           " find_unused_parameters=", o.find_unused_parameters(), " rebuild_buckets=",
                           o.rebuild_buckets(), " gradient_predivide_factor=", o.gradient_predivide_factor()));
  return lines;
}

/// Throws on every rank, with the same message, when the ranks' modules differ. Two collectives when they agree
/// (a hash), two more when they do not (the descriptions), so every rank reaches the same verdict: no rank
/// proceeds to a broadcast that the others skip. Construction only, so reading the results on the host is fine.
void verify_same_model_on_all_ranks(const ProcessGroup& pg, const torch::nn::Module& module,
                                    const DistributedDataParallelOptions& options) {
  if (pg.size() == 1) return;
  std::string mine;
  for (const auto& line : describe(module, options)) mine += line + "\n";
  const at::Tensor summary =
      at::tensor({static_cast<int64_t>(fnv1a64(mine.data(), mine.size())), static_cast<int64_t>(mine.size())},
                 at::kLong)
          .to(pg.device());
  std::vector<at::Tensor> summaries = pg.allgather(summary);
  for (at::Tensor& s : summaries) s = s.cpu();
  int64_t longest = 0;
  bool all_equal = true;
  for (const at::Tensor& s : summaries) {
    all_equal = all_equal && s[0].item<int64_t>() == summaries[0][0].item<int64_t>();
    longest = std::max(longest, s[1].item<int64_t>());
  }
  if (all_equal) return;

  at::Tensor bytes = at::zeros({longest}, at::kByte);
  std::memcpy(bytes.data_ptr<uint8_t>(), mine.data(), mine.size());
  const std::vector<at::Tensor> all_bytes = pg.allgather(bytes.to(pg.device()));
  std::vector<std::vector<std::string>> lines;
  for (size_t r = 0; r < all_bytes.size(); ++r) {
    const at::Tensor host = all_bytes[r].cpu();
    const auto* data = reinterpret_cast<const char*>(host.data_ptr<uint8_t>());
    lines.push_back(split_lines(std::string(data, static_cast<size_t>(summaries[r][1].item<int64_t>()))));
  }
  // Everyone compares rank 0 with the first rank that differs from it, so every rank names the same entry.
  for (size_t r = 1; r < lines.size(); ++r) {
    if (lines[r] == lines[0]) continue;
    size_t i = 0;
    while (i < lines[0].size() && i < lines[r].size() && lines[0][i] == lines[r][i]) ++i;
    auto entry = [&](size_t rank) { return i < lines[rank].size() ? "'" + lines[rank][i] + "'" : "nothing"; };
    TORCH_CHECK(false, "DistributedDataParallel: the module or the options differ across ranks (checked on rank ",
                pg.rank(), "): entry #", i, " is ", entry(0), " on rank 0 but ", entry(r), " on rank ", r,
                ". Every rank must build the same model with the same options.");
  }
}

void check_options(const DistributedDataParallelOptions& o) {
  TORCH_CHECK(o.bucket_cap_mb() > 0, "bucket_cap_mb must be > 0, got ", o.bucket_cap_mb());
  TORCH_CHECK(o.first_bucket_mb() > 0, "first_bucket_mb must be > 0, got ", o.first_bucket_mb());
  TORCH_CHECK(o.gradient_predivide_factor() > 0, "gradient_predivide_factor must be > 0, got ",
              o.gradient_predivide_factor());
  if (o.allreduce_dtype()) {
    const c10::ScalarType t = *o.allreduce_dtype();
    TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble,
                "allreduce_dtype must be Float, Half, BFloat16 or Double, got ", t);
  }
}

}  // namespace

class DistributedDataParallel::Impl {
 public:
  Impl(std::shared_ptr<torch::nn::Module> module, ProcessGroup pg, Options options)
      : module_(std::move(module)), pg_(std::move(pg)), options_(std::move(options)) {
    TORCH_CHECK(module_, "DistributedDataParallel: module is null");
    check_options(options_);
    verify_same_model_on_all_ranks(pg_, *module_, options_);
    broadcast_from_root(pg_, module_->parameters(/*recurse=*/true));
    broadcast_from_root(pg_, module_->buffers(/*recurse=*/true));
    for (const auto& p : module_->named_parameters(/*recurse=*/true)) {
      if (p.value().requires_grad()) params_.push_back({p.value(), p.key(), -1, false});
    }
    std::vector<int64_t> reverse_registration(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) reverse_registration[i] = static_cast<int64_t>(params_.size() - 1 - i);
    build_buckets(reverse_registration);
    rebuilt_ = !options_.rebuild_buckets();  // the layout is final: nothing to record or agree on
    register_hooks();
    if (!params_.empty() && params_.front().tensor.is_cuda()) {
      const c10::Device device = params_.front().tensor.device();
      comm_stream_ =
          c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device, /*isHighPriority=*/true);
    }
  }

  ~Impl() {
    for (auto& [accumulator, key] : hooks_) accumulator->del_post_hook(key);
  }

  void before_forward() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (in_backward_) reset_iteration();  // the previous backward threw before its end-of-backward callback
      // Only in a training forward after this rank's first complete synchronized backward: synchronized backward
      // passes are collective, so every rank reaches this point in the same forward, and an eval or no_sync
      // forward stays free of collectives (as without rebuild_buckets).
      if (!rebuilt_ && !observed_order_.empty() && sync_enabled_ && c10::GradMode::is_enabled()) {
        rebuild_buckets(observed_order_, /*restoring=*/false);
      }
    }
    if (options_.broadcast_buffers()) broadcast_from_root(pg_, module_->buffers(/*recurse=*/true));
  }

  void set_sync(bool enabled) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(enabled || sync_enabled_, "DistributedDataParallel::no_sync() scopes do not nest");
    sync_enabled_ = enabled;
  }

  std::vector<BucketInfo> bucket_infos() const {
    std::vector<BucketInfo> infos;
    for (const Bucket& b : buckets_) {
      BucketInfo info;
      for (int64_t p : b.params) info.parameter_names.push_back(params_[p].name);
      info.num_elements = b.numel;
      info.bytes =
          static_cast<int64_t>(b.buffer.nbytes()) + (b.shard.defined() ? static_cast<int64_t>(b.shard.nbytes()) : 0);
      info.dtype = b.buffer.scalar_type();
      info.device = b.buffer.device();
      infos.push_back(std::move(info));
    }
    return infos;
  }

  std::vector<int64_t> gradient_order() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return rebuilt_ ? rebuilt_order_ : observed_order_;
  }

  void restore_gradient_order(const std::vector<int64_t>& order) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!in_backward_, "DistributedDataParallel::restore_gradient_order: called during a backward pass");
    TORCH_CHECK(!frozen_,
                "DistributedDataParallel::restore_gradient_order: the bucket layout is frozen (ZeRO attached "
                "to it); restore the order before amp::Optimizer::attach");
    rebuild_buckets(order, /*restoring=*/true);
  }

  void freeze_bucket_layout() {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!in_backward_, "DistributedDataParallel::freeze_bucket_layout: called during a backward pass");
    rebuilt_ = true;  // no rebuild, no collective for it
    observed_order_.clear();
    frozen_ = true;
  }

  void set_gradient_sharding(bool enabled) {
    freeze_bucket_layout();
    std::lock_guard<std::mutex> lock(mutex_);
    sharded_ = enabled;
    for (Bucket& b : buckets_) {
      if (!enabled) {
        b.buffer = at::empty({b.numel}, b.buffer.options());
        b.wire = b.shard = at::Tensor();
        continue;
      }
      // Between backward passes a rank keeps only its slice of each bucket: the flat bucket and the padded wire
      // buffer live from the bucket's launch to the end of backward (launch()).
      b.shards = shard_bucket(b.numel, pg_.size());
      b.buffer = at::empty({0}, b.buffer.options());
    }
  }

  bool gradient_sharding() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return sharded_;
  }

  std::shared_ptr<torch::nn::Module> module_;
  ProcessGroup pg_;
  Options options_;
  std::function<void(const ReducedBucket&)> bucket_reduced_hook_;
  std::function<bool(const ReducedBucket&)> bucket_consumer_;
  BackwardTimeline timeline_;

 private:
  struct Param {
    at::Tensor tensor;
    std::string name;
    int64_t bucket;
    bool ready;  // its gradient was accumulated in the current backward pass
  };
  struct Bucket {
    std::vector<int64_t> params;
    at::Tensor buffer;
    int64_t pending = 0;  // parameters of the bucket whose gradient is not ready yet
    c10::intrusive_ptr<c10d::Work> work;
    int64_t numel = 0;  // elements of all its gradients
    // Gradient sharding only: the split, the padded input of the reduce-scatter (slice q at q * chunk), its output.
    BucketShards shards;
    at::Tensor wire, shard;
  };

  /// Buckets of one dtype and device each, filled in `order` (a permutation of the parameter indices: the order in
  /// which backward is expected to produce gradients): the first bucket of each kind is capped at first_bucket_mb,
  /// the others at bucket_cap_mb, and a bucket closes once it reaches its cap.
  void build_buckets(const std::vector<int64_t>& order) {
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
  void rebuild_buckets(const std::vector<int64_t>& proposed, bool restoring) {
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
  bool is_permutation(const std::vector<int64_t>& order) const {
    if (order.size() != params_.size()) return false;
    std::vector<bool> seen(params_.size(), false);
    for (const int64_t i : order) {
      if (i < 0 || i >= static_cast<int64_t>(params_.size()) || seen[static_cast<size_t>(i)]) return false;
      seen[static_cast<size_t>(i)] = true;
    }
    return true;
  }

  void register_hooks() {
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
  void on_gradient_ready(int64_t index) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!sync_enabled_) return;
    const auto now = Clock::now();
    if (!in_backward_) {
      in_backward_ = true;
      std::fill(timeline_.bucket_issued.begin(), timeline_.bucket_issued.end(), BackwardTimeline::TimePoint{});
      timeline_.first_gradient_ready = now;
      torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
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
  void launch_ready_buckets() {
    while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) launch(next_bucket_++);
  }

  void launch(size_t index) {
    Bucket& b = buckets_[index];
    std::vector<at::Tensor> grads;
    grads.reserve(b.params.size());
    for (int64_t pi : b.params) {
      // An unused parameter (find_unused_parameters), or one "ready" without a gradient (a custom autograd function
      // returned none for it), contributes zeros.
      at::Tensor& param = params_[pi].tensor;
      if (!param.grad().defined()) param.mutable_grad() = at::zeros_like(param);
      grads.push_back(param.grad());
    }
    if (sharded_ && pg_.backend_name() == "gloo") {
      // Gloo's reduce-scatter is an allreduce of the whole input followed by taking this rank's chunk (PyTorch
      // #118911): the same bytes on the wire, so allreduce the flat bucket itself (kept in `wire` until the end of
      // backward) and skip the padded copy. finish_backward hands on this rank's slice of it.
      b.wire = at::empty({b.numel}, b.buffer.options());
      detail::copy_into_bucket(b.wire, grads, 1.0 / options_.gradient_predivide_factor());
      b.work = pg_.allreduce_sum_async(b.wire);
    } else if (sharded_) {
      // The flat bucket, then each rank's slice at q * chunk of the padded wire buffer (kept until the end of
      // backward: the reduce-scatter reads it).
      at::Tensor flat = at::empty({b.numel}, b.buffer.options());
      detail::copy_into_bucket(flat, grads, 1.0 / options_.gradient_predivide_factor());
      b.wire = at::zeros({b.shards.chunk * pg_.size()}, b.buffer.options());
      b.shard = at::empty({b.shards.chunk}, b.buffer.options());
      for (int q = 0; q < pg_.size(); ++q) {
        b.wire.narrow(0, q * b.shards.chunk, b.shards.size(q))
            .copy_(flat.narrow(0, b.shards.begin(q), b.shards.size(q)));
      }
      b.work = pg_.reduce_scatter_sum_async(b.shard, b.wire);
    } else {
      detail::copy_into_bucket(b.buffer, grads, 1.0 / options_.gradient_predivide_factor());
      b.work = pg_.allreduce_sum_async(b.buffer);
    }
    timeline_.bucket_issued[index] = Clock::now();
  }

  std::string bucket_name(size_t index) const {
    const Bucket& b = buckets_[index];
    return c10::str(sharded_ ? "reduce-scatter" : "allreduce", " of gradient bucket ", index, " of ", buckets_.size(),
                    " (", b.params.size(), " parameters, ", params_[b.params.front()].name, " .. ",
                    params_[b.params.back()].name, ")");
  }

  /// The end-of-backward callback: every bucket is started (late ones now), waited for, and its average written
  /// back into .grad.
  void finish_backward() {
    std::lock_guard<std::mutex> lock(mutex_);
    timeline_.backward_finished = Clock::now();
    struct ResetAtExit {
      Impl* impl;
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
      ReducedBucket reduced{static_cast<int64_t>(i), b.buffer, {}, {}, 0, average_scale, caller_stream};
      if (sharded_) {
        const at::Tensor& received = pg_.backend_name() == "gloo"
                                         ? b.wire.narrow(0, b.shards.begin(pg_.rank()), b.shards.size(pg_.rank()))
                                         : b.shard;
        reduced.buffer = received.narrow(0, 0, b.shards.size(pg_.rank()));
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
        if (b.wire.defined()) b.wire.record_stream(*comm_stream_);
        if (b.shard.defined()) b.shard.record_stream(*comm_stream_);
        for (const at::Tensor& grad : reduced.grads) {
          if (grad.defined()) grad.record_stream(*comm_stream_);
        }
      }
      try {
        const bool consumed = bucket_consumer_ && bucket_consumer_(reduced);
        TORCH_CHECK(consumed || !sharded_, "DistributedDataParallel: bucket ", i,
                    " was reduce-scattered (gradient sharding, ZeRO stage 2) but no consumer took it: under ZeRO stage "
                    "2 every synchronized backward must run inside amp::scale_loss with delay_unscale=false "
                    "(accumulate under no_sync)");
        if (!consumed) detail::copy_from_bucket(b.buffer, reduced.grads, average_scale);
        if (bucket_reduced_hook_) bucket_reduced_hook_(reduced);
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
  }

  void reset_iteration() {
    for (Param& p : params_) p.ready = false;
    ready_order_.clear();
    for (Bucket& b : buckets_) {
      b.pending = static_cast<int64_t>(b.params.size());
      b.work.reset();
      b.wire = b.shard = at::Tensor();  // gradient sharding: the wire buffers live for one backward
    }
    next_bucket_ = 0;
    in_backward_ = false;
  }

  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks_;
  mutable std::mutex mutex_;
  size_t next_bucket_ = 0;
  bool in_backward_ = false;
  bool sync_enabled_ = true;
  std::vector<int64_t> ready_order_;     // parameters in the order this backward pass produced their gradients
  std::vector<int64_t> observed_order_;  // the order of the last complete synchronized pass, until rebuilt
  std::vector<int64_t> rebuilt_order_;   // the order the rebuilt buckets follow (empty: not rebuilt from one)
  bool rebuilt_ = false;
  bool frozen_ = false;                     // freeze_bucket_layout(): never rebuilt or restored again
  bool sharded_ = false;                    // set_gradient_sharding(true): buckets are reduce-scattered
  std::optional<c10::Stream> comm_stream_;  // CUDA only
  std::optional<c10::Event> join_event_;    // orders the caller's stream after the write-back (CUDA only)
};

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 torch::nn::AnyModule any_module, ProcessGroup process_group,
                                                 Options options)
    : any_module_(std::move(any_module)),
      impl_(std::make_unique<Impl>(std::move(module), std::move(process_group), std::move(options))) {}

DistributedDataParallel::DistributedDataParallel(DistributedDataParallel&&) noexcept = default;
DistributedDataParallel& DistributedDataParallel::operator=(DistributedDataParallel&&) noexcept = default;
DistributedDataParallel::~DistributedDataParallel() = default;

void DistributedDataParallel::before_forward() { impl_->before_forward(); }

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp) : ddp_(ddp) {
  ddp_.impl_->set_sync(false);
}
DistributedDataParallel::NoSyncGuard::~NoSyncGuard() { ddp_.impl_->set_sync(true); }

void DistributedDataParallel::set_bucket_reduced_hook(std::function<void(const ReducedBucket&)> hook) {
  impl_->bucket_reduced_hook_ = std::move(hook);
}

void DistributedDataParallel::set_bucket_consumer(std::function<bool(const ReducedBucket&)> consumer) {
  impl_->bucket_consumer_ = std::move(consumer);
}

const std::shared_ptr<torch::nn::Module>& DistributedDataParallel::module() const { return impl_->module_; }
const ProcessGroup& DistributedDataParallel::process_group() const { return impl_->pg_; }
const DistributedDataParallel::Options& DistributedDataParallel::options() const { return impl_->options_; }
std::vector<BucketInfo> DistributedDataParallel::buckets() const { return impl_->bucket_infos(); }
std::vector<int64_t> DistributedDataParallel::gradient_order() const { return impl_->gradient_order(); }
void DistributedDataParallel::restore_gradient_order(const std::vector<int64_t>& order) {
  impl_->restore_gradient_order(order);
}
void DistributedDataParallel::freeze_bucket_layout() { impl_->freeze_bucket_layout(); }
void DistributedDataParallel::set_gradient_sharding(bool enabled) { impl_->set_gradient_sharding(enabled); }
bool DistributedDataParallel::gradient_sharding() const { return impl_->gradient_sharding(); }
const BackwardTimeline& DistributedDataParallel::last_backward_timeline() const { return impl_->timeline_; }

}  // namespace ddp
