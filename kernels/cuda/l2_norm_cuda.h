#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include <kernels/pointer_lists.h>

namespace kernels::cuda {

// Stage 1 and 2 of Note [deterministic two-stage norm] (kernels/multi_tensor/l2_norm.h). slot_base has one entry per
// tensor of the caller's original list plus one: tensor i owns workspace slots [slot_base[i], slot_base[i + 1]), one
// per kChunkElements-element chunk. All pointers are device pointers; everything runs on `stream`, no host sync.

/// Copies the host slot table host_table[0, num_entries) to the device array slot_base, passing the values in
/// kernel parameters (one launch per ~4,000 entries) rather than through a host buffer: safe to capture in a CUDA
/// graph (the values are part of the graph), and host_table may be freed as soon as this returns.
void write_slot_table(const int64_t* host_table, int64_t num_entries, int64_t* slot_base, cudaStream_t stream);

/// Stage 1: for every chunk c of every tensor of `lists` (one dtype), writes the sum over the chunk of
/// (x * *inv_scale)^2 (fp32 squares and per-thread sums, fp64 block sum) to
/// partials[slot_base[original index] + c]. inv_scale may be null (then 1).
void l2_norm_partials(const PointerLists<1>& lists, const int64_t* slot_base, const float* inv_scale, double* partials,
                      cudaStream_t stream);

/// Stage 2: *total = sqrt(sum of partials[0, num_slots)) and, when per_tensor is not null, per_tensor[i] =
/// sqrt(sum of tensor i's slots) for i < num_tensors, each summed in a fixed order in fp64 and rounded to fp32.
/// When found_inf is not null it is set to 1 if *total is inf or NaN (never cleared).
void l2_norm_reduce(const double* partials, const int64_t* slot_base, int64_t num_tensors, int64_t num_slots,
                    float* total, float* per_tensor, float* found_inf, cudaStream_t stream);

/// In place g *= clip_coefficient(*total_norm, max_norm) (kernels/optim/clip_rule.h) over `lists` (one dtype), the
/// coefficient being read on device; blocks return without touching memory when it is 1.
void clip_by_norm(const PointerLists<1>& lists, const float* total_norm, float max_norm, cudaStream_t stream);

}  // namespace kernels::cuda
