#include <amp/state.h>

#include <exception>
#include <iostream>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <amp/fused_optimizer.h>
#include <amp/model_cast.h>
#include <ddp/bucket_copy.h>
#include <ddp/distributed_data_parallel.h>
#include <kernels/capture.h>
#include <kernels/scaled_copy.h>
#include <kernels/unscale.h>

namespace amp::detail {
namespace {

// Note [one amp state per optimizer]
// initialize() rewrites the optimizer (master weights replace parameters, state is re-keyed), so a second
// initialize() of the same optimizer would wrap masters in masters. Apex refuses it; so do we, by address,
// for as long as the first state lives.
std::mutex g_registry_mutex;
std::set<const torch::optim::Optimizer*>& registry() {
  static std::set<const torch::optim::Optimizer*> optimizers;
  return optimizers;
}

/// Steps between two overflow log lines (the first overflow is always logged): a line per step would drown
/// a log whenever the scale is settling.
constexpr int64_t kOverflowLogIntervalSteps = 100;

bool is_half(c10::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

void default_logger(const std::string& line) { std::cerr << line << std::endl; }

}  // namespace

State::State(torch::nn::Module& module, torch::optim::Optimizer& optimizer, const Options& options)
    : options_(options),
      policy_(options.resolve()),
      device_(c10::kCPU),
      module_(&module),
      optimizer_(&optimizer),
      fused_(dynamic_cast<FusedOptimizer*>(&optimizer)),
      logger_(default_logger) {
  const std::string kind = module.name();
  TORCH_CHECK(kind.find("DataParallel") == std::string::npos,
              "amp::initialize got a model already wrapped for data parallel training (", kind,
              "): call initialize on the bare model and wrap the model it returns");
  // Every parameter must be fp32 on entry, on one device.
  const auto named = module.named_parameters(/*recurse=*/true);
  TORCH_CHECK(named.size() > 0, "amp::initialize: the model has no parameters");
  device_ = named[0].value().device();
  std::unordered_map<const void*, std::string> name_of;
  for (const auto& p : named) {
    TORCH_CHECK(p.value().scalar_type() == at::kFloat, "amp::initialize needs fp32 parameters on entry, but '", p.key(),
                "' is ", p.value().scalar_type());
    TORCH_CHECK(p.value().device() == device_, "amp::initialize needs all parameters on one device, but '", p.key(),
                "' is on ", p.value().device(), " and '", named[0].key(), "' on ", device_);
    name_of[p.value().unsafeGetTensorImpl()] = p.key();
  }
  // Every optimizer parameter must belong to the model.
  int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      auto it = name_of.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(it != name_of.end(), "amp::initialize: optimizer parameter ", index, " (shape ", p.sizes(),
                  ") is not a parameter of the model");
      slots_.push_back(ParamSlot{it->second, p, p, false});
      ++index;
    }
  }
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    TORCH_CHECK(registry().insert(&optimizer).second,
                "amp::initialize was already called with this optimizer: initialize each optimizer once "
                "(see Note [one amp state per optimizer])");
  }
  // Masters are taken from the fp32 values before the model is cast, so they start exact (Apex copied them
  // back from the already rounded half parameters).
  std::vector<at::Tensor> fp32_values;
  if (policy_.master_weights) {
    for (const auto& slot : slots_) fp32_values.push_back(slot.model.detach().clone());
  }
  if (policy_.cast_model_type != at::kFloat) {
    cast_model_(module, policy_.cast_model_type, policy_.keep_batchnorm_fp32, policy_.keep_layernorm_fp32);
  }
  if (policy_.master_weights) create_master_weights(fp32_values);

  forward_.autocast = policy_.autocast;
  forward_.cast_inputs = policy_.cast_model_type != at::kFloat;
  forward_.half_dtype = policy_.half_dtype;
  forward_.device_type = device_.type();
  if (policy_.cast_model_type != at::kFloat && policy_.keep_layernorm_fp32) {
    forward_.kept_norms = layer_and_group_norms(module);
  }
  for (int64_t i = 0; i < policy_.num_losses; ++i) {
    scalers_.push_back(std::make_unique<LossScaler>(LossScalerConfig::from(policy_), device_));
  }
  last_logged_step_.assign(policy_.num_losses, -kOverflowLogIntervalSteps);
  overflows_since_log_.assign(policy_.num_losses, 0);
  step_found_inf_ = at::zeros({1}, at::TensorOptions().device(device_));
  outcome_ = std::make_unique<StepOutcome>(device_);
}

