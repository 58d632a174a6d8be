#pragma once

// clip_grad_norm_ over gradients split among the ranks (ZeRO's shard, full sharding's shards): the one collective
// both sharded gradient owners run (Note [gradient owner] in amp/state/gradient_owner.h). Internal.

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <ddp/process_group.h>

namespace amp::detail {

/// Clips `local` (this rank's part of the gradients; every element held by exactly one rank, padding zero) by the
/// norm of all ranks' parts together: the sum of this rank's squares in fp64, summed over `pg` (one 1-element
/// allreduce, `what` names it in errors), its square root. Raises `found_inf` to 1 (never adds) when the norm is not
/// finite, and then leaves the gradients as they are. Returns the norm (0-dim fp32). Collective.
at::Tensor sharded_clip_grad_norm_(const std::vector<at::Tensor>& local, double max_norm, const at::Tensor& found_inf,
                                   const ddp::ProcessGroup& pg, const std::string& what);

}  // namespace amp::detail
