#include <amp/zero/zero_shard.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include <amp/optim/fused_optimizer.h>
#include <amp/loss_scaler.h>
#include <amp/state/state.h>
#include <ddp/distributed_data_parallel.h>
#include <kernels/multi_tensor/l2_norm.h>
#include <kernels/multi_tensor/scaled_copy.h>

namespace amp::detail {
namespace {

int64_t storage_bytes(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const void*> seen;
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) continue;
    const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    if (seen.insert(storage).second) bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return bytes;
}

}  // namespace

int64_t held_storage_bytes(const std::vector<at::Tensor>& tensors) { return storage_bytes(tensors); }

ZeroShard::ZeroShard(State& state, ddp::DistributedDataParallel& ddp, ZeroStage stage, ZeroPublish publish)
    : state_(state), pg_(ddp.process_group()), stage_(stage), publish_mode_(publish) {
  TORCH_CHECK(stage == ZeroStage::kOne || stage == ZeroStage::kTwo, "ZeRO: unknown stage ", static_cast<int>(stage));
  TORCH_CHECK(state.fused_ != nullptr,
              "amp: ZeRO needs one of amp's fused optimizers (amp::FusedAdam, FusedAdamW or FusedSGD), which step "
              "flat shards; got a plain torch::optim optimizer");
  TORCH_CHECK(state.steps_ == 0 && !state.unscaled_this_step_ && state.active_loss_id_ < 0,
              "amp: attach(ddp, ZeroStage) must come before the first scale_loss and step(): the optimizer's state is "
              "created sharded");
  TORCH_CHECK(state.fused_->state_tensors().empty(),
              "amp: attach(ddp, ZeroStage) must come before load_checkpoint and the first step: the optimizer already "
              "holds state for whole parameters, and ZeRO creates it sharded (load the checkpoint after attach)");
  TORCH_CHECK(state.policy_.master_weights || state.policy_.cast_model_type == at::kFloat,
              "amp: ZeRO shards fp32 master weights: use O2 (or O0/O1, whose fp32 parameters are their own masters); "
              "O3 keeps no masters");
  const auto wire = ddp.options().allreduce_dtype();
  TORCH_CHECK(!wire || *wire != at::kDouble,
              "amp: ZeRO does not take allreduce_dtype(kDouble) buckets (the fused kernels read fp32/fp16/bf16)");
  const int world = pg_.size();
  const int me = pg_.rank();

  std::unordered_map<std::string, int64_t> slot_of;
  for (size_t i = 0; i < state.slots_.size(); ++i) slot_of[state.slots_[i].name] = static_cast<int64_t>(i);
  std::vector<int64_t> group_of(state.slots_.size(), 0);
  slot_index_in_group_.assign(state.slots_.size(), 0);
  {
    size_t i = 0;
    const auto& groups = state.optimizer_->param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      for (size_t k = 0; k < groups[g].params().size(); ++k) {
        slot_index_in_group_[i] = static_cast<int64_t>(k);
        group_of[i++] = static_cast<int64_t>(g);
      }
    }
  }

  ddp.freeze_bucket_layout();  // Note [ZeRO layout]: the shards follow the buckets
  const std::vector<ddp::BucketInfo> buckets = ddp.buckets();
  std::vector<bool> covered(state.slots_.size(), false);
  std::vector<c10::ScalarType> dtypes;
  std::vector<int64_t> send_size;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const ddp::BucketInfo& info = buckets[b];
    std::vector<int64_t> members, starts;
    int64_t numel = 0;
    for (const std::string& name : info.parameter_names) {
      const auto it = slot_of.find(name);
      TORCH_CHECK(it != slot_of.end(), "amp: ZeRO: parameter '", name,
                  "' is reduced by DistributedDataParallel but the optimizer does not hold it; ZeRO shards what the "
                  "optimizer updates, so give the optimizer every parameter that requires grad");
      const ParamSlot& slot = state.slots_[static_cast<size_t>(it->second)];
      TORCH_CHECK(slot.model.is_contiguous(), "amp: ZeRO needs contiguous parameters, but '", name, "' is not");
      members.push_back(it->second);
      starts.push_back(numel);
      covered[static_cast<size_t>(it->second)] = true;
      numel += slot.model.numel();
    }
    const c10::ScalarType dtype = state.slots_[static_cast<size_t>(members.front())].model.scalar_type();
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
        const int64_t p_lo = starts[k], p_hi = starts[k] + state.slots_[static_cast<size_t>(members[k])].model.numel();
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
  for (size_t i = 0; i < state.slots_.size(); ++i) {
    TORCH_CHECK(
        covered[i], "amp: ZeRO: the optimizer holds '", state.slots_[i].name,
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
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(state.device_);
  masters_ = at::empty({shard_numel}, fp32);
  grads_ = at::zeros({shard_numel}, fp32);
  for (size_t d = 0; d < dtypes.size(); ++d) send_.push_back(at::zeros({send_size[d]}, fp32.dtype(dtypes[d])));
  at::NoGradGuard no_grad;
  for (const auto& mine : my_pieces_) {
    for (size_t i : mine) {
      Piece& p = pieces_[i];
      const ParamSlot& slot = state.slots_[static_cast<size_t>(p.slot)];
      const at::Tensor& full = slot.has_master ? slot.master : slot.model;
      p.held = masters_.narrow(0, p.shard_offset, p.numel);
      p.held.copy_(full.detach().reshape({-1}).narrow(0, p.param_offset, p.numel));
      p.grad = grads_.narrow(0, p.shard_offset, p.numel);
      p.out = send_[p.dtype].narrow(0, p.send_offset, p.numel);
      p.out.copy_(slot.model.detach().reshape({-1}).narrow(0, p.param_offset, p.numel));
    }
  }
  // The optimizer now holds the pieces, group by group, in bucket order; the full masters are dropped.
  auto& groups = state.optimizer_->param_groups();
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
  for (ParamSlot& slot : state.slots_) {
    slot.master = slot.model;
    slot.has_master = false;
  }
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

bool ZeroShard::consume_bucket(const ddp::ReducedBucket& bucket, LossScaler& scaler, at::Tensor& bucket_scale) {
  if (state_.active_loss_id_ < 0 || state_.active_delay_unscale_) return false;
  TORCH_CHECK(bucket.index >= 0 && bucket.index < static_cast<int64_t>(my_pieces_.size()), "amp: ZeRO got bucket ",
              bucket.index, " of a layout with ", my_pieces_.size(), " buckets");
  const std::vector<size_t>& mine = my_pieces_[static_cast<size_t>(bucket.index)];
  std::vector<at::Tensor> src;
  for (size_t i : mine)
    src.push_back(bucket.buffer.narrow(0, pieces_[i].bucket_offset - bucket.offset, pieces_[i].numel));
  bucket_scale.copy_(scaler.inv_scale()).mul_(bucket.average_scale);
  accumulate(mine, src, bucket_scale, scaler);
  // The rest of the bucket's gradients belong to other ranks' shards: freed.
  for (const at::Tensor& param : bucket.params) const_cast<at::Tensor&>(param).mutable_grad() = at::Tensor();
  return true;
}

void ZeroShard::end_loss(LossScaler& scaler, bool reduce_flag) {
  // Stage 1, buckets DDP wrote back itself (backward outside an attached scope, or delay_unscale): this rank's
  // pieces of the averaged gradients.
  std::vector<size_t> pieces;
  std::vector<at::Tensor> src;
  for (const auto& mine : my_pieces_) {
    for (size_t i : mine) {
      const at::Tensor& grad = state_.slots_[static_cast<size_t>(pieces_[i].slot)].model.grad();
      if (!grad.defined()) continue;
      pieces.push_back(i);
      src.push_back(grad.contiguous().reshape({-1}).narrow(0, pieces_[i].param_offset, pieces_[i].numel));
    }
  }
  accumulate(pieces, src, scaler.inv_scale(), scaler);
  for (ParamSlot& slot : state_.slots_) slot.model.mutable_grad() = at::Tensor();
  // Each rank checked only its shard: one allreduce makes the flag (and so the scale update and the skip) agree.
  // MAX, not SUM: the flag is 0 or 1 on every rank, as on plain DDP + amp, however many ranks overflowed (the
  // scaler adds it to skipped_steps and multiplies floor_overflows by it). reduce_flag false: the caller folds it
  // into a collective of its own (the FP8 amax reduction, also MAX).
  if (!reduce_flag) return;
  at::Tensor flag = scaler.found_inf();
  pg_.allreduce_max_(flag, "ZeRO overflow flag allreduce");
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
  const auto max_norm_f = static_cast<float>(max_norm);
  TORCH_CHECK(max_norm_f > 0.0f, "max_norm must be > 0 (as a float32; +inf never clips), got ", max_norm);
  const std::vector<at::Tensor> local = grads();
  const auto fp64 = at::TensorOptions().dtype(at::kDouble).device(masters_.device());
  // The sum of squares of this shard in fp64 (the l2 norm kernel's own accumulation), summed over the ranks.
  at::Tensor sum_sq =
      local.empty() ? at::zeros({1}, fp64) : kernels::l2_norm(local).total.to(at::kDouble).square().reshape({1});
  pg_.allreduce_sum_(sum_sq, "ZeRO gradient norm allreduce");
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
  for (const ParamSlot& slot : state_.slots_) full.push_back(at::empty(slot.model.sizes(), masters_.options()));
  for (const Piece& p : pieces_) {
    full[static_cast<size_t>(p.slot)]
        .view({-1})
        .narrow(0, p.param_offset, p.numel)
        .copy_(all.narrow(0, p.rank * chunk_total_ + chunk_position(p), p.numel));
  }
  return full;
}

void ZeroShard::save_consolidated_optimizer(torch::serialize::OutputArchive& archive) const {
  // This rank's pieces as the optimizer saves them, read back by key.
  torch::serialize::OutputArchive own;
  state_.optimizer_->save(own);
  std::ostringstream bytes;
  own.save_to(bytes);
  const std::string text = bytes.str();
  torch::serialize::InputArchive in;
  in.load_from(text.data(), text.size());
  for (const std::string& field : state_.fused_->state_fields()) {
    const bool scalar = field == "step";
    // Per element: the value, and 1 where the piece has this entry (a parameter gets state at its first gradient).
    const at::Tensor all = gather_chunks(2, [&](const Piece& p, int64_t w, at::Tensor dst) {
      at::Tensor value;
      if (!in.try_read("group" + std::to_string(p.group) + "." + field + "." + std::to_string(p.index_in_group),
                       value)) {
        return;
      }
      if (w == 1) {
        dst.fill_(1.0);
      } else if (scalar) {
        dst.copy_(value.reshape({1}).to(at::kFloat).expand({p.numel}));
      } else {
        dst.copy_(value.reshape({-1}));
      }
    });
    std::vector<at::Tensor> full(state_.slots_.size());
    std::vector<int> present(state_.slots_.size(), -1);  // -1 unknown, 0 absent, 1 present
    for (const Piece& p : pieces_) {
      const int64_t at_ = p.rank * 2 * chunk_total_ + chunk_position(p);
      const at::Tensor flags = all.narrow(0, at_ + chunk_total_, p.numel);
      const double lo = flags.min().item<double>(), hi = flags.max().item<double>();
      const int has = lo == 1.0 ? 1 : 0;
      const size_t j = static_cast<size_t>(p.slot);
      TORCH_CHECK(lo == hi && (present[j] < 0 || present[j] == has), "ZeRO: the ranks disagree on whether '",
                  state_.slots_[j].name, "' has optimizer state '", field, "' (a corrupt shard?)");
      present[j] = has;
      if (!has) continue;
      const at::Tensor values = all.narrow(0, at_, p.numel);
      if (scalar) {
        if (!full[j].defined()) full[j] = values.narrow(0, 0, 1).clone();
      } else {
        if (!full[j].defined()) full[j] = at::empty({state_.slots_[j].model.numel()}, masters_.options());
        full[j].narrow(0, p.param_offset, p.numel).copy_(values);
      }
    }
    for (size_t j = 0; j < full.size(); ++j) {
      if (!full[j].defined()) continue;
      const ParamSlot& slot = state_.slots_[j];
      // The group of slot j: the group of any of its pieces.
      int64_t group = 0;
      for (const Piece& p : pieces_) {
        if (p.slot == static_cast<int64_t>(j)) {
          group = p.group;
          break;
        }
      }
      archive.write("group" + std::to_string(group) + "." + field + "." + std::to_string(slot_index_in_group_[j]),
                    (scalar ? full[j].reshape({1}) : full[j].view(slot.model.sizes())).cpu());
    }
  }
}

std::string ZeroShard::shard_optimizer_archive(torch::serialize::InputArchive& full) const {
  torch::serialize::OutputArchive out;
  for (size_t i : step_order_) {
    const Piece& p = pieces_[i];
    const ParamSlot& slot = state_.slots_[static_cast<size_t>(p.slot)];
    for (const std::string& field : state_.fused_->state_fields()) {
      const std::string prefix = "group" + std::to_string(p.group) + "." + field + ".";
      const std::string key = prefix + std::to_string(slot_index_in_group_[static_cast<size_t>(p.slot)]);
      at::Tensor value;
      if (!full.try_read(key, value)) continue;
      if (field == "step") {
        TORCH_CHECK(value.numel() == 1, "optimizer checkpoint: ", key, " has ", value.numel(),
                    " elements but a step count has 1");
        out.write(prefix + std::to_string(p.index_in_group), value);
        continue;
      }
      TORCH_CHECK(value.numel() == slot.model.numel(), "optimizer checkpoint: ", key, " has ", value.numel(),
                  " elements but '", slot.name, "' has ", slot.model.numel());
      out.write(prefix + std::to_string(p.index_in_group),
                value.reshape({-1}).narrow(0, p.param_offset, p.numel).clone());
    }
  }
  std::ostringstream bytes;
  out.save_to(bytes);
  return bytes.str();
}

void ZeroShard::master_copies(const std::vector<at::Tensor>& values,
                              std::vector<std::pair<at::Tensor, at::Tensor>>& out) const {
  TORCH_CHECK(values.size() == state_.slots_.size(), "ZeRO: ", values.size(), " values for ", state_.slots_.size(),
              " parameters");
  for (size_t i : step_order_) {
    const Piece& p = pieces_[i];
    const at::Tensor part = values[static_cast<size_t>(p.slot)].reshape({-1}).narrow(0, p.param_offset, p.numel);
    out.emplace_back(p.held, part);
    out.emplace_back(p.out, part);
  }
}

namespace {

std::string bytes_of(torch::serialize::OutputArchive& archive) {
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

at::Tensor text_tensor(const std::string& text) {
  at::Tensor t = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  if (!text.empty()) std::memcpy(t.data_ptr<uint8_t>(), text.data(), text.size());
  return t;
}

at::Tensor read_tensor(torch::serialize::InputArchive& in, const std::string& key) {
  at::Tensor value;
  TORCH_CHECK(in.try_read(key, value), "the shard has no '", key, "'");
  return value.contiguous();
}

}  // namespace

std::string ZeroShard::save_shard() const {
  torch::serialize::OutputArchive own;
  state_.optimizer_->save(own);
  const std::string own_bytes = bytes_of(own);
  torch::serialize::InputArchive in;
  in.load_from(own_bytes.data(), own_bytes.size());
  std::string names;
  for (const ParamSlot& slot : state_.slots_) names += slot.name + "\n";
  std::vector<size_t> mine;
  for (const auto& pieces : my_pieces_) mine.insert(mine.end(), pieces.begin(), pieces.end());
  at::Tensor table = at::empty({static_cast<int64_t>(mine.size()), 3}, at::kLong);
  for (size_t k = 0; k < mine.size(); ++k) {
    const Piece& p = pieces_[mine[k]];
    table[static_cast<int64_t>(k)][0] = p.slot;
    table[static_cast<int64_t>(k)][1] = p.param_offset;
    table[static_cast<int64_t>(k)][2] = p.numel;
  }
  torch::serialize::OutputArchive out;
  out.write("names", text_tensor(names));
  out.write("pieces", table);
  out.write("masters", masters_.detach().cpu());
  for (const std::string& field : state_.fused_->state_fields()) {
    at::Tensor values = at::zeros({masters_.numel()}, at::kFloat);
    at::Tensor has = at::zeros({static_cast<int64_t>(mine.size())}, at::kByte);
    for (size_t k = 0; k < mine.size(); ++k) {
      const Piece& p = pieces_[mine[k]];
      at::Tensor value;
      if (!in.try_read("group" + std::to_string(p.group) + "." + field + "." + std::to_string(p.index_in_group),
                       value)) {
        continue;
      }
      has[static_cast<int64_t>(k)] = 1;
      at::Tensor dst = values.narrow(0, p.shard_offset, p.numel);
      if (field == "step") {
        dst.fill_(value.reshape({}).to(at::kFloat).item<float>());
      } else {
        dst.copy_(value.reshape({-1}));
      }
    }
    out.write("values." + field, values);
    out.write("has." + field, has);
  }
  return bytes_of(out);
}

ZeroShard::ShardLoad ZeroShard::begin_shard_load() const {
  ShardLoad load;
  const int64_t n = masters_.numel();
  load.masters = at::zeros({n}, at::kFloat);
  load.masters_seen = at::zeros({n}, at::kFloat);
  for (size_t f = 0; f < state_.fused_->state_fields().size(); ++f) {
    load.fields.push_back(at::zeros({n}, at::kFloat));
    load.fields_seen.push_back(at::zeros({n}, at::kFloat));
  }
  return load;
}

void ZeroShard::read_shard(const std::string& bytes, ShardLoad& load) const {
  torch::serialize::InputArchive in;
  in.load_from(bytes.data(), bytes.size());
  const at::Tensor name_bytes = read_tensor(in, "names");
  TORCH_CHECK(name_bytes.scalar_type() == at::kByte, "the shard's 'names' entry is malformed");
  std::vector<std::string> names;
  {
    std::istringstream lines(std::string(reinterpret_cast<const char*>(name_bytes.data_ptr<uint8_t>()),
                                         static_cast<size_t>(name_bytes.numel())));
    for (std::string line; std::getline(lines, line);) names.push_back(line);
  }
  const at::Tensor table = read_tensor(in, "pieces");
  const at::Tensor masters = read_tensor(in, "masters");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 3,
              "the shard's piece table is malformed");
  TORCH_CHECK(masters.scalar_type() == at::kFloat && masters.dim() == 1, "the shard's masters are malformed");
  const std::vector<std::string> fields = state_.fused_->state_fields();
  std::vector<at::Tensor> values, has;
  for (const std::string& field : fields) {
    values.push_back(read_tensor(in, "values." + field));
    has.push_back(read_tensor(in, "has." + field));
    TORCH_CHECK(values.back().numel() == masters.numel() && has.back().numel() == table.size(0) &&
                    has.back().scalar_type() == at::kByte,
                "the shard's '", field, "' entries are malformed");
  }
  std::unordered_map<std::string, int64_t> slot_of;
  for (size_t i = 0; i < state_.slots_.size(); ++i) slot_of[state_.slots_[i].name] = static_cast<int64_t>(i);
  const auto* rows = table.data_ptr<int64_t>();
  int64_t position = 0;  // where the old piece's values start in the file's flat tensors
  for (int64_t k = 0; k < table.size(0); ++k) {
    const int64_t name_index = rows[3 * k], offset = rows[3 * k + 1], numel = rows[3 * k + 2];
    TORCH_CHECK(name_index >= 0 && name_index < static_cast<int64_t>(names.size()) && offset >= 0 && numel >= 0 &&
                    position + numel <= masters.numel(),
                "the shard's piece ", k, " is out of range");
    const auto it = slot_of.find(names[static_cast<size_t>(name_index)]);
    TORCH_CHECK(it != slot_of.end(), "the shard holds parameter '", names[static_cast<size_t>(name_index)],
                "', which this model does not have (a checkpoint of another model?)");
    const ParamSlot& slot = state_.slots_[static_cast<size_t>(it->second)];
    TORCH_CHECK(offset + numel <= slot.model.numel(), "the shard holds elements [", offset, ", ", offset + numel,
                ") of '", slot.name, "', which has ", slot.model.numel());
    for (size_t i : step_order_) {
      const Piece& p = pieces_[i];
      if (p.slot != it->second) continue;
      const int64_t lo = std::max(offset, p.param_offset), hi = std::min(offset + numel, p.param_offset + p.numel);
      if (lo >= hi) continue;
      const int64_t src = position + (lo - offset), dst = p.shard_offset + (lo - p.param_offset), n = hi - lo;
      load.masters.narrow(0, dst, n).copy_(masters.narrow(0, src, n));
      load.masters_seen.narrow(0, dst, n).fill_(1.0);
      for (size_t f = 0; f < fields.size(); ++f) {
        if (has[f].data_ptr<uint8_t>()[k] == 0) continue;
        load.fields[f].narrow(0, dst, n).copy_(values[f].narrow(0, src, n));
        load.fields_seen[f].narrow(0, dst, n).fill_(1.0);
      }
    }
    position += numel;
  }
}

std::string ZeroShard::finish_shard_load(const ShardLoad& load,
                                         std::vector<std::pair<at::Tensor, at::Tensor>>& copies) const {
  const std::vector<std::string> fields = state_.fused_->state_fields();
  torch::serialize::OutputArchive out;
  for (size_t i : step_order_) {
    const Piece& p = pieces_[i];
    const std::string& name = state_.slots_[static_cast<size_t>(p.slot)].name;
    TORCH_CHECK(load.masters_seen.narrow(0, p.shard_offset, p.numel).min().item<float>() == 1.0f,
                "the shard files do not hold all of '", name, "' (a missing or mismatched shard?)");
    const at::Tensor master = load.masters.narrow(0, p.shard_offset, p.numel).to(masters_.device());
    copies.emplace_back(p.held, master);
    copies.emplace_back(p.out, master);
    for (size_t f = 0; f < fields.size(); ++f) {
      const at::Tensor seen = load.fields_seen[f].narrow(0, p.shard_offset, p.numel);
      const float lo = seen.min().item<float>(), hi = seen.max().item<float>();
      TORCH_CHECK(lo == hi, "the shard files hold optimizer state '", fields[f], "' for part of '", name,
                  "' only (shards of different checkpoints?)");
      if (lo == 0.0f) continue;
      const at::Tensor value = load.fields[f].narrow(0, p.shard_offset, p.numel);
      const std::string key =
          "group" + std::to_string(p.group) + "." + fields[f] + "." + std::to_string(p.index_in_group);
      out.write(key, fields[f] == "step" ? value.narrow(0, 0, 1).clone() : value.clone());
    }
  }
  return bytes_of(out);
}

int64_t ZeroShard::broadcast_from_root(int64_t value) const {
  at::Tensor t = at::full({1}, value, at::TensorOptions().dtype(at::kLong).device(pg_.device()));
  if (pg_.size() > 1) pg_.broadcast_(t, 0);
  return t.cpu().item<int64_t>();
}

int64_t ZeroShard::count_failures(bool ok) const {
  at::Tensor flag = at::full({1}, ok ? 0.0 : 1.0, masters_.options());
  pg_.allreduce_sum_(flag, "ZeRO checkpoint agreement allreduce");
  return static_cast<int64_t>(flag.item<float>());
}

HeldBytes ZeroShard::held_bytes(const FusedOptimizer& fused) const {
  HeldBytes bytes;
  bytes.masters = storage_bytes({masters_});
  bytes.master_grads = storage_bytes({grads_});
  bytes.optimizer_state = storage_bytes(fused.state_tensors());
  return bytes;
}

}  // namespace amp::detail