State::~State() {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  registry().erase(optimizer_);
}

void State::create_master_weights(const std::vector<at::Tensor>& fp32_values) {
  // Replace each half parameter the optimizer holds by an fp32 master copy, and re-key any existing optimizer
  // state (torch::optim keys it by TensorImpl*) to the master, converting its tensors to fp32.
  std::unordered_map<const void*, at::Tensor> master_of;
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& slot = slots_[i];
    if (!is_half(slot.model.scalar_type()) || !slot.model.requires_grad()) continue;
    slot.master = fp32_values[i].requires_grad_(true);
    slot.has_master = true;
    master_of[slot.model.unsafeGetTensorImpl()] = slot.master;
  }
  auto& state = optimizer_->state();
  for (auto& group : optimizer_->param_groups()) {
    for (auto& p : group.params()) {
      auto it = master_of.find(p.unsafeGetTensorImpl());
      if (it == master_of.end()) continue;
      auto old = state.find(p.unsafeGetTensorImpl());
      if (old != state.end()) {
        state[it->second.unsafeGetTensorImpl()] = std::move(old->second);
        state.erase(p.unsafeGetTensorImpl());
      }
      p = it->second;
    }
  }
}

LossScaler& State::scaler(int64_t loss_id) {
  TORCH_CHECK(loss_id >= 0 && loss_id < static_cast<int64_t>(scalers_.size()), "loss_id ", loss_id,
              " is out of range: initialize was called with num_losses=", scalers_.size());
  return *scalers_[loss_id];
}

at::Tensor State::begin_loss(const at::Tensor& loss, int64_t loss_id, bool delay_unscale) {
  LossScaler& s = scaler(loss_id);
  if (grads_scaled_) {
    TORCH_CHECK(loss_id == scaled_loss_id_, "scale_loss with loss_id ", loss_id, " while gradients still carry loss ",
                scaled_loss_id_, "'s scale (delay_unscale=true): finish that loss with delay_unscale=false first");
  } else {
    // Earlier losses' gradients are already unscaled: keep them aside so this backward produces only this
    // loss's scaled gradients; end_loss() adds them back (Apex's stash).
    for (size_t i = 0; i < slots_.size(); ++i) {
      auto& slot = slots_[i];
      if (slot.has_master) {
        slot.model.mutable_grad() = at::Tensor();  // already folded into the master's gradient
      } else {
        if (stash_.size() != slots_.size()) stash_.resize(slots_.size());
        if (slot.model.grad().defined()) {
          stash_[i] = stash_[i].defined() ? stash_[i].add_(slot.model.grad()) : slot.model.grad();
          slot.model.mutable_grad() = at::Tensor();
        }
      }
    }
    // A new unscale cycle: the overflow flag starts clear here, before backward, because with a data parallel
    // wrapper attached the buckets are unscaled and checked during backward (consume_bucket).
    s.begin_step();
    consumed_direct_.assign(slots_.size(), ConsumedGrad{});
  }
  at::Tensor scaled = s.scale_loss(loss);  // may throw (bad loss): then no loss is active
  active_loss_id_ = loss_id;
  active_delay_unscale_ = delay_unscale;
  return scaled;
}

