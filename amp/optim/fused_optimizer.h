#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <string>
#include <vector>

namespace amp {

/// Implemented by amp's fused optimizers (amp/optim/fused_optimizers.h). amp::Optimizer::step() hands them the
/// overflow flag instead of reading it on the host, so a whole AMP step runs without a host sync, and with
/// master weights they refresh the half model parameters in the same pass that updates the fp32 masters.
class FusedOptimizer {
 public:
  virtual ~FusedOptimizer() = default;
  /// One optimizer step over the held parameters (fp32 masters under master weights) that leaves everything
  /// bit-identical when found_inf (1-element fp32 on the parameters' device) is nonzero. model_params is empty,
  /// or one tensor per held parameter (in param-group order) receiving the updated value rounded to its dtype.
  virtual void fused_step(at::TensorList model_params, const at::Tensor& found_inf) = 0;
  /// Writes each param group's host learning rate (options().get_lr()) to the device tensor the step reads, where
  /// it changed since the last write (a device fill; no host sync). step() does this itself outside a CUDA graph
  /// capture; a replayed graph runs no host code, so with a learning-rate schedule call sync_lr() after changing
  /// lr and before each replay. Groups that have not stepped yet are left for their first step. Refused while the
  /// parameters' stream is capturing. See Note [capture-safe step] (kernels/capture.h); untested on a GPU so far.
  virtual void sync_lr() = 0;
  /// Every state tensor the optimizer holds (moments, momentum buffers, step counts, device learning rates): what
  /// its state costs in memory (amp::Optimizer::held_bytes).
  virtual std::vector<at::Tensor> state_tensors() const = 0;
  /// The field names of the per-parameter entries save() writes. Each entry is named `group<g>.<field>.<i>`;
  /// "step" (a 1-element count) comes first, then the elementwise ones (shaped like the parameter). ZeRO
  /// re-shards checkpoints by these names.
  virtual std::vector<std::string> state_fields() const = 0;
};

}  // namespace amp
