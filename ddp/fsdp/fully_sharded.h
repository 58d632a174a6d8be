#pragma once

// Fully sharded data parallel (ZeRO stage 3, PyTorch's fully_shard): each rank keeps 1/N of every parameter, and a
// unit's full parameters exist only while the unit runs. docs/fsdp.md has the why and the how; Note [sharding a
// LibTorch module] in ddp/fsdp/sharded_unit.h how a unit is found in forward and in backward.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <ddp/fsdp/sharded_unit.h>
#include <ddp/module_forward.h>
#include <ddp/process_group.h>
#include <ddp/timeline.h>

namespace ddp {

namespace detail {
class ShardedRun;
}  // namespace detail

/// Options of FullyShardedDataParallel, checked at construction.
struct FullyShardOptions {
  /// Free each unit's full parameters after its forward and gather them again before its backward (ZeRO-3); off,
  /// they stay until the end of backward (less communication, more memory: ZeRO-2-like). The root's own parameters
  /// (those in no unit) are never freed between its forward and its backward: the root's output is the first thing
  /// backward needs.
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// Gather the next unit's parameters while the current one computes (in forward the order of the first forward,
  /// in backward its reverse). Off: each unit gathers when it starts (a baseline for the overlap).
  TORCH_ARG(bool, prefetch) = true;
  /// dtype the parameters are gathered and computed in (mixed precision, FSDP2's MixedPrecisionPolicy.param_dtype):
  /// the parameters' own (nullopt), or kFloat / kDouble / kBFloat16 / kHalf. The shard keeps the parameters' dtype
  /// (fp32 shards are the master copy the optimizer steps) and is cast as it is gathered; the model's parameters and
  /// their gradients take param_dtype, and so must the inputs the model computes on (amp O2 casts them: docs/fsdp.md).
  TORCH_ARG(std::optional<c10::ScalarType>, param_dtype) = std::nullopt;
  /// dtype gradients are reduce-scattered in: the gradients' own (nullopt: param_dtype, else the parameters'), or
  /// kFloat / kDouble / kBFloat16 / kHalf. The averaged gradient lands in the shard's dtype.
  TORCH_ARG(std::optional<c10::ScalarType>, reduce_dtype) = std::nullopt;
};

/// What one unit holds, for inspection (units(): the root's own parameters first, then each ddp::ShardedUnit in the
/// module's order).
struct ShardedUnitInfo {
  std::string name;                          ///< "" for the root, else the unit's path in the module ("blocks.2")
  std::vector<std::string> parameter_names;  ///< the module's names of its parameters, in flat order
  std::vector<std::vector<int64_t>> parameter_shapes;  ///< their full shapes
  std::vector<int64_t> parameter_offsets;              ///< their first elements in the flat layout
  int64_t numel = 0;        ///< elements of its flat layout: its parameters, each starting at a multiple of 32 elements
  int64_t shard_numel = 0;  ///< elements per rank (numel / world rounded up to 32; the last padded)
  bool gathered = false;    ///< whether its full parameters are allocated now
  int64_t gathers = 0;      ///< all-gathers of its parameters since construction (prefetches too)
};

/// Data-parallel training of a model whose parameters are split among the ranks of `process_group` (one device per
/// process), PyTorch FSDP2's fully_shard in C++. Mark the units first: wrap each block of the model in a
/// ddp::ShardedUnit where the block is built or held (a transformer layer, say); then construct this object over the
/// whole model, on every rank alike. Construction checks that every rank built the same model (names, shapes,
/// dtypes: a mismatch throws on every rank naming the first difference), starts every rank from rank 0's parameters
/// and buffers, and splits each unit's parameters into one flat fp shard per rank (and the remaining parameters into
/// the root's): from then on this rank holds numel / world of them, parameters() are those shards, and an optimizer
/// built over parameters() steps on the shards.
///
/// forward() gathers what runs: every unit gathers its parameters (one all-gather) when it starts and frees them when
/// it ends; in backward a unit gathers them again before its gradients are computed, and as soon as its last
/// parameter's gradient is accumulated, reduce-scatters the gradients (one collective per unit, issued in a fixed
/// order on every rank, overlapping the rest of backward), frees the full gradients and parameters, and at the end of
/// backward each shard's .grad holds the average over the ranks of its slice of the gradients (added to what .grad
/// held). Every rank must run the same units in the same order.
///
/// Refused with one line: a parameter in two units (or in a unit and the root), a unit inside a unit, a unit's
/// parameters of mixed dtype, device or requires_grad, a unit run outside forward() of its FullyShardedDataParallel
/// or after it was destroyed. Between steps the model's own parameters are empty tensors (shape [0]; the root's stay
/// gathered after a forward without backward): reading one outside forward() fails in the operation that reads it (a
/// shape mismatch); full_parameters() gathers them. Every rank must get gradients for the same parameters. Not
/// copyable; the model must outlive it, and is left sharded by it.
class FullyShardedDataParallel {
 public:
  using Options = FullyShardOptions;  ///< the options type

