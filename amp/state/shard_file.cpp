#include <amp/state/shard_file.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

namespace amp::detail {
namespace {

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

std::string encode_shard_file(const ShardFileContents& contents, const std::vector<std::string>& fields) {
  std::string names;
  for (const std::string& name : contents.names) names += name + "\n";
  torch::serialize::OutputArchive out;
  out.write("names", text_tensor(names));
  out.write("pieces", contents.table);
  out.write("masters", contents.masters.detach().cpu());
  for (size_t f = 0; f < fields.size(); ++f) {
    out.write("values." + fields[f], contents.values[f].cpu());
    out.write("has." + fields[f], contents.has[f].cpu());
  }
  std::ostringstream bytes;
  out.save_to(bytes);
  return bytes.str();
}

ShardFileContents decode_shard_file(const std::string& bytes, const std::vector<std::string>& fields) {
  torch::serialize::InputArchive in;
  in.load_from(bytes.data(), bytes.size());
  ShardFileContents file;
  const at::Tensor name_bytes = read_tensor(in, "names");
  TORCH_CHECK(name_bytes.scalar_type() == at::kByte, "the shard's 'names' entry is malformed");
  std::istringstream lines(std::string(reinterpret_cast<const char*>(name_bytes.data_ptr<uint8_t>()),
                                       static_cast<size_t>(name_bytes.numel())));
  for (std::string line; std::getline(lines, line);) file.names.push_back(line);
  file.table = read_tensor(in, "pieces");
  file.masters = read_tensor(in, "masters");
  TORCH_CHECK(file.table.scalar_type() == at::kLong && file.table.dim() == 2 && file.table.size(1) == 3,
              "the shard's piece table is malformed");
  TORCH_CHECK(file.masters.scalar_type() == at::kFloat && file.masters.dim() == 1, "the shard's masters are malformed");
  for (const std::string& field : fields) {
    file.values.push_back(read_tensor(in, "values." + field));
    file.has.push_back(read_tensor(in, "has." + field));
    TORCH_CHECK(file.values.back().numel() == file.masters.numel() && file.has.back().numel() == file.table.size(0) &&
                    file.has.back().scalar_type() == at::kByte,
                "the shard's '", field, "' entries are malformed");
  }
  return file;
}

ShardLoad begin_shard_load(int64_t numel, const std::vector<std::string>& fields) {
  ShardLoad load;
  load.field_names = fields;
  load.in_files.assign(fields.size(), false);
  load.masters = at::zeros({numel}, at::kFloat);
  load.masters_seen = at::zeros({numel}, at::kFloat);
  for (size_t f = 0; f < fields.size(); ++f) {
    load.fields.push_back(at::zeros({numel}, at::kFloat));
    load.fields_seen.push_back(at::zeros({numel}, at::kFloat));
  }
  return load;
}

void take_overlaps(const ShardFileContents& file, const std::vector<ShardPiece>& mine, ShardLoad& load) {
  std::map<std::string, std::vector<const ShardPiece*>> by_name;
  for (const ShardPiece& piece : mine) by_name[piece.name].push_back(&piece);
  const auto* rows = file.table.data_ptr<int64_t>();
  int64_t position = 0;  // where the file's piece starts in its flat tensors
  for (int64_t k = 0; k < file.table.size(0); ++k) {
    const int64_t name_index = rows[3 * k], offset = rows[3 * k + 1], numel = rows[3 * k + 2];
    TORCH_CHECK(name_index >= 0 && name_index < static_cast<int64_t>(file.names.size()) && offset >= 0 && numel >= 0 &&
                    position + numel <= file.masters.numel(),
                "the shard's piece ", k, " is out of range");
    for (size_t f = 0; f < file.values.size(); ++f) {
      if (file.has[f].data_ptr<uint8_t>()[k] == 0) continue;
      load.in_files[f] = true;
      if (load.field_names[f] == "step" && numel > 0) {
        const float step = file.values[f][position].item<float>();
        if (std::find(load.file_steps.begin(), load.file_steps.end(), step) == load.file_steps.end()) {
          load.file_steps.push_back(step);
        }
      }
    }
    const std::string& name = file.names[static_cast<size_t>(name_index)];
    const auto found = by_name.find(name);
    // (A parameter of the model with no piece on this rank is still one of the model's: the caller lists every
    // parameter, with empty pieces where this rank holds none.)
    TORCH_CHECK(found != by_name.end(), "the shard holds parameter '", name,
                "', which this model does not have (a checkpoint of another model?)");
    const int64_t param_numel = found->second.front()->param_numel;
    TORCH_CHECK(offset + numel <= param_numel, "the shard holds elements [", offset, ", ", offset + numel, ") of '",
                name, "', which has ", param_numel);
    for (const ShardPiece* p : found->second) {
      const int64_t lo = std::max(offset, p->param_offset), hi = std::min(offset + numel, p->param_offset + p->numel);
      if (lo >= hi) continue;
      const int64_t src = position + (lo - offset), dst = p->offset + (lo - p->param_offset), n = hi - lo;
      load.masters.narrow(0, dst, n).copy_(file.masters.narrow(0, src, n));
      load.masters_seen.narrow(0, dst, n).fill_(1.0);
      for (size_t f = 0; f < file.values.size(); ++f) {
        if (file.has[f].data_ptr<uint8_t>()[k] == 0) continue;
        load.fields[f].narrow(0, dst, n).copy_(file.values[f].narrow(0, src, n));
        load.fields_seen[f].narrow(0, dst, n).fill_(1.0);
      }
    }
    position += numel;
  }
}

void check_piece_loaded(const ShardLoad& load, const ShardPiece& piece, const std::vector<std::string>& fields) {
  if (piece.numel == 0) return;
  TORCH_CHECK(load.masters_seen.narrow(0, piece.offset, piece.numel).min().item<float>() == 1.0f,
              "the shard files do not hold all of '", piece.name, "' (a missing or mismatched shard?)");
  for (size_t f = 0; f < fields.size(); ++f) {
    const at::Tensor seen = load.fields_seen[f].narrow(0, piece.offset, piece.numel);
    TORCH_CHECK(seen.min().item<float>() == seen.max().item<float>(), "the shard files hold optimizer state '",
                fields[f], "' for part of '", piece.name, "' only (shards of different checkpoints?)");
  }
}

}  // namespace amp::detail
