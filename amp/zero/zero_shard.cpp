// ZeroShard: the layout (Note [ZeRO layout]), the unscaling of reduced buckets into the shard, clipping over every
// rank's shard and what it holds. Its step and publish: zero_publish.cpp; its checkpoints: zero_checkpoint.cpp.

#include <amp/zero/zero_shard.h>

#include <algorithm>
#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include <amp/loss_scaler.h>
#include <amp/optim/fused_optimizer.h>
#include <amp/state/param_slots.h>
#include <amp/state/sharded_norm.h>
#include <ddp/distributed_data_parallel.h>
#include <kernels/multi_tensor/scaled_copy.h>

namespace amp::detail {

ZeroShard::ZeroShard(const OwnerContext& context, ddp::DistributedDataParallel& ddp, ZeroStage stage,
                     ZeroPublish publish)
    : slots_(context.slots),
      optimizer_(context.optimizer),
      fused_(context.fused),
      pg_(ddp.process_group()),
      stage_(stage),
      publish_mode_(publish) {
  TORCH_CHECK(stage == ZeroStage::kOne || stage == ZeroStage::kTwo, "ZeRO: unknown stage ", static_cast<int>(stage));
  TORCH_CHECK(fused_ != nullptr,
              "amp: ZeRO needs one of amp's fused optimizers (amp::FusedAdam, FusedAdamW or FusedSGD), which step "
              "flat shards; got a plain torch::optim optimizer");
  TORCH_CHECK(context.untouched,
              "amp: attach(ddp, ZeroStage) must come before the first scale_loss and step(): the optimizer's state is "
              "created sharded");
  TORCH_CHECK(fused_->state_tensors().empty(),
              "amp: attach(ddp, ZeroStage) must come before load_checkpoint and the first step: the optimizer already "
              "holds state for whole parameters, and ZeRO creates it sharded (load the checkpoint after attach)");
  TORCH_CHECK(context.policy.master_weights || context.policy.cast_model_type == at::kFloat,
              "amp: ZeRO shards fp32 master weights: use O2 (or O0/O1, whose fp32 parameters are their own masters); "
              "O3 keeps no masters");
  const auto wire = ddp.options().allreduce_dtype();
  TORCH_CHECK(!wire || *wire != at::kDouble,
              "amp: ZeRO does not take allreduce_dtype(kDouble) buckets (the fused kernels read fp32/fp16/bf16)");
  const int world = pg_.size();
  const int me = pg_.rank();

  std::vector<int64_t> group_of(slots_.size(), 0);
  slot_index_in_group_.assign(slots_.size(), 0);
  {
    size_t i = 0;
    const auto& groups = optimizer_.param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      for (size_t k = 0; k < groups[g].params().size(); ++k) {
        slot_index_in_group_[i] = static_cast<int64_t>(k);
        group_of[i++] = static_cast<int64_t>(g);
      }
    }
  }

