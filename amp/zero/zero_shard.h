#pragma once

// The sharded sibling of State's replicated master weights (ZeRO stages 1 and 2, docs/zero.md). Internal: users go
// through amp::Optimizer::attach(ddp, amp::ZeroStage).

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/serialize/archive.h>

#include <amp/state/gradient_owner.h>
#include <amp/zero/zero.h>
#include <ddp/process_group.h>
#include <ddp/shard_layout.h>

namespace ddp {
class DistributedDataParallel;
}  // namespace ddp

namespace amp::detail {

/// This rank's shard of the fp32 masters, their gradients and (through the optimizer, whose param groups it
/// rewrites to hold the shard's pieces) the optimizer state.
///
/// Note [ZeRO layout]
/// The flat space is DDP's buckets, frozen at attach: bucket b's elements are split by ddp::shard_bucket and rank q
/// owns slice q of every bucket. A piece is the part of one parameter inside one rank's slice of one bucket (a
/// parameter straddling a slice boundary has a piece on each side). This rank's pieces lie back to back, in bucket
/// order, in one fp32 tensor of masters and one of master gradients; the optimizer holds each piece as a 1-D view
/// of the masters, so its elementwise update is the unsharded one and its per-parameter state is per piece. The
/// step writes each piece's rounded value into a send buffer per model dtype (the slice padded to the bucket's
/// chunk, as on the wire), and one all-gather per bucket brings every rank's slices into every model parameter.
///
/// The gradient owner of ZeRO stages 1 and 2 (Note [gradient owner] in amp/state/gradient_owner.h): State::attach
/// puts it in place of the replicated owner, which it takes the slots' masters from.
class ZeroShard final : public GradientOwner, public ShardedOwner {
 public:
  /// Needs one of amp's fused optimizers, an untouched state, and fp32 masters (O0-O2); shards along `ddp`'s buckets
  /// (frozen here), rewrites the optimizer's param groups to hold this rank's pieces, and drops the slots' masters.
  ZeroShard(const OwnerContext& context, ddp::DistributedDataParallel& ddp, ZeroStage stage,
            ZeroPublish publish = ZeroPublish::kInStep);
  /// Completes a pending publish into the model, which may outlive the optimizer (a failure becomes a warning).
  ~ZeroShard() override;
  ZeroShard(const ZeroShard&) = delete;
  ZeroShard& operator=(const ZeroShard&) = delete;

  ZeroStage stage() const { return stage_; }
  ZeroPublish publish_mode() const { return publish_mode_; }
  /// Completes a pending publish (finish_publish).
  void wait_for_parameters() override { finish_publish(); }
  /// Refuses while a publish is pending (check_published): the forward bypassed amp::Model.
  void check_parameters_current(const char* what) const override { check_published(what); }
  /// Nothing to put aside: earlier losses' gradients are in the shard already.
  void begin_loss(bool /*starts_cycle*/) override {}
  /// Unscales this rank's slice of a reduced bucket into the shard's master gradients and frees the bucket's model
  /// gradients; false outside a scope that unscales (stage 1: DDP writes the average back; stage 2: DDP refuses).
  bool consume_bucket(const ddp::ReducedBucket& bucket, LossScaler* scaler) override;
  /// The scope's end (delay_unscale=false): unscales the gradients DDP wrote back (buckets not consumed, stage 1),
  /// frees every model gradient, and makes the loss's overflow flag the same on every rank (one 1-element
  /// allreduce; reduce_flag false: returns true and the caller reduces it in a collective of its own). Collective.
  bool end_loss(LossScaler& scaler, bool reduce_flag) override;
  /// The optimizer's step on the shard (skipped on the device when found_inf is set), then the all-gather of every
  /// rank's updated slices into the model parameters: completed here under ZeroPublish::kInStep, left pending under
  /// kAtNextForward (Note [deferred publish]). A publish still pending from the last step completes first. Collective.
  void step(FusedOptimizer& fused, const at::Tensor& found_inf) override;
  /// Under ZeroPublish::kAtNextForward the all-gather completes outside the capture: refused.
  void check_capturable(const c10::Device& device) const override;
  /// The shard's gradients the optimizer will read (pieces that received one).
  std::vector<at::Tensor> grads() const override;
  void zero_grad() override;
  /// clip_grad_norm_ over all ranks' shards: the global norm from the per-shard sums of squares (one 1-element
  /// allreduce), applied to this shard. A non-finite norm sets found_inf and leaves the gradients. Collective.
  at::Tensor clip_grad_norm_(double max_norm, const at::Tensor& found_inf) override;
  HeldBytes held_bytes() const override;
  /// Every parameter's full fp32 master, assembled from all ranks' shards (one all-gather), in slot order.
  /// Collective. For checkpoints and tests: it materializes the whole model in fp32 on every rank.
  std::vector<at::Tensor> full_masters() const override;

