#include <amp/state/sharded_norm.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <kernels/multi_tensor/l2_norm.h>

namespace amp::detail {

at::Tensor sharded_clip_grad_norm_(const std::vector<at::Tensor>& local, double max_norm, const at::Tensor& found_inf,
                                   const ddp::ProcessGroup& pg, const std::string& what) {
  const auto max_norm_f = static_cast<float>(max_norm);
  TORCH_CHECK(max_norm_f > 0.0f, "max_norm must be > 0 (as a float32; +inf never clips), got ", max_norm);
  const auto fp64 = at::TensorOptions().dtype(at::kDouble).device(found_inf.device());
  // The sum of squares of this rank's part in fp64 (the l2 norm kernel's own accumulation), summed over the ranks.
  at::Tensor sum_sq =
      local.empty() ? at::zeros({1}, fp64) : kernels::l2_norm(local).total.to(at::kDouble).square().reshape({1});
  pg.allreduce_sum_(sum_sq, what);
  const at::Tensor total = sum_sq.sqrt().to(at::kFloat).reshape({});
  const at::Tensor finite = at::isfinite(total);
  // Raise the flag to 1 (as kernels::clip_grad_norm_ does), never add to it: it stays 0 or 1.
  found_inf.copy_(at::maximum(found_inf, finite.logical_not().to(at::kFloat).reshape({1})));
  // kernels::clip_coefficient on the device: max_norm / (norm + eps) in fp32 when < 1, else 1; 1 when not finite.
  at::Tensor coef = at::full({}, max_norm_f, total.options()).div(total.add(1e-6f)).clamp_max(1.0f);
  coef = at::where(finite, coef, at::ones_like(coef));
  for (const at::Tensor& g : local) const_cast<at::Tensor&>(g).mul_(coef);
  return total;
}

}  // namespace amp::detail
