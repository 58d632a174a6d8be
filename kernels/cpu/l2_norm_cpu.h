#pragma once

#include <cstdint>

#include <kernels/pointer_lists.h>

namespace kernels::cpu {

/// CPU twin of kernels::cuda::l2_norm_partials (same contract and slot layout; host pointers): one fp64 partial
/// per kChunkElements chunk, chunks spread over threads with at::parallel_for, fp32 squares summed with at::vec.
void l2_norm_partials(const PointerLists<1>& lists, const int64_t* slot_base, const float* inv_scale, double* partials);

/// CPU twin of kernels::cuda::l2_norm_reduce: the partials summed in slot order in fp64 (so the result does not
/// depend on the number of threads), square roots rounded to fp32.
void l2_norm_reduce(const double* partials, const int64_t* slot_base, int64_t num_tensors, int64_t num_slots,
                    float* total, float* per_tensor, float* found_inf);

}  // namespace kernels::cpu
