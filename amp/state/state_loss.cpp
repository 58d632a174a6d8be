// amp::detail::State, the scale_loss protocol: begin_loss / end_loss (see ScaledLoss in amp/amp.h).

#include <amp/state/state.h>

#include <ATen/ATen.h>

#include <amp/fp8/fp8_state.h>

namespace amp::detail {

at::Tensor State::begin_loss(const at::Tensor& loss, int64_t loss_id, bool delay_unscale) {
  owner_->check_parameters_current("scale_loss began");  // Note [deferred publish]
  LossScaler& s = losses_.scaler(loss_id);
  const bool starts_cycle = losses_.starts_cycle(loss_id);
  owner_->begin_loss(starts_cycle);
  // A new unscale cycle: the overflow flag starts clear here, before backward, because with a data parallel
  // wrapper attached the buckets are unscaled and checked during backward (consume_bucket).
  if (starts_cycle) s.begin_step();
  at::Tensor scaled = s.scale_loss(loss);  // may throw (bad loss): then no loss is active
  losses_.enter(loss_id, delay_unscale);
  return scaled;
}

void State::end_loss(int64_t loss_id, bool delay_unscale) {
  if (!losses_.leave(loss_id, delay_unscale)) return;  // delay_unscale: the gradients stay scaled
  LossScaler& s = losses_.scaler(loss_id);
  // With FP8 the overflow flag rides in the amax reduction (one collective, MAX) where the owner's check saw only
  // this rank's gradients. A non-finite FP8 amax (an overflowing output gradient the saturating cast clipped, or an
  // inf input) counts as this loss's overflow: the scaler backs off and the step is skipped, on every rank alike.
  const bool flag_pending = owner_->end_loss(s, /*reduce_flag=*/fp8_ == nullptr);
  if (fp8_ != nullptr) fp8_->reduce_and_check(s.found_inf(), flag_pending);
  s.update();
  progress_.add_loss(s);
  losses_.clear_scaled();
}

}  // namespace amp::detail