  // Checkpoints (docs/zero.md). A consolidated checkpoint is the file a non-sharded run writes, so it loads at any
  // world size, and into plain DDP + amp and back.
  /// Every parameter's optimizer state assembled from all ranks' pieces in the unsharded layout (`group<g>.<field>.<j>`
  /// for the parameter's index j in group g): what the optimizer's save() writes without ZeRO. Collective.
  void save_consolidated_optimizer(torch::serialize::OutputArchive& archive) const override;
  /// From an archive in the unsharded layout, this rank's pieces, as the bytes of an archive the optimizer's load()
  /// takes. Checks every entry's size first; changes nothing.
  std::string shard_optimizer_archive(torch::serialize::InputArchive& full) const override;
  /// Appends the (destination, value) copies that put full fp32 `values` (one per slot) into this rank's masters and
  /// the send buffers (what a skipped next step all-gathers).
  void master_copies(const std::vector<at::Tensor>& values,
                     std::vector<std::pair<at::Tensor, at::Tensor>>& out) const override;
  /// Sharded checkpoints (ShardedOwner): this rank's pieces in a shard file; a load from files of any world size.
  std::string save_shard() const override;
  ShardLoad begin_shard_load() const override;
  void read_shard(const std::string& bytes, ShardLoad& load) const override;
  std::string finish_shard_load(const ShardLoad& load,
                                std::vector<std::pair<at::Tensor, at::Tensor>>& copies) const override;
  /// Publishes the loaded masters into the model parameters. Collective.
  void after_shard_load() override { publish(); }
  /// All-gathers every rank's send buffer into the model parameters (the second half of step()), bucket by bucket,
  /// copying each bucket as soon as it arrives (Note [pipelined publish]), and returns when all are copied, whatever
  /// the publish mode (a pending publish completes first). Collective.
  void publish();
  /// The two halves of publish(). start_publish: starts one all-gather per bucket from the send buffers, which
  /// must then stay untouched until finish_publish; needs none pending. Collective. finish_publish: waits for each
  /// bucket's all-gather in order and copies it into the model parameters, freeing its buffer; nothing to do when
  /// none is pending. A failed all-gather throws (pg.wait's error) and leaves none pending. Not collective.
  void start_publish();
  void finish_publish();
  bool publish_pending() const { return !pending_works_.empty(); }
  /// Throws, saying that the forward pass ran on the previous step's parameters, when a publish is pending (Note
  /// [deferred publish]): `what` says what found it ("scale_loss began").
  void check_published(const char* what) const {
    if (publish_pending()) fail_pending(what);
  }
  /// Rank 0's `value` on every rank (one broadcast). Collective.
  int64_t broadcast_from_root(int64_t value) const override;
  /// How many ranks pass ok = false (one allreduce): every rank takes the same decision. Collective.
  int64_t count_failures(bool ok) const override;
  int rank() const override { return pg_.rank(); }