void State::end_loss(int64_t loss_id, bool delay_unscale) {
  active_loss_id_ = -1;
  if (delay_unscale) {
    grads_scaled_ = true;
    scaled_loss_id_ = loss_id;
    return;
  }
  LossScaler& s = scaler(loss_id);
  // Gradients unscaled in place by consume_bucket must not have changed since (that would mix scales): checked for
  // all of them before anything is written, so a refusal leaves every gradient as it was.
  for (size_t i = 0; i < consumed_direct_.size(); ++i) {
    const at::Tensor& grad = slots_[i].model.grad();
    if (consumed_direct_[i].grad == nullptr || !grad.defined()) continue;
    TORCH_CHECK(
        grad.unsafeGetTensorImpl() == consumed_direct_[i].grad && grad._version() == consumed_direct_[i].version,
        "amp: the gradient of '", slots_[i].name,
        "' changed after DDP's reduced bucket was unscaled into it in this scale_loss scope (a backward under "
        "no_sync after a synchronized one?), which would mix unscaled and scaled values. Run the scope's earlier "
        "backward passes under no_sync, or give them their own scope with delay_unscale=true.");
  }
  // Two fused calls: masterless gradients are unscaled in place; half gradients are unscaled in fp32 straight
  // into their masters' gradients. Both record slot indices, so a recorded index names a parameter.
  std::vector<at::Tensor> direct, model_grads, master_targets, scratch_of;
  std::vector<int64_t> direct_index, master_index;
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& slot = slots_[i];
    if (!slot.model.grad().defined()) continue;  // none, or folded into the master by consume_bucket
    if (i < consumed_direct_.size() && consumed_direct_[i].grad != nullptr) continue;  // unscaled by consume_bucket
    // The fused kernels take contiguous tensors: a gradient laid out like a non-contiguous parameter (stored
    // transposed, channels_last) is replaced by a contiguous copy, which backward keeps accumulating into.
    at::Tensor& grad = slot.model.mutable_grad();
    if (!grad.is_contiguous()) grad = grad.contiguous();
    if (!slot.has_master) {
      direct.push_back(slot.model.grad());
      direct_index.push_back(static_cast<int64_t>(i));
      continue;
    }
    model_grads.push_back(slot.model.grad());
    master_index.push_back(static_cast<int64_t>(i));
    // A master that already holds a gradient (an earlier loss of this step) gets this loss's share added.
    at::Tensor& master_grad = slot.master.mutable_grad();
    if (master_grad.defined()) {
      scratch_of.push_back(at::empty_like(master_grad));
      master_targets.push_back(scratch_of.back());
    } else {
      master_grad = at::empty_like(slot.master, at::MemoryFormat::Contiguous);
      scratch_of.push_back(at::Tensor());
      master_targets.push_back(master_grad);
    }
  }
  if (!direct.empty()) {
    kernels::unscale_and_check_(direct, s.inv_scale(), s.found_inf(), s.first_nonfinite_index(), direct_index);
  }
  if (!model_grads.empty()) {
    kernels::scaled_copy_(model_grads, master_targets, s.inv_scale(), s.found_inf(), s.first_nonfinite_index(),
                          master_index);
    for (size_t k = 0; k < master_index.size(); ++k) {
      auto& slot = slots_[master_index[k]];
      if (scratch_of[k].defined()) slot.master.mutable_grad().add_(scratch_of[k]);
      slot.model.mutable_grad() = at::Tensor();  // folded into the master's gradient; frees the half copy
    }
  }
  // Add back what earlier losses of this step left in the stash.
  for (size_t i = 0; i < stash_.size(); ++i) {
    if (!stash_[i].defined()) continue;
    auto& grad = slots_[i].model.mutable_grad();
    grad = grad.defined() ? grad.add_(stash_[i]) : stash_[i];
    stash_[i] = at::Tensor();
  }
  s.update();
  step_found_inf_.add_(s.found_inf());
  grads_scaled_ = false;
  unscaled_this_step_ = true;
}

void State::attach(ddp::DistributedDataParallel& ddp) {
  TORCH_CHECK(ddp.module().get() == module_,
              "amp: attach() got a DistributedDataParallel that wraps a different module than the one "
              "amp::initialize prepared; wrap the initialized module itself");
  slot_of_.clear();
  bucket_scale_ = at::empty({1}, at::TensorOptions().dtype(at::kFloat).device(device_));
  for (size_t i = 0; i < slots_.size(); ++i) slot_of_[slots_[i].model.unsafeGetTensorImpl()] = static_cast<int64_t>(i);
  ddp.set_bucket_consumer([weak = weak_from_this()](const ddp::ReducedBucket& bucket) {
    const std::shared_ptr<State> state = weak.lock();
    return state != nullptr && state->consume_bucket(bucket);
  });
}