  ddp.freeze_bucket_layout();  // Note [ZeRO layout]: the shards follow the buckets
  const std::vector<ddp::BucketInfo> buckets = ddp.buckets();
  std::vector<bool> covered(slots_.size(), false);
  std::vector<c10::ScalarType> dtypes;
  std::vector<int64_t> send_size;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const ddp::BucketInfo& info = buckets[b];
    std::vector<int64_t> members, starts;
    int64_t numel = 0;
    for (const std::string& name : info.parameter_names) {
      const int64_t index = slots_.index_of(name);
      TORCH_CHECK(index >= 0, "amp: ZeRO: parameter '", name,
                  "' is reduced by DistributedDataParallel but the optimizer does not hold it; ZeRO shards what the "
                  "optimizer updates, so give the optimizer every parameter that requires grad");
      const ParamSlot& slot = slots_[static_cast<size_t>(index)];
      TORCH_CHECK(slot.model.is_contiguous(), "amp: ZeRO needs contiguous parameters, but '", name, "' is not");
      members.push_back(index);
      starts.push_back(numel);
      covered[static_cast<size_t>(index)] = true;
      numel += slot.model.numel();
    }
    const c10::ScalarType dtype = slots_[static_cast<size_t>(members.front())].model.scalar_type();
    size_t d = 0;
    while (d < dtypes.size() && dtypes[d] != dtype) ++d;
    if (d == dtypes.size()) {
      dtypes.push_back(dtype);
      send_size.push_back(0);
    }
    shards_.push_back(ddp::shard_bucket(numel, world));
    const ddp::BucketShards& s = shards_.back();
    my_pieces_.emplace_back();
    publish_.push_back(PublishRange{d, send_size[d], s.chunk, pieces_.size(), 0});
    for (int q = 0; q < world; ++q) {
      const int64_t lo = s.begin(q), hi = lo + s.size(q);
      for (size_t k = 0; k < members.size(); ++k) {
        const int64_t p_lo = starts[k], p_hi = starts[k] + slots_[static_cast<size_t>(members[k])].model.numel();
        const int64_t a = std::max(lo, p_lo), e = std::min(hi, p_hi);
        if (a >= e) continue;
        Piece piece;
        piece.slot = members[k];
        piece.param_offset = a - p_lo;
        piece.numel = e - a;
        piece.bucket = static_cast<int64_t>(b);
        piece.bucket_offset = a;
        piece.rank = q;
        piece.dtype = d;
        piece.send_offset = send_size[d] + (a - lo);
        piece.group = group_of[static_cast<size_t>(members[k])];
        if (q == me) my_pieces_.back().push_back(pieces_.size());
        pieces_.push_back(piece);
      }
    }
    send_size[d] += s.chunk;
    publish_.back().pieces_end = pieces_.size();
    chunk_offset_.push_back(chunk_total_);
    chunk_total_ += s.chunk;
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    TORCH_CHECK(
        covered[i], "amp: ZeRO: the optimizer holds '", slots_[i].name,
        "' but DistributedDataParallel does not reduce it (requires_grad=false?); remove it from the optimizer");
  }

  // This rank's shard: fp32 masters taken from the full masters (or the fp32 parameters), the send buffers from the
  // model's current values (what a skipped first step all-gathers back).
  int64_t shard_numel = 0;
  for (const auto& mine : my_pieces_) {
    for (size_t i : mine) {
      pieces_[i].shard_offset = shard_numel;
      shard_numel += pieces_[i].numel;
    }
  }
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(slots_.device());
  masters_ = at::empty({shard_numel}, fp32);
  grads_ = at::zeros({shard_numel}, fp32);
  bucket_scale_ = at::empty({1}, fp32);
  for (size_t d = 0; d < dtypes.size(); ++d) send_.push_back(at::zeros({send_size[d]}, fp32.dtype(dtypes[d])));
  at::NoGradGuard no_grad;
  for (const auto& mine : my_pieces_) {
    for (size_t i : mine) {
      Piece& p = pieces_[i];
      const ParamSlot& slot = slots_[static_cast<size_t>(p.slot)];
      const at::Tensor& full = slot.has_master ? slot.master : slot.model;
      p.held = masters_.narrow(0, p.shard_offset, p.numel);
      p.held.copy_(full.detach().reshape({-1}).narrow(0, p.param_offset, p.numel));
      p.grad = grads_.narrow(0, p.shard_offset, p.numel);
      p.out = send_[p.dtype].narrow(0, p.send_offset, p.numel);
      p.out.copy_(slot.model.detach().reshape({-1}).narrow(0, p.param_offset, p.numel));
    }
  }
  // The optimizer now holds the pieces, group by group, in bucket order; the full masters are dropped.
  auto& groups = optimizer_.param_groups();
  std::vector<std::vector<at::Tensor>> held(groups.size());
  for (const auto& mine : my_pieces_) {
    for (size_t i : mine) held[static_cast<size_t>(pieces_[i].group)].push_back(pieces_[i].held);
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& mine : my_pieces_) {
      for (size_t i : mine) {
        if (pieces_[i].group != static_cast<int64_t>(g)) continue;
        step_order_.push_back(i);
      }
    }
    groups[g].params() = std::move(held[g]);
  }
  std::vector<int64_t> next_in_group(groups.size(), 0);
  for (size_t i : step_order_) pieces_[i].index_in_group = next_in_group[static_cast<size_t>(pieces_[i].group)]++;
  slots_.drop_masters();
  if (stage == ZeroStage::kTwo) ddp.set_gradient_sharding(true);
}

void ZeroShard::accumulate(const std::vector<size_t>& pieces, const std::vector<at::Tensor>& src,
                           const at::Tensor& scale, LossScaler& scaler) {
  if (pieces.empty()) return;
  // A piece that already holds a gradient (an earlier loss of this step) gets this one's share added.
  std::vector<at::Tensor> dst, scratch;
  std::vector<size_t> scratch_piece;
  std::vector<int64_t> index;
  for (size_t i : pieces) {
    Piece& p = pieces_[i];
    index.push_back(p.slot);
    if (p.has_grad) {
      scratch.push_back(at::empty_like(p.grad));
      scratch_piece.push_back(i);
      dst.push_back(scratch.back());
    } else {
      dst.push_back(p.grad);
    }
  }
  kernels::scaled_copy_(src, dst, scale, scaler.found_inf(), scaler.first_nonfinite_index(), index);
  for (size_t k = 0; k < scratch.size(); ++k) pieces_[scratch_piece[k]].grad.add_(scratch[k]);
  for (size_t i : pieces) {
    Piece& p = pieces_[i];
    if (!p.has_grad) p.held.mutable_grad() = p.grad;
    p.has_grad = true;
  }
}

