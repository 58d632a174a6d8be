#pragma once

// What DistributedDataParallel does to the model before the first step: check that every rank built the same model
// with the same options, and start every rank from rank 0's parameters and buffers (also the buffers before each
// forward, with broadcast_buffers). Internal to ddp/ (ddp::detail); the tests' home is
// tests/ddp/model_sync_test.cpp.

#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>

namespace ddp::detail {

/// The rank whose parameters and buffers every rank starts from.
constexpr int kRoot = 0;

/// Overwrites `tensors` on every rank with rank 0's values: one broadcast per (dtype, device) group. Collective.
void broadcast_from_root(const ProcessGroup& pg, const std::vector<at::Tensor>& tensors);

/// Throws on every rank, with the same message, when the ranks' modules (parameter and buffer names, shapes,
/// dtypes) or bucket-shaping options differ, naming the first differing entry. Two collectives when they agree (a
/// hash), two more when they do not (the descriptions), so every rank reaches the same verdict: no rank proceeds to
/// a broadcast that the others skip. Construction only, so reading the results on the host is fine.
void verify_same_model_on_all_ranks(const ProcessGroup& pg, const torch::nn::Module& module,
                                    const DistributedDataParallelOptions& options);

}  // namespace ddp::detail
