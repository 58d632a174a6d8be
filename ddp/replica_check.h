#pragma once

// A check that data-parallel replicas really are replicas: after training, every rank's parameters should be
// bit-identical (DDP averages the same gradients everywhere and every rank takes the same step). A rank that
// diverged (a nondeterministic op, a step skipped on one rank only) trains on silently otherwise, while only rank
// 0's figures are printed. Buffers are compared only when asked: with BatchNorm, DDP broadcasts rank 0's buffers
// at the start of each forward (broadcast_buffers, as PyTorch's DDP does), so after the last step every rank
// holds the running statistics of its own last batch; with SyncBatchNorm they agree.

#include <cstdint>
#include <string>

#include <ddp/process_group.h>
#include <torch/nn/module.h>

namespace ddp {

/// 64-bit FNV-1a digest of `module`'s parameters, and its buffers when `include_buffers` (recursively, in
/// registration order): each one's name, dtype, shape and bytes (copied to the CPU when on a device).
uint64_t replica_digest(const torch::nn::Module& module, bool include_buffers = false);

/// Compares every rank's replica_digest of `module` (one allgather of one number). Collective: every rank of
/// `group` must call it alike. Returns the digest when all ranks agree; otherwise throws on every rank alike,
/// naming the ranks whose parameters (or buffers) differ from rank 0's.
uint64_t check_replicas(const torch::nn::Module& module, const ProcessGroup& group, bool include_buffers = false);

/// "0x" and 16 hexadecimal digits.
std::string digest_hex(uint64_t digest);

}  // namespace ddp
