#pragma once

// One unit of full sharding: its parameters laid back to back in a flat buffer of world * chunk elements, of which
// this rank keeps [rank * chunk, (rank + 1) * chunk) (the shard, the optimizer's parameter); the gather that fills
// the buffer and points the parameters at it, the free that empties it, and the reduction of the unit's gradients
// into the shard's .grad. Internal to ddp/fsdp (ddp::detail); ShardedRun decides when each happens.

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ddp/process_group.h>
#include <ddp/timeline.h>

namespace ddp::detail {

/// Every parameter starts at a multiple of this many elements in the flat buffer, and every shard is a multiple of it
/// long: an element then sits at the same position within a vector block of the fused CPU optimizer kernels as in its
/// own tensor (kernels/cpu/fused_optimizers_cpu.cpp: a block is two fp32 vectors, up to 32 elements, and an element's
/// last bit can depend on which of the two it is in), so that the fused step on a shard computes each element as on
/// the unsharded parameter. At most 31 elements of padding per parameter.
constexpr int64_t kParameterAlignment = 32;

/// A parameter of a unit: the model's tensor (it keeps its identity: set_data swaps what it views) and where it lies
/// in the unit's flat buffer.
struct UnitParameter {
  std::string name;
  at::Tensor param;         ///< the model's parameter
  at::Tensor full_view;     ///< the parameter's shape over the flat buffer's storage (what it views when gathered)
  at::Tensor empty;         ///< a 0-element tensor (what it views when sharded)
  int64_t offset = 0;       ///< its first element in the flat buffer (a multiple of kParameterAlignment)
  bool grad_ready = false;  ///< its gradient was accumulated in this backward pass
};

class FlatUnit {
 public:
  enum class State { kSharded, kGathering, kGathered };

  /// Takes the parameters' current values as the unit's (every rank must pass the same ones, in the same order:
  /// checked by the caller) and keeps this rank's shard, in the parameters' dtype; leaves the parameters gathered,
  /// as views of the flat buffer in `param_dtype` (nullopt: their own), for the caller to hook and then reshard().
  /// The parameters share one dtype and device (checked by the caller). `name`: for messages ("" for the root).
  FlatUnit(std::string name, std::vector<std::pair<std::string, at::Tensor>> params, ProcessGroup pg,
           std::optional<c10::ScalarType> param_dtype, std::optional<c10::ScalarType> reduce_dtype);
  ~FlatUnit();
  FlatUnit(const FlatUnit&) = delete;
  FlatUnit& operator=(const FlatUnit&) = delete;

  const std::string& name() const { return name_; }
  /// "the root" or "unit '<name>'", for messages.
  std::string label() const;
  std::vector<UnitParameter>& params() { return params_; }
  const std::vector<UnitParameter>& params() const { return params_; }
  /// Elements of the flat layout: the parameters and the padding between them (not the padding at the end).
  int64_t numel() const { return numel_; }
  int64_t chunk() const { return chunk_; }
  /// This rank's shard: a 1-D leaf of chunk() elements (requires grad when the parameters do).
  const at::Tensor& shard() const { return shard_; }
  bool requires_grad() const { return requires_grad_; }
  State state() const { return state_; }
  /// Bytes of the flat buffer while it is allocated (gathering or gathered), else 0.
  int64_t gathered_bytes() const;

  /// Allocates the flat buffer and starts the all-gather into it (nothing when not sharded). Collective.
  void start_gather();
  /// How many times start_gather() gathered since construction.
  int64_t gathers() const { return gathers_; }
  /// Ends the gather (starting it first when sharded) and points the parameters at the full values.
  void wait_gathered();
  /// Points the parameters at empty tensors and frees the flat buffer (waiting for a gather in flight first).
  void reshard();

  /// Parameter `i` got its gradient in this backward; true when it was the unit's last.
  bool note_grad_ready(size_t i);
  /// Whether every parameter got its gradient in this backward.
  bool all_grads_ready() const { return ready_ == params_.size(); }
  /// Starts the reduction of the unit's gradients (a parameter without one contributes zeros) and drops the
  /// parameters' full gradients. Collective: every rank launches the same units in the same order.
  void launch_reduction();
  bool reduction_launched() const { return reduction_.defined(); }
  /// Waits for the reduction and adds this rank's slice of the average to the shard's .grad.
  void finish_reduction();
  /// Forgets the pass: the readiness marks, and a reduction in flight (waited for, its result dropped: after a
  /// backward that threw). Never throws.
  void reset_pass() noexcept;
  /// Drops the parameters' full gradients (what a backward that threw left, not yet reduced).
  void drop_full_grads() noexcept;
  /// Bytes of the reduction's buffers while one is in flight, else 0.
  int64_t reduction_bytes() const;

  /// Records its collectives into `recorder` while it records ("comm" lane: "all-gather <label>", "reduce-scatter
  /// <label>", from issue to completion) and the time the host waited for them ("wait" lane: "wait all-gather
  /// <label>", ...); null: nothing recorded. Host times (on CUDA: issue and wait on the host, not the stream's).
  void set_recorder(std::shared_ptr<Timeline> recorder) { recorder_ = std::move(recorder); }

  /// The unit's full flat values in the shard's dtype (world * chunk elements, padding last): an all-gather of the
  /// shards, whatever is gathered now. Collective.
  at::Tensor gather_flat() const;

 private:
  /// A collective issued while a timeline records: that timeline (its events go there, whatever is set by the
  /// wait), when, and when it completed (null: taken at the wait).
  struct Issued {
    std::shared_ptr<Timeline> timeline;  ///< null: not recorded
    Timeline::Clock::time_point at;
    std::shared_ptr<CompletionTime> completed;
  };
  void point_params_at(bool full);
  Issued issued(const c10::intrusive_ptr<c10d::Work>& work) const;
  /// Waits for `work` (moved out of its slot) and records it as `collective`, with the wait from `began`, when
  /// `record` says so.
  void wait_for(c10::intrusive_ptr<c10d::Work>& work, Issued& record, const char* collective, const std::string& what,
                Timeline::Clock::time_point began);

  std::string name_;
  ProcessGroup pg_;
  std::vector<UnitParameter> params_;
  int64_t numel_ = 0;
  int64_t chunk_ = 0;
  bool requires_grad_ = false;
  c10::ScalarType reduce_dtype_;
  at::Tensor full_;   ///< world * chunk elements of param_dtype; its storage is freed while sharded
  at::Tensor shard_;  ///< the optimizer's parameter
  State state_ = State::kGathered;
  c10::intrusive_ptr<c10d::Work> gather_;
  at::Tensor gather_input_;  ///< the shard cast to param_dtype while a gather is in flight
  size_t ready_ = 0;
  int64_t gathers_ = 0;
  at::Tensor reduction_;  ///< the collective's buffer while a reduction is in flight
  at::Tensor received_;   ///< NCCL: the reduce-scatter's output
  c10::intrusive_ptr<c10d::Work> reduce_;
  std::shared_ptr<Timeline> recorder_;
  Issued gather_issued_;
  Issued reduce_issued_;
};

}  // namespace ddp::detail
