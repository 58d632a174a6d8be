#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <ddp/process_group.h>

namespace ddp {

/// BatchNorm's options (torch::nn::BatchNormOptions) plus the group whose ranks share the batch statistics.
struct SyncBatchNormOptions {
  /// Defaults for `num_features` channels (checked when the module is built, not here); implicit, so a channel
  /// count converts.
  /* implicit */ SyncBatchNormOptions(int64_t num_features);  // NOLINT(google-explicit-constructor)

  /// C, the channel dimension (dim 1) of the input. Must be > 0.
  TORCH_ARG(int64_t, num_features);
  /// Added to the variance before the square root. Must be >= 0.
  TORCH_ARG(double, eps) = 1e-5;
  /// Weight of the new batch statistics in the running ones; nullopt: cumulative average over all batches seen
  /// (factor 1 / num_batches_tracked), as torch::nn::BatchNorm. Must lie in [0, 1].
  TORCH_ARG(std::optional<double>, momentum) = 0.1;
  /// Learnable per-channel weight and bias (fp32 parameters "weight", "bias").
  TORCH_ARG(bool, affine) = true;
  /// Keep running_mean / running_var / num_batches_tracked and use them in eval mode; without, eval mode
  /// normalizes with the local batch's statistics (no collective), as BatchNorm does.
  TORCH_ARG(bool, track_running_stats) = true;
  /// 1, 2 or 3: accept only what BatchNorm1d ((N, C) or (N, C, L)), BatchNorm2d ((N, C, H, W)) or BatchNorm3d
  /// ((N, C, D, H, W)) accepts; nullopt: any input with at least 2 dims (PyTorch's SyncBatchNorm).
  TORCH_ARG(std::optional<int>, dimensionality) = std::nullopt;
  /// The ranks whose batches are normalized together: pass the group DDP uses (or a subgroup, e.g. one node's
  /// ranks). Needed for a training forward (an error otherwise); eval mode never uses it. A group of size 1 skips
  /// the collectives.
  TORCH_ARG(std::optional<ProcessGroup>, process_group) = std::nullopt;
};

/// Batch normalization whose training-mode statistics cover the batches of all ranks of a process group
/// (Apex's / PyTorch's SyncBatchNorm), so that a small per-rank batch normalizes like the whole global batch.
///
/// Parameters and buffers are named and shaped as torch::nn::BatchNorm's ("weight", "bias", "running_mean",
/// "running_var", "num_batches_tracked"; undefined when affine / track_running_stats are off), so state_dicts and
/// convert_sync_batch_norm move state between the two. They stay fp32 whatever the input's dtype (amp's model
/// cast keeps SyncBatchNorm fp32 like BatchNorm); a Half or BFloat16 input is normalized in fp32 and the output
/// returned in the input's dtype.
///
/// Training forward with a group of size > 1 (see Note [SyncBatchNorm collectives] in sync_batch_norm.cpp):
/// exactly one allgather of (count, input shape facts, mean, variance) per rank in forward, and one allreduce of
/// (sum dy, sum dy * (x - mean)) in backward, on every rank, in the same order: every rank of the group must call
/// forward (and backward) of its SyncBatchNorm layers, a rank with an empty batch (N = 0) included. The first
/// training forward also checks once (one small allgather) that every rank's module has the same num_features
/// and dimensionality. A bad input on any rank (wrong number of dims, wrong channel count, fewer than 2 values per
/// channel over the whole group) throws the same error naming the rank on every rank instead of hanging the
/// others. Running variance is updated with the unbiased variance of the global batch (global count - 1).
///
/// Weight and bias gradients are this rank's share (as in PyTorch): DDP's gradient averaging sums them over ranks.
/// The input gradient is d(sum over ranks of each rank's loss)/dx, which is what DDP training needs.
///
/// Host syncs: a training forward with a group of size > 1 reads the gathered header on the host (to validate
/// every rank's input and fail on every rank alike), as PyTorch's SyncBatchNorm reads the gathered counts.
/// Eval mode and groups of size 1 cost what torch::nn::BatchNorm costs (they call at::batch_norm).
class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  /// Builds the layer and calls reset(). Throws c10::Error unless num_features > 0, eps >= 0, momentum (when set)
  /// lies in [0, 1] and dimensionality (when set) is 1, 2 or 3.
  explicit SyncBatchNormImpl(const SyncBatchNormOptions& options);
  /// Same as SyncBatchNormImpl(SyncBatchNormOptions(num_features)): the default options, no process group yet.
  SyncBatchNormImpl(int64_t num_features) : SyncBatchNormImpl(SyncBatchNormOptions(num_features)) {}

