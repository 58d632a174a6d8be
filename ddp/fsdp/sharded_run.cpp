#include <ddp/fsdp/sharded_run.h>

#include <algorithm>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <ddp/recompute.h>

namespace ddp::detail {
namespace {

/// Forwards of FullyShardedDataParallel running on this thread (a unit's forward runs on its root's thread).
thread_local int forwards_running = 0;

}  // namespace

bool ShardedRun::forward_running() { return forwards_running > 0; }

ShardedRun::ShardedRun(ProcessGroup pg, FullyShardOptions options) : pg_(std::move(pg)), options_(std::move(options)) {}

ShardedRun::~ShardedRun() {
  if (in_forward_) --forwards_running;
  for (auto& [accumulator, key] : hooks_) accumulator->del_post_hook(key);
  clear_pass();
}

void ShardedRun::shard(std::vector<FoundUnit> found) {
  for (const FoundUnit& f : found) {
    TORCH_CHECK(!f.wrapper || !f.wrapper->attached_, "FullyShardedDataParallel: ddp::ShardedUnit '", f.name,
                "' is sharded already, by another FullyShardedDataParallel");
  }
  // The flat units first: they take the values and leave the parameters gathered, in param_dtype. Then the hooks,
  // while the parameters are full and of the dtype they compute in: a gradient accumulator keeps the metadata it was
  // created with and checks (and casts) gradients against it; kept alive here, so that the one autograd uses is this
  // one (set_data between two views of one dtype keeps it). Then every unit is sharded.
  for (FoundUnit& f : found) {
    units_.push_back(
        std::make_unique<FlatUnit>(f.name, f.params, pg_, options_.param_dtype(), options_.reduce_dtype()));
    wrappers_.push_back(f.wrapper);
  }
  for (size_t u = 0; u < found.size(); ++u) {
    for (size_t i = 0; i < found[u].params.size(); ++i) {
      const at::Tensor& param = found[u].params[i].second;
      if (!param.requires_grad()) continue;
      std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::grad_accumulator(param);
      TORCH_CHECK(accumulator, "FullyShardedDataParallel: parameter ", found[u].params[i].first,
                  " has no gradient accumulator (is it a leaf tensor that requires grad?)");
      const uintptr_t key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, u, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            on_grad_ready(u, i);
            return outputs;
          }));
      hooks_.emplace_back(std::move(accumulator), key);
    }
  }
  for (auto& unit : units_) unit->reshard();
  for (size_t u = 0; u < found.size(); ++u) {
    if (found[u].wrapper) {
      found[u].wrapper->run_ = weak_from_this();
      found[u].wrapper->index_ = u;
      found[u].wrapper->attached_ = true;
    }
  }
}

int64_t ShardedRun::gathered_bytes() const {
  int64_t bytes = 0;
  for (const auto& unit : units_) bytes += unit->gathered_bytes();
  return bytes;
}

void ShardedRun::note_peak() { peak_gathered_ = std::max(peak_gathered_, gathered_bytes()); }

int ShardedRun::position_of(size_t index) const {
  const auto it = std::find(ran_.begin(), ran_.end(), index);
  return it == ran_.end() ? -1 : static_cast<int>(it - ran_.begin());
}

void ShardedRun::prefetch(size_t index) {
  units_[index]->start_gather();
  note_peak();
}

void ShardedRun::begin_forward() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (in_backward_) {  // a backward that threw: its full gradients (and what no_sync gathered before it) are dropped
    for (auto& unit : units_) unit->drop_full_grads();
  }
  clear_pass();
  for (auto& unit : units_) unit->reshard();
  if (!in_forward_) ++forwards_running;
  in_forward_ = true;
  seen_.assign(1, 0);
  units_[0]->wait_gathered();
  note_peak();
}

void ShardedRun::end_forward(bool completed) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (in_forward_) --forwards_running;
  in_forward_ = false;
  if (completed && !order_known_) {
    // The root, then the units that did not run (in the model's order), then those that did: reductions go in the
    // reverse, so a unit that never gets its gradients (it did not run) holds up none of the others.
    order_.assign(1, 0);
    for (size_t u = 1; u < units_.size(); ++u) {
      if (std::find(seen_.begin(), seen_.end(), u) == seen_.end()) order_.push_back(u);
    }
    order_.insert(order_.end(), seen_.begin() + 1, seen_.end());
    ran_ = seen_;
    order_known_ = true;
  }
  if (!at::GradMode::is_enabled()) {  // no backward comes: nothing stays gathered past forward but the root
    for (size_t u = 1; u < units_.size(); ++u) units_[u]->reshard();
  }
}