bool State::consume_bucket(const ddp::ReducedBucket& bucket) {
  // Outside a scale_loss scope, or accumulating scaled gradients (delay_unscale): a plain average.
  if (active_loss_id_ < 0 || active_delay_unscale_) return false;
  // Checked for the whole bucket before anything is written, so declining or refusing leaves every gradient as it
  // was. A bucket the fused kernels cannot write (allreduce_dtype(kDouble), or a gradient written in place that is
  // non-contiguous) is declined: DDP writes it back tensor by tensor and the scope's end unscales it.
  std::vector<int64_t> slot_at(bucket.params.size(), -1);  // the optimizer's slot of each entry, -1 for none
  std::vector<at::Tensor> in_place;                        // gradients the fused pass would write
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const auto it = slot_of_.find(bucket.params[k].unsafeGetTensorImpl());
    if (it != slot_of_.end()) slot_at[k] = it->second;
    if (slot_at[k] < 0 || !slots_[slot_at[k]].has_master) in_place.push_back(bucket.grads[k]);
  }
  if (!ddp::detail::fusable(bucket.buffer, in_place)) return false;
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    if (slot_at[k] < 0) continue;
    const ParamSlot& slot = slots_[slot_at[k]];
    // A second synchronized backward in the same scope would find this gradient already unscaled, add its
    // scaled local gradient to it, and reduce the mix: refuse rather than compute a wrong average.
    TORCH_CHECK(slot.has_master || consumed_direct_[slot_at[k]].grad == nullptr,
                "amp: a second synchronized backward pass inside one scale_loss scope reached '", slot.name,
                "' (which has no fp32 master) after DDP's bucket had been unscaled into it. Run the scope's earlier "
                "backward passes under no_sync, or give them their own scope with delay_unscale=true.");
  }
  LossScaler& s = scaler(active_loss_id_);
  // One fused pass per bucket: the reduced sum times (average_scale * inv_scale), checked, written to the
  // optimizer's gradient (in place for direct parameters, fp32 into the master's for half ones).
  std::vector<at::Tensor> src, dst, scratch, plain_src, plain_dst;
  std::vector<int64_t> index, scratch_slot, master_slot;
  int64_t offset = 0;
  for (size_t k = 0; k < bucket.params.size(); ++k) {
    const at::Tensor& grad = bucket.grads[k];
    at::Tensor reduced = bucket.buffer.narrow(0, offset, grad.numel());
    offset += grad.numel();
    const int64_t i = slot_at[k];
    if (i < 0) {  // a parameter the optimizer does not update: the average, as DDP would write it
      plain_src.push_back(reduced);
      plain_dst.push_back(grad);
      continue;
    }
    ParamSlot& slot = slots_[i];
    src.push_back(reduced);
    index.push_back(i);
    if (!slot.has_master) {
      consumed_direct_[i] = ConsumedGrad{grad.unsafeGetTensorImpl(), grad._version()};
      dst.push_back(grad);
      continue;
    }
    master_slot.push_back(i);
    at::Tensor& master_grad = slot.master.mutable_grad();
    if (master_grad.defined()) {  // an earlier loss of this step: add this loss's share
      scratch.push_back(at::empty_like(master_grad));
      scratch_slot.push_back(i);
      dst.push_back(scratch.back());
    } else {
      master_grad = at::empty_like(slot.master, at::MemoryFormat::Contiguous);
      // Allocated on DDP's communication stream, used and freed on the caller's.
      if (bucket.caller_stream) master_grad.record_stream(*bucket.caller_stream);
      dst.push_back(master_grad);
    }
  }
  if (!src.empty()) {
    // average * inv_scale in a tensor kept for the purpose: no allocation per bucket, no host read of the scale.
    bucket_scale_.copy_(s.inv_scale()).mul_(bucket.average_scale);
    kernels::scaled_copy_(src, dst, bucket_scale_, s.found_inf(), s.first_nonfinite_index(), index);
  }
  for (size_t k = 0; k < scratch.size(); ++k) slots_[scratch_slot[k]].master.mutable_grad().add_(scratch[k]);
  for (const int64_t i : master_slot) slots_[i].model.mutable_grad() = at::Tensor();  // folded into the master's
  if (!plain_src.empty()) kernels::scaled_copy_(plain_src, plain_dst, bucket.average_scale);
  return true;
}

std::string State::param_name(int64_t index) const {
  if (index < 0 || index >= static_cast<int64_t>(slots_.size())) return "<none>";
  return slots_[index].name;
}

std::vector<at::Tensor> State::optimizer_grads() const {
  std::vector<at::Tensor> grads;
  for (const auto& slot : slots_) {
    const at::Tensor& g = slot.master.grad();
    if (g.defined()) grads.push_back(g);
  }
  return grads;
}

