#pragma once

// The file a rank writes in a sharded checkpoint (amp::save_checkpoint_sharded, Note [sharded checkpoint] in
// amp/io/checkpoint.cpp), shared by ZeRO (amp/zero) and full sharding (amp/fsdp): this rank's pieces of the model's
// parameters by name and element range, their fp32 master values and their optimizer state per element. Because a
// piece names its parameter and range, not the writer's layout, a load takes whatever overlaps its own pieces from
// the files of any world size, written by either kind of sharding.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace amp::detail {

/// Elements [param_offset, param_offset + numel) of the parameter `name` (param_numel elements in all), held at
/// [offset, offset + numel) of a rank's flat state.
struct ShardPiece {
  std::string name;
  int64_t param_numel = 0;
  int64_t param_offset = 0;
  int64_t numel = 0;
  int64_t offset = 0;
};

/// What one shard file holds. Its flat tensors hold the pieces back to back, in the table's order.
struct ShardFileContents {
  std::vector<std::string> names;  ///< the parameters the table's first column indexes
  at::Tensor table;                ///< [pieces, 3] int64: name index, param_offset, numel
  at::Tensor masters;              ///< fp32, the pieces' values back to back
  std::vector<at::Tensor> values;  ///< per optimizer state field: fp32 per element (a step count repeated)
  std::vector<at::Tensor> has;     ///< per field: uint8 per piece, 1 where the piece has the entry
};

/// The bytes of a shard file (a serialized archive).
std::string encode_shard_file(const ShardFileContents& contents, const std::vector<std::string>& fields);
/// Reads what encode_shard_file wrote, checking its structure (one-line errors).
ShardFileContents decode_shard_file(const std::string& bytes, const std::vector<std::string>& fields);

/// What a sharded load has gathered so far for this rank's flat state, from shard files of any world size.
struct ShardLoad {
  std::vector<std::string> field_names;         ///< the optimizer's state fields
  at::Tensor masters, masters_seen;             ///< per element of this rank's flat state
  std::vector<at::Tensor> fields, fields_seen;  ///< per state field: per element (a step count repeated)
  std::vector<bool> in_files;                   ///< per field: whether any piece of the files read has it
  std::vector<float> file_steps;                ///< the distinct step counts the files' pieces hold
};
/// An empty load of `numel` elements and the optimizer's state fields (fp32 on the CPU).
ShardLoad begin_shard_load(int64_t numel, const std::vector<std::string>& fields);
/// Takes from `file` whatever overlaps `mine` (this rank's pieces) into `load`, and notes which fields and step counts
/// the file holds at all. Throws, one line, for a parameter this model does not have or a range past its end.
void take_overlaps(const ShardFileContents& file, const std::vector<ShardPiece>& mine, ShardLoad& load);
/// Checks that the files covered every element of `piece` and that a state field covers all of it or none of it.
void check_piece_loaded(const ShardLoad& load, const ShardPiece& piece, const std::vector<std::string>& fields);

}  // namespace amp::detail