  /// Shards `module` (a shared_ptr to any module; holding ddp::ShardedUnit submodules, or none: then it is one unit).
  template <typename ModuleType>
  FullyShardedDataParallel(std::shared_ptr<ModuleType> module, ProcessGroup process_group, Options options = {})
      : FullyShardedDataParallel(std::static_pointer_cast<torch::nn::Module>(module), detail::ModuleForward::of(module),
                                 std::move(process_group), std::move(options)) {}
  /// The same, for a module held by a ModuleHolder (TORCH_MODULE(Net), torch::nn::Sequential).
  template <typename ModuleType>
  FullyShardedDataParallel(const torch::nn::ModuleHolder<ModuleType>& module, ProcessGroup process_group,
                           Options options = {})
      : FullyShardedDataParallel(module.ptr(), std::move(process_group), std::move(options)) {}
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  /// Calls before_forward(), then the module's forward(args...) (a module with a single forward(), or a Sequential).
  template <typename ReturnType = at::Tensor, typename... Args>
  ReturnType forward(Args&&... args) {
    TORCH_CHECK(forward_.callable(),
                "FullyShardedDataParallel::forward: the module has no single forward(); call before_forward(), the "
                "module's own forward, then after_forward()");
    before_forward();
    try {
      ReturnType out = forward_.call<ReturnType>(std::forward<Args>(args)...);
      if constexpr (std::is_same_v<ReturnType, at::Tensor>) track_root_output(out);
      after_forward();
      return out;
    } catch (...) {
      abandon_forward();
      throw;
    }
  }
  /// What forward() does before the module's forward: drops what a backward that threw left, gathers the root's
  /// parameters (collective), and lets the units run. Pair with after_forward().
  void before_forward();
  /// What forward() does after it: the units may no longer run until the next before_forward().
  void after_forward();

  /// The shards, one flat 1-D tensor per unit that has parameters (the root's first): what an optimizer steps on.
  std::vector<at::Tensor> parameters() const;
  /// The model's parameters with their full values, in the module's named_parameters() order: one all-gather per
  /// unit. Collective. Copies: changing them changes nothing.
  std::vector<std::pair<std::string, at::Tensor>> full_parameters() const;
  /// Writes full values (named as full_parameters() names them; every one must be given) into the shards: each rank
  /// keeps its own slice. Not collective. Throws naming the first missing or misshapen one, changing nothing.
  void load_full_parameters(const std::vector<std::pair<std::string, at::Tensor>>& values);
  /// The copies load_full_parameters(values) makes, checked and not made: (a unit's shard, this rank's slice of its
  /// values), one per unit that has parameters. Copying them loads the values (the forward after regathers).
  std::vector<std::pair<at::Tensor, at::Tensor>> shard_copies(
      const std::vector<std::pair<std::string, at::Tensor>>& values) const;

  /// Backward passes inside the scope do not reduce: the full gradients accumulate on every rank (their memory
  /// stays), and the first backward after the scope reduces the sum (gradient accumulation, as no_sync()). Local.
  class NoSyncGuard {
   public:
    /// Turns reduction off until destroyed; throws when a guard is already alive.
    explicit NoSyncGuard(FullyShardedDataParallel& fsdp);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    FullyShardedDataParallel& fsdp_;
  };
  /// A NoSyncGuard for this object (`auto guard = fsdp.no_sync();`).
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  /// The units, the root's own parameters first. Local.
  std::vector<ShardedUnitInfo> units() const;
  /// Bytes this rank holds now in parameter shards, their gradients and the gathered full parameters.
  int64_t held_bytes() const;
  /// The most bytes of gathered full parameters held at once since construction (or the last reset).
  int64_t peak_gathered_bytes() const;
  /// The most bytes of full-size gradient buffers in reduction at once (at most two units' at a time) since
  /// construction (or the last reset).
  int64_t peak_reduction_bytes() const;
  /// Starts peak_gathered_bytes() and peak_reduction_bytes() over from what is held now.
  void reset_peak_gathered_bytes();
  /// Records the steps `timeline` records (docs/observability.md): each unit's all-gather and reduce-scatter from
  /// issue to completion ("comm" lane, "all-gather <unit>", "reduce-scatter <unit>") and the time the host waited for
  /// them ("wait" lane, "wait all-gather <unit>", ...); ddp::collective_hidden_share reads the share that hid behind
  /// compute. The loop records its phases, as with DDP. Null: stops recording. Host times: on CUDA a collective's
  /// interval is its issue to the wait's return (which only orders the stream), so the share means something on the
  /// CPU (Gloo) only.
  void set_timeline(std::shared_ptr<Timeline> timeline);
  /// The wrapped module.
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }
  /// The process group the parameters are split over.
  const ProcessGroup& process_group() const;
  /// The options given at construction.
  const Options& options() const;

 private:
  FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module, detail::ModuleForward forward,
                           ProcessGroup process_group, Options options);
  void abandon_forward() noexcept;
  /// Gathers the root's parameters again when backward reaches the model's output (a second backward through a
  /// retained graph, after the first freed them).
  void track_root_output(const at::Tensor& output);

  std::shared_ptr<torch::nn::Module> module_;
  detail::ModuleForward forward_;
  std::shared_ptr<detail::ShardedRun> run_;
};

}  // namespace ddp