at::Tensor State::step(const torch::optim::Optimizer::LossClosure& closure) {
  at::Tensor result;
  if (closure) {  // as torch.optim: evaluated once, with gradients enabled, before the step
    at::AutoGradMode enable_grad(true);
    result = closure();
  }
  TORCH_CHECK(!grads_scaled_,
              "step() while gradients are still scaled: the last scale_loss used delay_unscale=true; "
              "finish the accumulation with delay_unscale=false before stepping");
  // Note [capture-safe step] (kernels/capture.h): only the fused path launches nothing but device work.
  const bool capturing = kernels::is_capturing(device_);
  TORCH_CHECK(fused_ != nullptr || !capturing,
              "amp::Optimizer::step() with a plain torch::optim optimizer cannot be captured in a CUDA graph on ",
              device_,
              ": it reads the overflow flag on the host. Use amp::FusedAdam, FusedAdamW or FusedSGD, or step "
              "outside the capture");
  if (fused_ != nullptr) {
    std::vector<at::Tensor> models;
    if (policy_.master_weights) {
      for (const auto& slot : slots_) models.push_back(slot.model);
    }
    fused_->fused_step(models, step_found_inf_);
    outcome_->record(steps_, step_found_inf_, capturing);
  } else {
    // A plain torch::optim optimizer cannot skip on device: this read is the one host sync per step.
    const bool overflow = unscaled_this_step_ && step_found_inf_.item<float>() != 0.0f;
    if (!overflow) optimizer_->step();
    outcome_->record(steps_, overflow);
    if (policy_.master_weights) {
      std::vector<at::Tensor> from, to;
      for (const auto& slot : slots_) {
        if (slot.has_master) {
          from.push_back(slot.master);
          to.push_back(slot.model);
        }
      }
      if (!overflow && !from.empty()) {
        at::NoGradGuard no_grad;
        kernels::scaled_copy_(from, to, 1.0);
      }
    }
  }
  step_found_inf_.zero_();
  unscaled_this_step_ = false;
  ++steps_;
  if (!capturing) check_diagnostics();  // host reads: outside the capture only (replays run no host code)
  return result;
}

void State::check_diagnostics() {
  for (size_t id = 0; id < scalers_.size(); ++id) {
    const ScalerDiagnostics d = scalers_[id]->diagnostics();
    if (d.step < 0 || !d.found_inf) continue;
    ++overflows_since_log_[id];
    if (policy_.max_overflows_at_floor > 0 && d.floor_overflows >= policy_.max_overflows_at_floor) {
      TORCH_CHECK(false, "amp: loss ", id, " has overflowed for ", d.floor_overflows,
                  " consecutive steps with its loss scale at the floor (", d.scale,
                  "); the first non-finite gradient is in '", param_name(d.first_nonfinite_index),
                  "'. Training is diverging: lower the learning rate, check the data, or raise min_loss_scale");
    }
    if (d.step - last_logged_step_[id] >= kOverflowLogIntervalSteps) {
      std::ostringstream line;
      line << "amp: gradient overflow (loss " << id << ", step " << d.step << "): scale now " << d.scale
           << ", first non-finite gradient in '" << param_name(d.first_nonfinite_index) << "'; "
           << overflows_since_log_[id] << " overflow(s) since the last report, " << d.skipped_steps
           << " skipped step(s) in total";
      if (logger_) logger_(line.str());
      last_logged_step_[id] = d.step;
      overflows_since_log_[id] = 0;
    }
  }
}

void State::zero_grad() {
  for (auto& slot : slots_) {
    slot.model.mutable_grad() = at::Tensor();
    if (slot.has_master) slot.master.mutable_grad() = at::Tensor();
  }
  stash_.clear();
  grads_scaled_ = false;
}

void State::save(torch::serialize::OutputArchive& archive) const {
  for (size_t id = 0; id < scalers_.size(); ++id) {
    torch::serialize::OutputArchive sub;
    scalers_[id]->save(sub);
    archive.write("loss_scaler" + std::to_string(id), sub);
  }
  const std::string text = options_.to_string();
  archive.write(
      "options_text",
      at::tensor(c10::ArrayRef<uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()), at::kByte));
}

