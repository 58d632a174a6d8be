#pragma once

// The gradient owner of one process and of plain DDP + amp (Note [gradient owner] in amp/state/gradient_owner.h).
// Internal.

#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <amp/state/gradient_owner.h>

namespace amp::detail {

/// Every rank holds every gradient: fp32 parameters' in place, half parameters' in fp32 in their masters' .grad.
class ReplicatedGradients final : public GradientOwner {
 public:
  explicit ReplicatedGradients(const OwnerContext& context);

  void begin_loss(bool starts_cycle) override;
  bool consume_bucket(const ddp::ReducedBucket& bucket, LossScaler* scaler) override;
  bool end_loss(LossScaler& scaler, bool reduce_flag) override;
  void step(FusedOptimizer& fused, const at::Tensor& found_inf) override;
  std::vector<at::Tensor> grads() const override;
  at::Tensor clip_grad_norm_(double max_norm, const at::Tensor& found_inf) override;
  void zero_grad() override { stash_.clear(); }
  HeldBytes held_bytes() const override;
  std::vector<at::Tensor> full_masters() const override;
  void master_copies(const std::vector<at::Tensor>& values,
                     std::vector<std::pair<at::Tensor, at::Tensor>>& out) const override;

 private:
  ParamSlots& slots_;
  FusedOptimizer* fused_;
  bool master_weights_;
  std::vector<at::Tensor> stash_;  ///< unscaled grads of direct (masterless) params, kept across losses
  struct ConsumedGrad {  ///< a masterless gradient consume_bucket unscaled in place during this loss's backward
    const c10::TensorImpl* grad = nullptr;
    int64_t version = 0;
  };
  std::vector<ConsumedGrad> consumed_direct_;  ///< per slot
  at::Tensor bucket_scale_;                    ///< consume_bucket's average * inv_scale (1-element fp32 on the device)
};

}  // namespace amp::detail
