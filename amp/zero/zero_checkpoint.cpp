// ZeroShard's checkpoints (docs/zero.md): the consolidated optimizer state (the unsharded layout, which loads at any
// world size and into plain DDP + amp) and sharded files (this rank's pieces by parameter name and range).

#include <amp/zero/zero_shard.h>

#include <algorithm>
#include <sstream>
#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include <amp/optim/fused_optimizer.h>
#include <amp/state/param_slots.h>
#include <amp/state/saved_optimizer.h>
#include <amp/state/shard_file.h>

namespace amp::detail {

void ZeroShard::save_consolidated_optimizer(torch::serialize::OutputArchive& archive) const {
  torch::serialize::InputArchive in;  // this rank's pieces as the optimizer saves them
  read_back_saved_state(optimizer_, in);
  for (const std::string& field : fused_->state_fields()) {
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
    std::vector<at::Tensor> full(slots_.size());
    std::vector<int> present(slots_.size(), -1);  // -1 unknown, 0 absent, 1 present
    for (const Piece& p : pieces_) {
      const int64_t at_ = p.rank * 2 * chunk_total_ + chunk_position(p);
      const at::Tensor flags = all.narrow(0, at_ + chunk_total_, p.numel);
      const double lo = flags.min().item<double>(), hi = flags.max().item<double>();
      const int has = lo == 1.0 ? 1 : 0;
      const size_t j = static_cast<size_t>(p.slot);
      TORCH_CHECK(lo == hi && (present[j] < 0 || present[j] == has), "ZeRO: the ranks disagree on whether '",
                  slots_[j].name, "' has optimizer state '", field, "' (a corrupt shard?)");
      present[j] = has;
      if (!has) continue;
      const at::Tensor values = all.narrow(0, at_, p.numel);
      if (scalar) {
        if (!full[j].defined()) full[j] = values.narrow(0, 0, 1).clone();
      } else {
        if (!full[j].defined()) full[j] = at::empty({slots_[j].model.numel()}, masters_.options());
        full[j].narrow(0, p.param_offset, p.numel).copy_(values);
      }
    }
    for (size_t j = 0; j < full.size(); ++j) {
      if (!full[j].defined()) continue;
      const ParamSlot& slot = slots_[j];
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
    const ParamSlot& slot = slots_[static_cast<size_t>(p.slot)];
    for (const std::string& field : fused_->state_fields()) {
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
  TORCH_CHECK(values.size() == slots_.size(), "ZeRO: ", values.size(), " values for ", slots_.size(), " parameters");
  for (size_t i : step_order_) {
    const Piece& p = pieces_[i];
    const at::Tensor part = values[static_cast<size_t>(p.slot)].reshape({-1}).narrow(0, p.param_offset, p.numel);
    out.emplace_back(p.held, part);
    out.emplace_back(p.out, part);
  }
}

std::vector<ShardPiece> ZeroShard::shard_pieces() const {
  std::vector<ShardPiece> pieces;
  for (const ParamSlot& slot : slots_) pieces.push_back({slot.name, slot.model.numel(), 0, 0, 0});
  for (size_t i : step_order_) {
    const Piece& p = pieces_[i];
    const ParamSlot& slot = slots_[static_cast<size_t>(p.slot)];
    pieces.push_back({slot.name, slot.model.numel(), p.param_offset, p.numel, p.shard_offset});
  }
  return pieces;
}

std::string ZeroShard::save_shard() const {
  torch::serialize::InputArchive in;  // this rank's pieces as the optimizer saves them
  read_back_saved_state(optimizer_, in);
  std::vector<size_t> mine;
  for (const auto& pieces : my_pieces_) mine.insert(mine.end(), pieces.begin(), pieces.end());
  ShardFileContents file;
  for (const ParamSlot& slot : slots_) file.names.push_back(slot.name);
  file.table = at::empty({static_cast<int64_t>(mine.size()), 3}, at::kLong);
  for (size_t k = 0; k < mine.size(); ++k) {
    const Piece& p = pieces_[mine[k]];
    file.table[static_cast<int64_t>(k)][0] = p.slot;
    file.table[static_cast<int64_t>(k)][1] = p.param_offset;
    file.table[static_cast<int64_t>(k)][2] = p.numel;
  }
  file.masters = masters_.detach().cpu();
  const std::vector<std::string> fields = fused_->state_fields();
  for (const std::string& field : fields) {
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
    file.values.push_back(values);
    file.has.push_back(has);
  }
  return encode_shard_file(file, fields);
}

ShardLoad ZeroShard::begin_shard_load() const {
  return detail::begin_shard_load(masters_.numel(), fused_->state_fields());
}

void ZeroShard::read_shard(const std::string& bytes, ShardLoad& load) const {
  take_overlaps(decode_shard_file(bytes, fused_->state_fields()), shard_pieces(), load);
}

std::string ZeroShard::finish_shard_load(const ShardLoad& load,
                                         std::vector<std::pair<at::Tensor, at::Tensor>>& copies) const {
  const std::vector<std::string> fields = fused_->state_fields();
  torch::serialize::OutputArchive out;
  for (size_t i : step_order_) {
    const Piece& p = pieces_[i];
    const ParamSlot& slot = slots_[static_cast<size_t>(p.slot)];
    check_piece_loaded(load, {slot.name, slot.model.numel(), p.param_offset, p.numel, p.shard_offset}, fields);
    const at::Tensor master = load.masters.narrow(0, p.shard_offset, p.numel).to(masters_.device());
    copies.emplace_back(p.held, master);
    copies.emplace_back(p.out, master);
    for (size_t f = 0; f < fields.size(); ++f) {
      if (load.fields_seen[f].narrow(0, p.shard_offset, p.numel).max().item<float>() == 0.0f) continue;
      const at::Tensor value = load.fields[f].narrow(0, p.shard_offset, p.numel);
      const std::string key =
          "group" + std::to_string(p.group) + "." + fields[f] + "." + std::to_string(p.index_in_group);
      out.write(key, fields[f] == "step" ? value.narrow(0, 0, 1).clone() : value.clone());
    }
  }
  std::ostringstream bytes;
  out.save_to(bytes);
  return bytes.str();
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

}  // namespace amp::detail
