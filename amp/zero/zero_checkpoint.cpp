// ZeroShard's checkpoints (docs/zero.md): the consolidated optimizer state (the unsharded layout, which loads at any
// world size and into plain DDP + amp) and sharded files (this rank's pieces by parameter name and range).

#include <amp/zero/zero_shard.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include <amp/optim/fused_optimizer.h>
#include <amp/state/param_slots.h>
#include <amp/state/saved_optimizer.h>

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
  optimizer_.save(own);
  const std::string own_bytes = bytes_of(own);
  torch::serialize::InputArchive in;
  in.load_from(own_bytes.data(), own_bytes.size());
  std::string names;
  for (const ParamSlot& slot : slots_) names += slot.name + "\n";
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
  for (const std::string& field : fused_->state_fields()) {
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
  for (size_t f = 0; f < fused_->state_fields().size(); ++f) {
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
  const std::vector<std::string> fields = fused_->state_fields();
  std::vector<at::Tensor> values, has;
  for (const std::string& field : fields) {
    values.push_back(read_tensor(in, "values." + field));
    has.push_back(read_tensor(in, "has." + field));
    TORCH_CHECK(values.back().numel() == masters.numel() && has.back().numel() == table.size(0) &&
                    has.back().scalar_type() == at::kByte,
                "the shard's '", field, "' entries are malformed");
  }
  const auto* rows = table.data_ptr<int64_t>();
  int64_t position = 0;  // where the old piece's values start in the file's flat tensors
  for (int64_t k = 0; k < table.size(0); ++k) {
    const int64_t name_index = rows[3 * k], offset = rows[3 * k + 1], numel = rows[3 * k + 2];
    TORCH_CHECK(name_index >= 0 && name_index < static_cast<int64_t>(names.size()) && offset >= 0 && numel >= 0 &&
                    position + numel <= masters.numel(),
                "the shard's piece ", k, " is out of range");
    const int64_t slot_index = slots_.index_of(names[static_cast<size_t>(name_index)]);
    TORCH_CHECK(slot_index >= 0, "the shard holds parameter '", names[static_cast<size_t>(name_index)],
                "', which this model does not have (a checkpoint of another model?)");
    const ParamSlot& slot = slots_[static_cast<size_t>(slot_index)];
    TORCH_CHECK(offset + numel <= slot.model.numel(), "the shard holds elements [", offset, ", ", offset + numel,
                ") of '", slot.name, "', which has ", slot.model.numel());
    for (size_t i : step_order_) {
      const Piece& p = pieces_[i];
      if (p.slot != slot_index) continue;
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
  const std::vector<std::string> fields = fused_->state_fields();
  torch::serialize::OutputArchive out;
  for (size_t i : step_order_) {
    const Piece& p = pieces_[i];
    const std::string& name = slots_[static_cast<size_t>(p.slot)].name;
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

}  // namespace amp::detail
