#pragma once

// What a module that wraps a block (ddp::ShardedUnit, amp::Checkpointed) does so that it adds no level to the names:
// it holds the block's own parameters, buffers and submodules under their own names.

#include <torch/nn/module.h>

namespace ddp {

/// Registers `wrapped`'s own parameters (with their requires_grad), buffers and child modules on `wrapper` under
/// their names, so that `wrapper`'s named_parameters(), state dictionaries and archives read as `wrapped`'s, and
/// sets `wrapper`'s training mode to `wrapped`'s.
void register_members_of(torch::nn::Module& wrapper, const torch::nn::Module& wrapped);

}  // namespace ddp