at::Tensor ShardedRun::run_unit(size_t index, const std::function<at::Tensor(const at::Tensor&)>& fn,
                                const at::Tensor& input) {
  FlatUnit& unit = *units_[index];
  {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    TORCH_CHECK(in_forward_ || !in_recompute(), "ddp::ShardedUnit: ", unit.label(),
                " ran again in backward (an activation checkpoint around the unit): put the checkpoint inside it, "
                "ddp::ShardedUnit(amp::Checkpointed(block))");
    TORCH_CHECK(in_forward_, "ddp::ShardedUnit: ", unit.label(),
                " ran outside FullyShardedDataParallel::forward (its parameters are sharded): run the model through "
                "the FullyShardedDataParallel built over it");
    if (!order_known_ && std::find(seen_.begin(), seen_.end(), index) == seen_.end()) seen_.push_back(index);
    unit.wait_gathered();
    note_peak();
    if (order_known_ && options_.prefetch()) {  // the unit after this one in the first forward's order
      const int at = position_of(index);
      if (at >= 0 && static_cast<size_t>(at) + 1 < ran_.size()) prefetch(ran_[static_cast<size_t>(at) + 1]);
    }
  }
  at::Tensor output = fn(input);
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  track_output(index, output);
  if (options_.reshard_after_forward() || !at::GradMode::is_enabled()) unit.reshard();
  return output;
}

void ShardedRun::track_output(size_t index, const at::Tensor& output) {
  if (!output.defined() || !output.requires_grad() || !at::GradMode::is_enabled()) return;
  // A hook on the output runs when its gradient is computed, before the node that made it: before any backward node
  // of the unit. A hook, not an identity function: the output stays the unit's own (an in-place op on it is the
  // caller's business, as without sharding), and the hook stays with the node it was registered on.
  std::weak_ptr<ShardedRun> self = weak_from_this();
  output.register_hook([self, index](const at::Tensor& grad) {
    const std::shared_ptr<ShardedRun> run = self.lock();
    TORCH_CHECK(run,
                "FullyShardedDataParallel: backward through a sharded unit after its FullyShardedDataParallel "
                "was destroyed");
    run->before_backward_of(index);
    return grad;
  });
}

void ShardedRun::before_backward_of(size_t index) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  begin_backward_pass();
  FlatUnit& unit = *units_[index];
  unit.wait_gathered();
  note_peak();
  if (options_.prefetch() && ran_.size() > 1) {  // the unit backward reaches next: the one before in forward
    const int at = position_of(index);
    if (index == 0) {
      prefetch(ran_.back());  // backward starts at the root's output, then reaches the last unit
    } else if (at > 0) {
      prefetch(ran_[static_cast<size_t>(at) - 1]);
    }
  }
}

void ShardedRun::begin_backward_pass() {
  if (in_backward_) return;
  in_backward_ = true;
  launched_ = 0;
  std::weak_ptr<ShardedRun> self = weak_from_this();
  // At the end of the outermost backward (an activation checkpoint's nested one is not the pass's end).
  queue_end_of_backward([self] {
    if (auto run = self.lock()) run->finish_backward();
  });
}

void ShardedRun::on_grad_ready(size_t unit_index, size_t param) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  begin_backward_pass();
  FlatUnit& unit = *units_[unit_index];
  if (!unit.note_grad_ready(param)) return;
  // Every gradient of the unit is in: its parameters are not needed again in this pass (the root's stay until the
  // end: its output was the first thing backward needed, and it holds the loss's own layers).
  if (unit_index != 0) unit.reshard();
  if (sync_) launch_ready_reductions(/*all=*/false);
}

void ShardedRun::launch_ready_reductions(bool all) {
  // In reverse forward order, on every rank alike: a unit whose gradients are not all in holds up those after it,
  // until the end of backward launches the rest (a parameter without a gradient contributes zeros).
  while (launched_ < order_.size()) {
    FlatUnit& unit = *units_[order_[order_.size() - 1 - launched_]];
    if (unit.requires_grad()) {
      if (!all && !unit.all_grads_ready()) return;
      unit.launch_reduction();
      // At most two reductions in flight: the one just launched and the one before, which ends now (it had the
      // time of this unit's backward), so that the full-size gradient buffers never add up to the model's.
      peak_reduction_ = std::max(peak_reduction_, reduction_bytes());  // this one's buffers and the one before's
      if (in_flight_ != nullptr) in_flight_->finish_reduction();
      in_flight_ = &unit;
    }
    ++launched_;
  }
}

int64_t ShardedRun::reduction_bytes() const {
  int64_t bytes = 0;
  for (const auto& unit : units_) bytes += unit->reduction_bytes();
  return bytes;
}

void ShardedRun::finish_backward() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!in_backward_) return;
  if (sync_) {
    launch_ready_reductions(/*all=*/true);
    if (in_flight_ != nullptr) in_flight_->finish_reduction();
    in_flight_ = nullptr;
  }
  for (auto& unit : units_) {
    unit->reshard();
    unit->reset_pass();
  }
  in_backward_ = false;
}

void ShardedRun::clear_pass() noexcept {
  for (auto& unit : units_) unit->reset_pass();
  in_backward_ = false;
  launched_ = 0;
  in_flight_ = nullptr;
}

void ShardedRun::set_timeline(const std::shared_ptr<Timeline>& timeline) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  for (auto& unit : units_) unit->set_recorder(timeline);
}

void ShardedRun::set_sync(bool on) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  TORCH_CHECK(on || sync_, "FullyShardedDataParallel::no_sync: a guard is already alive");
  sync_ = on;
}

}  // namespace ddp::detail