bool ZeroShard::consume_bucket(const ddp::ReducedBucket& bucket, LossScaler* scaler) {
  check_published("a synchronized backward pass reached DDP's reduced bucket");
  if (scaler == nullptr) return false;
  TORCH_CHECK(bucket.index >= 0 && bucket.index < static_cast<int64_t>(my_pieces_.size()), "amp: ZeRO got bucket ",
              bucket.index, " of a layout with ", my_pieces_.size(), " buckets");
  const std::vector<size_t>& mine = my_pieces_[static_cast<size_t>(bucket.index)];
  std::vector<at::Tensor> src;
  for (size_t i : mine)
    src.push_back(bucket.buffer.narrow(0, pieces_[i].bucket_offset - bucket.offset, pieces_[i].numel));
  bucket_scale_.copy_(scaler->inv_scale()).mul_(bucket.average_scale);
  accumulate(mine, src, bucket_scale_, *scaler);
  // The rest of the bucket's gradients belong to other ranks' shards: freed.
  for (const at::Tensor& param : bucket.params) const_cast<at::Tensor&>(param).mutable_grad() = at::Tensor();
  return true;
}

bool ZeroShard::end_loss(LossScaler& scaler, bool reduce_flag) {
  // Stage 1, buckets DDP wrote back itself (backward outside an attached scope, or delay_unscale): this rank's
  // pieces of the averaged gradients.
  std::vector<size_t> pieces;
  std::vector<at::Tensor> src;
  for (const auto& mine : my_pieces_) {
    for (size_t i : mine) {
      const at::Tensor& grad = slots_[static_cast<size_t>(pieces_[i].slot)].model.grad();
      if (!grad.defined()) continue;
      pieces.push_back(i);
      src.push_back(grad.contiguous().reshape({-1}).narrow(0, pieces_[i].param_offset, pieces_[i].numel));
    }
  }
  accumulate(pieces, src, scaler.inv_scale(), scaler);
  for (ParamSlot& slot : slots_) slot.model.mutable_grad() = at::Tensor();
  // Each rank checked only its shard: one allreduce makes the flag (and so the scale update and the skip) agree.
  // MAX, not SUM: the flag is 0 or 1 on every rank, as on plain DDP + amp, however many ranks overflowed (the
  // scaler adds it to skipped_steps and multiplies floor_overflows by it). reduce_flag false: the caller folds it
  // into a collective of its own (the FP8 amax reduction, also MAX).
  if (!reduce_flag) return true;
  at::Tensor flag = scaler.found_inf();
  pg_.allreduce_max_(flag, "ZeRO overflow flag allreduce");
  return false;
}

std::vector<at::Tensor> ZeroShard::grads() const {
  std::vector<at::Tensor> out;
  for (size_t i : step_order_) {
    if (pieces_[i].has_grad) out.push_back(pieces_[i].grad);
  }
  return out;
}

void ZeroShard::zero_grad() {
  for (size_t i : step_order_) {
    pieces_[i].held.mutable_grad() = at::Tensor();
    pieces_[i].has_grad = false;
  }
}

at::Tensor ZeroShard::clip_grad_norm_(double max_norm, const at::Tensor& found_inf) {
  return sharded_clip_grad_norm_(grads(), max_norm, found_inf, pg_, "ZeRO gradient norm allreduce");
}

int64_t ZeroShard::chunk_position(const Piece& p) const {
  return chunk_offset_[static_cast<size_t>(p.bucket)] + p.bucket_offset -
         shards_[static_cast<size_t>(p.bucket)].begin(p.rank);
}

at::Tensor ZeroShard::gather_chunks(int64_t width,
                                    const std::function<void(const Piece&, int64_t, at::Tensor)>& fill) const {
  at::Tensor mine = at::zeros({width * chunk_total_}, masters_.options());
  for (const auto& pieces : my_pieces_) {
    for (size_t i : pieces) {
      const Piece& p = pieces_[i];
      for (int64_t w = 0; w < width; ++w) fill(p, w, mine.narrow(0, w * chunk_total_ + chunk_position(p), p.numel));
    }
  }
  at::Tensor all = at::empty({mine.numel() * pg_.size()}, mine.options());
  if (pg_.size() == 1) {
    all.copy_(mine);
  } else {
    pg_.allgather_into(all, mine);
  }
  return all;
}

std::vector<at::Tensor> ZeroShard::full_masters() const {
  const at::Tensor all = gather_chunks(1, [](const Piece& p, int64_t, at::Tensor dst) { dst.copy_(p.held.detach()); });
  std::vector<at::Tensor> full;
  for (const ParamSlot& slot : slots_) full.push_back(at::empty(slot.model.sizes(), masters_.options()));
  for (const Piece& p : pieces_) {
    full[static_cast<size_t>(p.slot)]
        .view({-1})
        .narrow(0, p.param_offset, p.numel)
        .copy_(all.narrow(0, p.rank * chunk_total_ + chunk_position(p), p.numel));
  }
  return full;
}

HeldBytes ZeroShard::held_bytes() const {
  HeldBytes bytes;
  bytes.masters = held_storage_bytes({masters_});
  bytes.master_grads = held_storage_bytes({grads_});
  bytes.optimizer_state = held_storage_bytes(fused_->state_tensors());
  return bytes;
}

}  // namespace amp::detail
