#pragma once

// The optimizer's own save(), read back by key: what the sharded owners' consolidated checkpoints start from
// (ZeroShard, ShardedGradients). Internal.

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

namespace amp::detail {

/// Fills `in` with what `optimizer.save()` writes (this rank's state, keyed `group<g>.<field>.<i>` by amp's fused
/// optimizers).
void read_back_saved_state(const torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& in);

}  // namespace amp::detail