  /// (Re)creates parameters (weight = 1, bias = 0) and buffers (mean 0, var 1, count 0).
  void reset() override;
  /// Sets running_mean to 0, running_var to 1 and num_batches_tracked to 0, in place; nothing without
  /// track_running_stats.
  void reset_running_stats();
  /// reset_running_stats(), then weight = 1 and bias = 0 in place (with affine).
  void reset_parameters();

  /// `input`: (N, C, *) of kFloat, kDouble, kHalf or kBFloat16 on any device (every rank of the group on the same
  /// kind of device); returns the normalized input, same shape and dtype.
  at::Tensor forward(const at::Tensor& input);

  /// Sets the group (e.g. after convert_sync_batch_norm without one, or to move to a subgroup).
  void set_process_group(std::optional<ProcessGroup> process_group);

  /// Writes "ddp::SyncBatchNorm(C, eps=..., momentum=..., affine=..., track_running_stats=..., world_size=N)";
  /// world_size is 0 without a process group.
  void pretty_print(std::ostream& stream) const override;

  SyncBatchNormOptions options;    ///< the options it was built with (process_group as last set)
  at::Tensor weight;               ///< (C,) fp32 parameter "weight"; undefined without affine
  at::Tensor bias;                 ///< (C,) fp32 parameter "bias"; undefined without affine
  at::Tensor running_mean;         ///< (C,) fp32 buffer; undefined without track_running_stats
  at::Tensor running_var;          ///< (C,) fp32 buffer (unbiased); undefined without track_running_stats
  at::Tensor num_batches_tracked;  ///< int64 0-dim buffer: training forwards seen; undefined likewise

 private:
  void check_peers_once();
  bool peers_checked_ = false;
};
TORCH_MODULE(SyncBatchNorm);

/// A function that receives one human-readable line (default: std::cerr).
using SyncBatchNormLogger = std::function<void(const std::string&)>;

/// Replaces every torch::nn::BatchNorm1d/2d/3d in `module`'s tree (the root itself, registered submodules,
/// elements of Sequential, ModuleList and ModuleDict, at any depth) with a SyncBatchNorm of the same options
/// (dimensionality set from the replaced class, `process_group` as given) holding copies of its weight, bias and
/// buffers, bit for bit, on the same device with the same dtypes and requires_grad, in the same training mode.
/// Returns the root: `module` itself, or the new SyncBatchNorm when the root was a BatchNorm. Logs one line
/// through `log`: how many modules were replaced and their names, or that the model has no BatchNorm (then
/// nothing changed), plus a WARNING naming each replaced BatchNorm that something besides its parent's registry
/// still owns (typically a member holder, see below).
///
/// Limitation (C++ has no reflection): a parent's own member holders (`torch::nn::BatchNorm2d bn;` assigned from
/// register_module) still point to the old BatchNorm after conversion; only the parent's registry (what
/// named_children(), parameters() and DDP see) and the containers' element lists are updated. A forward that
/// calls `bn(x)` through such a member keeps running the old BatchNorm, so write forward through containers
/// (Sequential, ModuleList, ModuleDict) or re-fetch the child by name (`named_children()["bn"]`), or construct the
/// model with SyncBatchNorm directly. Optimizers built before conversion hold the old parameters: build them after.
std::shared_ptr<torch::nn::Module> convert_sync_batch_norm(std::shared_ptr<torch::nn::Module> module,
                                                           std::optional<ProcessGroup> process_group = std::nullopt,
                                                           const SyncBatchNormLogger& log = nullptr);

/// Sets `process_group` on every SyncBatchNorm in `module`'s tree; returns how many there were.
int64_t set_sync_batch_norm_process_group(torch::nn::Module& module, const std::optional<ProcessGroup>& process_group);

namespace detail {

/// The group's per-rank counts (values per channel on each rank, each >= 0) as ATen's batch_norm_backward_elemt
/// takes them on CUDA: an int32 CPU tensor whose entries the kernel sums in int64. One entry per rank, as PyTorch's
/// SyncBatchNorm passes; a count above 2^31 - 1 is split over as many entries as it needs, so no total overflows.
at::Tensor batch_norm_counts(const std::vector<int64_t>& rank_counts);

}  // namespace detail

}  // namespace ddp
