// amp::detail::State, data parallel training: attach() and the consumption of DDP's reduced buckets.

#include <amp/state/state.h>

#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <amp/fp8/fp8_state.h>
#include <amp/zero/zero_shard.h>
#include <ddp/bucket_copy.h>
#include <ddp/distributed_data_parallel.h>
#include <kernels/multi_tensor/scaled_copy.h>

namespace amp::detail {

void State::attach(ddp::DistributedDataParallel& ddp, ZeroStage stage, ZeroPublish publish) {
  TORCH_CHECK(ddp.module().get() == module_,
              "amp: attach() got a DistributedDataParallel that wraps a different module than the one "
              "amp::initialize prepared; wrap the initialized module itself");
  TORCH_CHECK(zero_ == nullptr,
              "amp: attach() after attach() with a ZeroStage: the optimizer is sharded along that "
              "DistributedDataParallel's buckets; attach once");
  TORCH_CHECK(publish == ZeroPublish::kInStep || publish == ZeroPublish::kAtNextForward,
              "amp: attach(): unknown ZeroPublish ", static_cast<int>(publish));
  TORCH_CHECK(stage != ZeroStage::kNone || publish == ZeroPublish::kInStep,
              "amp: attach(ddp, ZeroStage::kNone, ZeroPublish::kAtNextForward): without ZeRO the step updates the "
              "model parameters itself and there is no all-gather to defer; pass ZeroStage::kOne or kTwo");
  if (stage != ZeroStage::kNone) zero_ = std::make_unique<ZeroShard>(*this, ddp, stage, publish);
  if (fp8_ != nullptr) fp8_->set_process_group(&ddp.process_group());
  slot_of_.clear();
  bucket_scale_ = at::empty({1}, at::TensorOptions().dtype(at::kFloat).device(device_));
  for (size_t i = 0; i < slots_.size(); ++i) slot_of_[slots_[i].model.unsafeGetTensorImpl()] = static_cast<int64_t>(i);
  ddp.set_bucket_consumer([weak = weak_from_this()](const ddp::ReducedBucket& bucket) {
    const std::shared_ptr<State> state = weak.lock();
    return state != nullptr && state->consume_bucket(bucket);
  });
}

bool State::consume_bucket(const ddp::ReducedBucket& bucket) {
  if (zero_ != nullptr) zero_->check_published("a synchronized backward pass reached DDP's reduced bucket");
  // Outside a scale_loss scope, or accumulating scaled gradients (delay_unscale): a plain average.
  if (active_loss_id_ < 0 || active_delay_unscale_) return false;
  if (zero_ != nullptr) return zero_->consume_bucket(bucket, scaler(active_loss_id_), bucket_scale_);
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

}  // namespace amp::detail