void State::validate_amp_state(torch::serialize::InputArchive& archive) {
  at::Tensor text;
  TORCH_CHECK(archive.try_read("options_text", text), "amp checkpoint is missing its options");
  const std::string saved(reinterpret_cast<const char*>(text.data_ptr<uint8_t>()), text.numel());
  const std::string current = options_.to_string();
  if (saved != current) {
    // Name the first setting that differs ("key=value" words), then both lines whole.
    std::istringstream saved_words(saved), current_words(current);
    std::string a, b, differs;
    while (saved_words >> a) {
      if (!(current_words >> b)) b.clear();
      if (a != b) {
        differs = a + " in the checkpoint, " + (b.empty() ? std::string("nothing") : b) + " here";
        break;
      }
    }
    if (differs.empty()) differs = "the current options have more settings";
    TORCH_CHECK(false, "amp checkpoint was saved with other options (", differs, "; saved: ", saved,
                "; current: ", current, "): restore with the same amp::Options");
  }
  // Load every scaler into a scratch copy: a bad archive throws here, before anything changed.
  for (size_t id = 0; id < scalers_.size(); ++id) {
    torch::serialize::InputArchive sub;
    TORCH_CHECK(archive.try_read("loss_scaler" + std::to_string(id), sub), "amp checkpoint has no loss_scaler", id);
    LossScaler(scalers_[id]->config(), device_).load(sub);
  }
}

void State::load(torch::serialize::InputArchive& archive) {
  validate_amp_state(archive);
  for (size_t id = 0; id < scalers_.size(); ++id) {
    torch::serialize::InputArchive sub;
    archive.try_read("loss_scaler" + std::to_string(id), sub);
    scalers_[id]->load(sub);
  }
  // What this state derived from the old scaler state: the current step's overflow flag and the overflow log's
  // step bookkeeping (step numbers restart from the loaded ones).
  step_found_inf_.zero_();
  unscaled_this_step_ = false;
  last_logged_step_.assign(scalers_.size(), -kOverflowLogIntervalSteps);
  overflows_since_log_.assign(scalers_.size(), 0);
}

void State::save_model(torch::serialize::OutputArchive& archive) const {
  std::unordered_map<const void*, const ParamSlot*> slot_of;
  for (const auto& slot : slots_) slot_of[slot.model.unsafeGetTensorImpl()] = &slot;
  for (const auto& p : module_->named_parameters(true)) {
    auto it = slot_of.find(p.value().unsafeGetTensorImpl());
    const at::Tensor& value = it != slot_of.end() && it->second->has_master ? it->second->master : p.value();
    archive.write(p.key(), value.detach().to(at::kFloat).cpu());
  }
  for (const auto& b : module_->named_buffers(true)) {
    const at::Tensor& v = b.value();
    archive.write(b.key(), (v.is_floating_point() ? v.to(at::kFloat) : v).cpu(), /*is_buffer=*/true);
  }
}

void State::load_model(torch::serialize::InputArchive& archive) {
  auto assignments = prepare_model_load(archive);
  at::NoGradGuard no_grad;
  for (auto& [dest, value] : assignments) dest.copy_(value);
}

std::vector<std::pair<at::Tensor, at::Tensor>> State::prepare_model_load(torch::serialize::InputArchive& archive) {
  std::vector<std::pair<at::Tensor, at::Tensor>> assignments;  // (destination, fp32 value)
  std::unordered_map<const void*, const ParamSlot*> slot_of;
  for (const auto& slot : slots_) slot_of[slot.model.unsafeGetTensorImpl()] = &slot;
  auto read = [&](const std::string& key, const at::Tensor& dest, bool is_buffer) {
    at::Tensor value;
    TORCH_CHECK(archive.try_read(key, value, is_buffer), "model checkpoint has no '", key, "'");
    TORCH_CHECK(value.sizes() == dest.sizes(), "model checkpoint has '", key, "' with shape ", value.sizes(),
                " but the model's is ", dest.sizes());
    return value;
  };
  for (const auto& p : module_->named_parameters(true)) {
    at::Tensor value = read(p.key(), p.value(), false);
    assignments.emplace_back(p.value(), value);
    auto it = slot_of.find(p.value().unsafeGetTensorImpl());
    if (it != slot_of.end() && it->second->has_master) assignments.emplace_back(it->second->master, value);
  }
  for (const auto& b : module_->named_buffers(true))
    assignments.emplace_back(b.value(), read(b.key(), b.value(), true));
  return assignments;
}

}  // namespace amp::detail
