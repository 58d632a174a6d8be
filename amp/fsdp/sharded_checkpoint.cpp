// ShardedGradients' checkpoints (docs/fsdp.md, "Checkpoints"): consolidated (the optimizer's state gathered from
// every rank's shards into the unsharded layout, and this rank's slices taken from it) and sharded (this rank's shards
// as pieces of the parameters in a shard file of its own, amp/state/shard_file.h).

#include <amp/fsdp/sharded_gradients.h>

#include <algorithm>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <amp/optim/fused_optimizer.h>
#include <amp/state/param_slots.h>
#include <amp/state/saved_optimizer.h>
#include <amp/state/shard_file.h>

namespace amp::detail {
namespace {

std::string key_of(int64_t group, const std::string& field, int64_t index) {
  return "group" + std::to_string(group) + "." + field + "." + std::to_string(index);
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (const int64_t d : shape) numel *= d;
  return numel;
}

}  // namespace

void ShardedGradients::check_fused(const char* what) const {
  TORCH_CHECK(fused_ != nullptr, what,
              " of a fully sharded model needs one of amp's fused optimizers (FusedAdam, FusedAdamW, FusedSGD), whose "
              "state is per element and named by field; this optimizer's state cannot be split into parameters");
}

void ShardedGradients::save_consolidated_optimizer(torch::serialize::OutputArchive& archive) const {
  check_fused("a checkpoint");
  torch::serialize::InputArchive in;  // this rank's shards' state as the optimizer saves them
  read_back_saved_state(optimizer_, in);
  const int world = pg_.size();
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(slots_.device());
  for (const std::string& field : fused_->state_fields()) {
    const bool scalar = field == "step";
    for (const ShardLayout& shard : layout_) {
      // Every rank's entry (or zeros) and a flag, 1 where the rank has the entry, in one all-gather.
      const int64_t n = scalar ? 1 : shard.chunk;
      at::Tensor mine = at::zeros({n + 1}, fp32);
      at::Tensor value;
      if (in.try_read(key_of(shard.group, field, shard.index), value)) {
        TORCH_CHECK(value.numel() == n, "full sharding: the optimizer's ", field, " of a shard has ", value.numel(),
                    " elements, the shard ", n);
        mine.narrow(0, 0, n).copy_(value.reshape({-1}));
        mine[n].fill_(1.0);
      }
      at::Tensor all = at::empty({(n + 1) * world}, fp32);
      auto work = pg_.allgather_into_async(all, mine);
      pg_.wait(work, "full sharding checkpoint all-gather");
      const at::Tensor per_rank = all.view({world, n + 1});
      const at::Tensor flags = per_rank.select(1, n);
      const double lo = flags.min().item<double>(), hi = flags.max().item<double>();
      TORCH_CHECK(lo == hi, "full sharding: the ranks disagree on whether a shard has optimizer state '", field,
                  "' (a corrupt state?)");
      if (lo == 0.0) continue;  // a unit that never stepped
      const at::Tensor values = per_rank.narrow(1, 0, n);
      for (const LaidOut& p : shard.params) {
        const std::string key = key_of(shard.group, field, p.index);
        if (scalar) {
          TORCH_CHECK(values.min().item<double>() == values.max().item<double>(),
                      "full sharding: the ranks' step counts of a unit differ");
          archive.write(key, values[0].reshape({1}).to(value.dtype()).cpu().clone());  // one storage per entry
          continue;
        }
        int64_t numel = 1;
        for (const int64_t d : p.shape) numel *= d;
        archive.write(key,
                      values.reshape({-1}).narrow(0, p.offset, numel).view(p.shape).to(value.dtype()).cpu().clone());
      }
    }
  }
}

std::string ShardedGradients::shard_optimizer_archive(torch::serialize::InputArchive& full) const {
  check_fused("loading a checkpoint");
  torch::serialize::OutputArchive out;
  const int world = pg_.size();
  const int64_t me = pg_.rank();
  for (const std::string& field : fused_->state_fields()) {
    const bool scalar = field == "step";
    for (const ShardLayout& shard : layout_) {
      std::vector<at::Tensor> values;
      for (const LaidOut& p : shard.params) {
        at::Tensor value;
        if (full.try_read(key_of(shard.group, field, p.index), value)) values.push_back(value);
      }
      if (values.empty()) continue;  // the unit had not stepped
      TORCH_CHECK(values.size() == shard.params.size(), "optimizer checkpoint: ", values.size(), " of the ",
                  shard.params.size(), " parameters of the unit holding '", shard.params.front().name, "' have ", field,
                  ": a fully sharded unit steps as one");
      const std::string key = key_of(shard.group, field, shard.index);
      if (scalar) {
        for (size_t q = 0; q < values.size(); ++q) {
          TORCH_CHECK(values[q].numel() == 1,
                      "optimizer checkpoint: ", key_of(shard.group, field, shard.params[q].index), " has ",
                      values[q].numel(), " elements but a step count has 1");
          TORCH_CHECK(at::equal(values[q], values[0]), "optimizer checkpoint: the step counts of '",
                      shard.params[q].name, "' and '", shard.params[0].name,
                      "' differ, but a fully sharded unit steps as one");
        }
        out.write(key, values[0].reshape({1}).clone());
        continue;
      }
      at::Tensor flat = at::zeros({shard.chunk * world}, values[0].options());
      for (size_t q = 0; q < values.size(); ++q) {
        const LaidOut& p = shard.params[q];
        int64_t numel = 1;
        for (const int64_t d : p.shape) numel *= d;
        TORCH_CHECK(values[q].numel() == numel, "optimizer checkpoint: ", key_of(shard.group, field, p.index), " has ",
                    values[q].numel(), " elements but '", p.name, "' has ", numel);
        flat.narrow(0, p.offset, numel).copy_(values[q].reshape({-1}));
      }
      out.write(key, flat.narrow(0, me * shard.chunk, shard.chunk).clone());
    }
  }
  std::ostringstream bytes;
  out.save_to(bytes);
  return bytes.str();
}

int64_t ShardedGradients::count_failures(bool ok) const {
  at::Tensor flag = at::full({1}, ok ? 0.0 : 1.0, at::TensorOptions().dtype(at::kFloat).device(slots_.device()));
  pg_.allreduce_sum_(flag, "full sharding checkpoint agreement allreduce");
  return static_cast<int64_t>(flag.item<float>());
}

int64_t ShardedGradients::broadcast_from_root(int64_t value) const {
  at::Tensor t = at::full({1}, value, at::TensorOptions().dtype(at::kLong).device(slots_.device()));
  if (pg_.size() > 1) pg_.broadcast_(t, 0);
  return t.cpu().item<int64_t>();
}

std::vector<ShardPiece> ShardedGradients::shard_pieces(std::vector<size_t>* slot_of) const {
  std::vector<ShardPiece> pieces;
  const int64_t me = pg_.rank();
  int64_t base = 0;  // the slot's first element in this rank's shards laid back to back
  for (size_t s = 0; s < layout_.size(); ++s) {
    const ShardLayout& shard = layout_[s];
    const int64_t first = me * shard.chunk, end = first + shard.chunk;  // this rank's range of the unit's flat layout
    for (const LaidOut& p : shard.params) {
      const int64_t n = numel_of(p.shape);
      const int64_t lo = std::max(p.offset, first), hi = std::min(p.offset + n, end);
      pieces.push_back(lo < hi ? ShardPiece{p.name, n, lo - p.offset, hi - lo, base + lo - first}
                               : ShardPiece{p.name, n, 0, 0, 0});
      if (slot_of != nullptr) slot_of->push_back(s);
    }
    base += shard.chunk;
  }
  return pieces;
}

std::string ShardedGradients::save_shard() const {
  check_fused("a sharded checkpoint");
  torch::serialize::InputArchive in;  // this rank's shards' state as the optimizer saves them
  read_back_saved_state(optimizer_, in);
  std::vector<size_t> slot_of;
  const std::vector<ShardPiece> pieces = shard_pieces(&slot_of);
  std::vector<at::Tensor> shards;
  for (const ParamSlot& slot : slots_) {
    TORCH_CHECK(slot.model.scalar_type() == at::kFloat,
                "full sharding: a sharded checkpoint holds fp32 shards, this "
                "one is ",
                slot.model.scalar_type());
    shards.push_back(slot.model.detach().cpu());
  }
  const at::Tensor flat = at::cat(shards);
  ShardFileContents file;
  std::vector<size_t> held;  // the pieces with elements: the table's rows
  for (size_t k = 0; k < pieces.size(); ++k) {
    file.names.push_back(pieces[k].name);
    if (pieces[k].numel > 0) held.push_back(k);
  }
  file.table = at::empty({static_cast<int64_t>(held.size()), 3}, at::kLong);
  std::vector<at::Tensor> master_parts;
  for (size_t r = 0; r < held.size(); ++r) {
    const ShardPiece& p = pieces[held[r]];
    file.table[static_cast<int64_t>(r)][0] = static_cast<int64_t>(held[r]);
    file.table[static_cast<int64_t>(r)][1] = p.param_offset;
    file.table[static_cast<int64_t>(r)][2] = p.numel;
    master_parts.push_back(flat.narrow(0, p.offset, p.numel));
  }
  file.masters = master_parts.empty() ? at::empty({0}, at::kFloat) : at::cat(master_parts);
  const std::vector<std::string> fields = fused_->state_fields();
  for (const std::string& field : fields) {
    at::Tensor values = at::zeros({file.masters.numel()}, at::kFloat);
    at::Tensor has = at::zeros({static_cast<int64_t>(held.size())}, at::kByte);
    int64_t position = 0;
    for (size_t r = 0; r < held.size(); ++r) {
      const ShardPiece& p = pieces[held[r]];
      const ShardLayout& shard = layout_[slot_of[held[r]]];
      at::Tensor value;
      if (in.try_read(key_of(shard.group, field, shard.index), value)) {
        has[static_cast<int64_t>(r)] = 1;
        at::Tensor dst = values.narrow(0, position, p.numel);
        if (field == "step") {
          dst.fill_(value.reshape({}).to(at::kFloat).item<float>());
        } else {
          int64_t base = 0;  // the slot's first element in the shards back to back
          for (size_t s = 0; s < slot_of[held[r]]; ++s) base += layout_[s].chunk;
          dst.copy_(value.reshape({-1}).narrow(0, p.offset - base, p.numel));
        }
      }
      position += p.numel;
    }
    file.values.push_back(values);
    file.has.push_back(has);
  }
  return encode_shard_file(file, fields);
}

ShardLoad ShardedGradients::begin_shard_load() const {
  check_fused("loading a sharded checkpoint");
  int64_t numel = 0;
  for (const ShardLayout& shard : layout_) numel += shard.chunk;
  return detail::begin_shard_load(numel, fused_->state_fields());
}

void ShardedGradients::read_shard(const std::string& bytes, ShardLoad& load) const {
  take_overlaps(decode_shard_file(bytes, fused_->state_fields()), shard_pieces(), load);
}

std::string ShardedGradients::finish_shard_load(const ShardLoad& load,
                                                std::vector<std::pair<at::Tensor, at::Tensor>>& copies) const {
  const std::vector<std::string> fields = fused_->state_fields();
  std::vector<size_t> slot_of;
  const std::vector<ShardPiece> pieces = shard_pieces(&slot_of);
  // Per field: whether this rank's parts have it, and the step count: one for all, as the units step together.
  std::vector<int> present(fields.size(), -1);  // -1 unknown, 0 absent, 1 present
  std::optional<float> step;
  const auto same_step = [&](float value) {
    TORCH_CHECK(!step || *step == value, "the shard files hold step counts ", *step, " and ", value,
                ", but the units of a fully sharded model step together (shards of different checkpoints?)");
    step = value;
  };
  for (const ShardPiece& p : pieces) {
    check_piece_loaded(load, p, fields);
    if (p.numel == 0) continue;
    for (size_t f = 0; f < fields.size(); ++f) {
      const int has = load.fields_seen[f].narrow(0, p.offset, p.numel).max().item<float>() == 1.0f ? 1 : 0;
      TORCH_CHECK(present[f] < 0 || present[f] == has, "the shard files hold optimizer state '", fields[f],
                  "' for some parameters only, but the units of a fully sharded model step together (shards of "
                  "different checkpoints?)");
      present[f] = has;
      if (has && fields[f] == "step") same_step(load.fields[f][p.offset].item<float>());
    }
  }
  // A rank whose shards are all padding holds no part of a parameter: what the files hold decides.
  for (size_t f = 0; f < fields.size(); ++f) {
    if (present[f] >= 0) continue;
    present[f] = load.in_files[f] ? 1 : 0;
    if (present[f] == 1 && fields[f] == "step") {
      for (const float value : load.file_steps) same_step(value);
    }
  }
  torch::serialize::OutputArchive out;
  int64_t base = 0;
  for (size_t s = 0; s < layout_.size(); ++s) {
    const ShardLayout& shard = layout_[s];
    // The padding stays zero, as at construction (its gradient is always zero: nothing moves it).
    copies.emplace_back(slots_[s].model, load.masters.narrow(0, base, shard.chunk).to(slots_[s].model.device()));
    for (size_t f = 0; f < fields.size(); ++f) {
      if (present[f] != 1) continue;
      const at::Tensor value = fields[f] == "step" ? at::full({1}, step.value_or(0.0f), at::kFloat)
                                                   : load.fields[f].narrow(0, base, shard.chunk).clone();
      out.write(key_of(shard.group, fields[f], shard.index), value);
    }
    base += shard.chunk;
  }
  std::ostringstream bytes;
  out.save_to(bytes);
  return bytes.str();
}

}  // namespace amp::detail