 private:
  struct Piece {
    int64_t slot = 0;          ///< the parameter's slot (ParamSlots)
    int64_t param_offset = 0;  ///< first element inside the (flattened) parameter
    int64_t numel = 0;
    int64_t bucket = 0;
    int64_t bucket_offset = 0;   ///< first element inside the bucket
    int rank = 0;                ///< the rank whose slice holds it
    size_t dtype = 0;            ///< index into send_
    int64_t send_offset = 0;     ///< first element inside its rank's send buffer
    int64_t shard_offset = 0;    ///< this rank's pieces: first element inside masters_ / grads_
    int64_t group = 0;           ///< the optimizer's param group
    int64_t index_in_group = 0;  ///< this rank's pieces: position among the pieces the optimizer holds in that group
    at::Tensor held;             ///< this rank's pieces: masters_ view the optimizer holds
    at::Tensor grad;             ///< this rank's pieces: grads_ view
    at::Tensor out;              ///< this rank's pieces: send buffer view the step writes the rounded value to
    bool has_grad = false;       ///< received a gradient since zero_grad
  };
  /// One all-gather of a chunk-layout buffer per rank (`width` values per element): fill(piece, dst) writes this
  /// rank's piece; the result holds rank q's buffer at [q * width * chunk_total_, ...).
  at::Tensor gather_chunks(int64_t width, const std::function<void(const Piece&, int64_t, at::Tensor)>& fill) const;
  /// This rank's pieces for a shard file, after a zero-length one per parameter (so that a file's piece of any
  /// parameter of the model is known, on every rank).
  std::vector<ShardPiece> shard_pieces() const;
  /// Where piece p's first element lies in its rank's chunk-layout buffer.
  int64_t chunk_position(const Piece& p) const;
  [[noreturn]] void fail_pending(const char* what) const;
  /// Writes `src` (unscaled by `scale`, checked) into the pieces' gradients (added where they already hold one).
  void accumulate(const std::vector<size_t>& pieces, const std::vector<at::Tensor>& src, const at::Tensor& scale,
                  LossScaler& scaler);

  ParamSlots& slots_;
  torch::optim::Optimizer& optimizer_;
  FusedOptimizer* fused_;  ///< checked non-null at construction
  ddp::ProcessGroup pg_;
  ZeroStage stage_;
  ZeroPublish publish_mode_;
  std::vector<ddp::BucketShards> shards_;       ///< per bucket
  std::vector<std::vector<size_t>> my_pieces_;  ///< per bucket: indices into pieces_ of this rank's pieces
  std::vector<Piece> pieces_;                   ///< every rank's, bucket by bucket, rank by rank
  std::vector<size_t> step_order_;              ///< this rank's pieces in the optimizer's param-group order
  at::Tensor masters_, grads_;                  ///< this rank's shard, fp32
  std::vector<at::Tensor> send_;                ///< per model dtype: this rank's slices, padded to the chunks
  struct PublishRange {                         ///< Note [pipelined publish]: one all-gather per bucket
    size_t dtype = 0;                           ///< index into send_
    int64_t send_begin = 0;                     ///< the bucket's chunk in send_[dtype]
    int64_t chunk = 0;
    size_t pieces_begin = 0, pieces_end = 0;  ///< its pieces (every rank's) in pieces_
  };
  std::vector<PublishRange> publish_;         ///< per bucket
  std::vector<int64_t> chunk_offset_;         ///< per bucket: where its chunk starts in a rank's all-dtype gather
  int64_t chunk_total_ = 0;                   ///< the sum of every bucket's chunk
  at::Tensor bucket_scale_;                   ///< consume_bucket's average * inv_scale (1-element fp32)
  std::vector<int64_t> slot_index_in_group_;  ///< per slot: its position in its param group without ZeRO
  // Note [deferred publish]: between start_publish and finish_publish, per bucket (empty when none is pending).
  std::vector<at::Tensor> pending_gathered_;                   ///< every rank's chunks of the bucket
  std::vector<c10::intrusive_ptr<c10d::Work>> pending_works_;  ///< null where nothing travels (one rank)
};

}  // namespace amp::detail
