#pragma once

// amp's FP8 state (Options::fp8, docs/fp8.md): the scaling state of every Float8Linear that runs in FP8, as one
// set of buffers the layers hold views of, so a step updates all of them with one kernel and one collective.
// Internal: users go through amp/amp.h.

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>

#include <amp/fp8/fp8_recipe.h>

namespace ddp {
class ProcessGroup;
}  // namespace ddp

namespace amp::detail {

class Fp8State {
 public:
  /// Enables FP8 on every amp::Float8Linear of `module` whose dimensions the FP8 GEMMs take, with views of this
  /// state; the layers left out, and any torch::nn::Linear, are named in report() with the reason.
  Fp8State(torch::nn::Module& module, const Fp8Recipe& recipe, const c10::Device& device);

  /// What initialize logged: a line per layer left out and a summary.
  const std::vector<std::string>& report() const { return report_; }
  /// Layers running in FP8.
  int64_t layers() const { return history_.size(0) / kFp8TensorsPerLayer; }
  const Fp8Recipe& recipe() const { return recipe_; }
  const at::Tensor& history() const { return history_; }
  const at::Tensor& scale() const { return scale_; }

  /// Data parallel training: the amaxes are max-reduced over `group` at each step (null: single process).
  void set_process_group(const ddp::ProcessGroup* group) { group_ = group; }
  /// At the end of an unscaling scale_loss scope, before its loss scaler updates (and at step() when no scope did):
  /// the current amaxes max-reduced over the ranks (one small allreduce); a non-finite one sets `found_inf` (the
  /// scope's loss scaler's flag), so the scaler backs off and every rank skips the step, as for a gradient overflow.
  /// reduce_flag (ZeRO): found_inf is this rank's own and rides in the same allreduce (MAX), which then replaces
  /// ZeRO's flag allreduce. No host sync.
  void reduce_and_check(const at::Tensor& found_inf, bool reduce_flag = false);
  /// Whether reduce_and_check ran since the last update().
  bool reduced() const { return reduced_; }
  /// After the step: histories rolled and scales updated, one kernel (found_inf set: left as they were).
  void update(const at::Tensor& found_inf);

  void save(torch::serialize::OutputArchive& archive) const;
  /// Checks that load() would succeed, without changing anything.
  void validate(torch::serialize::InputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  Fp8Recipe recipe_;
  at::Tensor history_;    ///< [3 * layers, L]
  at::Tensor scale_;      ///< [3 * layers]
  at::Tensor scale_inv_;  ///< [3 * layers]
  at::Tensor fp8_max_;    ///< [3 * layers]
  const ddp::ProcessGroup* group_ = nullptr;
  std::vector<std::string> report_;
  bool reduced_ = false;
};

}  // namespace amp::detail
