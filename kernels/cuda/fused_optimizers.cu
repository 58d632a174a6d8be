#include <kernels/cuda/fused_optimizers_cuda.h>

#include <algorithm>
#include <vector>

#include <kernels/cuda/multi_tensor_apply.cuh>
#include <kernels/cuda/vector_access.cuh>

namespace kernels::cuda {
namespace {

// Elements each thread keeps in flight per iteration (coalesced: element k of thread t is t + k * blockDim.x).
// Parameters, gradients and state have different dtypes, so 16-byte vectors would cover different element
// counts per list; four independent scalar loads per list give the same memory-level parallelism.
constexpr int kIlp = 4;

struct DeviceMath {
  __device__ static float sqrt(float x) { return sqrtf(x); }
  // NaN-propagating, like torch::max_out: NaN in a wins by the test, NaN in b by falling through.
  __device__ static float max(float a, float b) { return (a != a || a > b) ? a : b; }
};

template <typename TParam, typename TGrad, bool kAmsgrad, bool kMaster>
struct AdamFunctor {
  static constexpr int kDepth = 5 + kAmsgrad + kMaster;

  __device__ void operator()(const ChunkTable<kDepth>& table, int block, const AdamArgs& args) const {
    if (skip_step(args.found_inf)) return;
    const Chunk chunk = chunk_of_block(table, block);
    // The last list holds each tensor's own step count (read, not written): bias corrections are per parameter.
    const AdamCoefficients c =
        adam_coefficients(args, static_cast<const float*>(table.addresses[kDepth - 1][chunk.tensor]));
    auto* param = static_cast<TParam*>(table.addresses[0][chunk.tensor]) + chunk.begin;
    const auto* grad = static_cast<const TGrad*>(table.addresses[1][chunk.tensor]) + chunk.begin;
    auto* exp_avg = static_cast<float*>(table.addresses[2][chunk.tensor]) + chunk.begin;
    auto* exp_avg_sq = static_cast<float*>(table.addresses[3][chunk.tensor]) + chunk.begin;
    float* max_exp_avg_sq = nullptr;
    float* master = nullptr;
    // Optional lists follow the four fixed ones: max_exp_avg_sqs, then masters.
    if constexpr (kAmsgrad) max_exp_avg_sq = static_cast<float*>(table.addresses[4][chunk.tensor]) + chunk.begin;
    if constexpr (kMaster) master = static_cast<float*>(table.addresses[4 + kAmsgrad][chunk.tensor]) + chunk.begin;

    const int64_t n = chunk.num_elements;
    const int64_t stride = static_cast<int64_t>(blockDim.x);
    for (int64_t base = threadIdx.x; base < n; base += kIlp * stride) {
      float p[kIlp], g[kIlp], m[kIlp], v[kIlp], v_max[kIlp];
#pragma unroll
      for (int k = 0; k < kIlp; ++k) {
        const int64_t i = base + k * stride;
        // Padding lanes hold zeros, which the rule maps to finite values (the denominator is >= eps).
        p[k] = g[k] = m[k] = v[k] = v_max[k] = 0.0f;
        if (i < n) {
          if constexpr (kMaster) {
            p[k] = master[i];
          } else {
            p[k] = to_float(param[i]);
          }
          g[k] = to_float(grad[i]);
          m[k] = exp_avg[i];
          v[k] = exp_avg_sq[i];
          if constexpr (kAmsgrad) v_max[k] = max_exp_avg_sq[i];
        }
      }
#pragma unroll
      for (int k = 0; k < kIlp; ++k) adam_update<kAmsgrad, DeviceMath>(c, p[k], g[k], m[k], v[k], v_max[k]);
#pragma unroll
      for (int k = 0; k < kIlp; ++k) {
        const int64_t i = base + k * stride;
        if (i < n) {
          exp_avg[i] = m[k];
          exp_avg_sq[i] = v[k];
          if constexpr (kAmsgrad) max_exp_avg_sq[i] = v_max[k];
          if constexpr (kMaster) master[i] = p[k];
          param[i] = from_float<TParam>(p[k]);
        }
      }
    }
  }
};

template <typename TParam, typename TGrad, bool kMomentum, bool kMaster>
struct SgdFunctor {
  static constexpr int kDepth = 2 + 2 * kMomentum + kMaster;

  __device__ void operator()(const ChunkTable<kDepth>& table, int block, const SgdArgs& args) const {
    if (skip_step(args.found_inf)) return;
    const Chunk chunk = chunk_of_block(table, block);
    // With momentum the last list holds each tensor's own step count: 0 means the buffer starts as the gradient.
    const float* step = nullptr;
    if constexpr (kMomentum) step = static_cast<const float*>(table.addresses[kDepth - 1][chunk.tensor]);
    const SgdCoefficients c = sgd_coefficients(args, step);
    auto* param = static_cast<TParam*>(table.addresses[0][chunk.tensor]) + chunk.begin;
    const auto* grad = static_cast<const TGrad*>(table.addresses[1][chunk.tensor]) + chunk.begin;
    float* momentum_buffer = nullptr;
    float* master = nullptr;
    // Optional lists follow params and grads: momentum buffers, then masters.
    if constexpr (kMomentum) momentum_buffer = static_cast<float*>(table.addresses[2][chunk.tensor]) + chunk.begin;
    if constexpr (kMaster) master = static_cast<float*>(table.addresses[2 + kMomentum][chunk.tensor]) + chunk.begin;

    const int64_t n = chunk.num_elements;
    const int64_t stride = static_cast<int64_t>(blockDim.x);
    for (int64_t base = threadIdx.x; base < n; base += kIlp * stride) {
      float p[kIlp], g[kIlp], buf[kIlp];
#pragma unroll
      for (int k = 0; k < kIlp; ++k) {
        const int64_t i = base + k * stride;
        p[k] = g[k] = buf[k] = 0.0f;
        if (i < n) {
          if constexpr (kMaster) {
            p[k] = master[i];
          } else {
            p[k] = to_float(param[i]);
          }
          g[k] = to_float(grad[i]);
          // On the parameter's first step the buffer is overwritten with the gradient: its contents are never read.
          if constexpr (kMomentum) buf[k] = c.first_step ? 0.0f : momentum_buffer[i];
        }
      }
#pragma unroll
      for (int k = 0; k < kIlp; ++k) sgd_update<kMomentum>(c, p[k], g[k], buf[k]);
#pragma unroll
      for (int k = 0; k < kIlp; ++k) {
        const int64_t i = base + k * stride;
        if (i < n) {
          if constexpr (kMomentum) momentum_buffer[i] = buf[k];
          if constexpr (kMaster) master[i] = p[k];
          param[i] = from_float<TParam>(p[k]);
        }
      }
    }
  }
};

/// Launches Functor<TParam, TGrad, kA, kB> for the group's (param, grad) dtype pair.
template <template <typename, typename, bool, bool> class Functor, bool kA, bool kB, int kDepth, typename Args>
void launch_for_dtypes(const PointerLists<kDepth>& lists, const Args& args, cudaStream_t stream) {
  dispatch_dtype(lists.dtypes[0], [&](auto param_tag) {
    dispatch_dtype(lists.dtypes[1], [&](auto grad_tag) {
      using F = Functor<decltype(param_tag), decltype(grad_tag), kA, kB>;
      static_assert(F::kDepth == kDepth, "list depth and functor layout disagree");
      multi_tensor_apply<kDepth>(lists, stream, F{}, args);
    });
  });
}

/// The step counts one advance_steps_kernel launch advances, passed by value (no host-to-device copy, so
/// capturable). 4 KB fits the kernel parameter space of every toolkit.
struct StepTable {
  static constexpr int kMaxSteps = 500;
  float* steps[kMaxSteps];
  int count;
};

__global__ void advance_steps_kernel(const StepTable table, const float* found_inf) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < table.count) kernels::advance_step(table.steps[i], found_inf);
}

}  // namespace

void fused_adam(const PointerLists<5>& lists, const AdamArgs& args, cudaStream_t stream) {
  launch_for_dtypes<AdamFunctor, false, false>(lists, args, stream);
}

void fused_adam(const PointerLists<6>& lists, const AdamArgs& args, cudaStream_t stream) {
  if (args.amsgrad) {
    launch_for_dtypes<AdamFunctor, true, false>(lists, args, stream);
  } else {
    launch_for_dtypes<AdamFunctor, false, true>(lists, args, stream);
  }
}

void fused_adam(const PointerLists<7>& lists, const AdamArgs& args, cudaStream_t stream) {
  launch_for_dtypes<AdamFunctor, true, true>(lists, args, stream);
}

void fused_sgd(const PointerLists<2>& lists, const SgdArgs& args, cudaStream_t stream) {
  launch_for_dtypes<SgdFunctor, false, false>(lists, args, stream);
}

void fused_sgd(const PointerLists<3>& lists, const SgdArgs& args, cudaStream_t stream) {
  launch_for_dtypes<SgdFunctor, false, true>(lists, args, stream);
}

void fused_sgd(const PointerLists<4>& lists, const SgdArgs& args, cudaStream_t stream) {
  launch_for_dtypes<SgdFunctor, true, false>(lists, args, stream);
}

void fused_sgd(const PointerLists<5>& lists, const SgdArgs& args, cudaStream_t stream) {
  launch_for_dtypes<SgdFunctor, true, true>(lists, args, stream);
}

void advance_steps(const std::vector<float*>& steps, const float* found_inf, cudaStream_t stream) {
  constexpr int kThreads = 128;
  StepTable table;
  for (size_t first = 0; first < steps.size(); first += StepTable::kMaxSteps) {
    const size_t count = std::min(steps.size() - first, static_cast<size_t>(StepTable::kMaxSteps));
    for (size_t i = 0; i < count; ++i) table.steps[i] = steps[first + i];
    table.count = static_cast<int>(count);
    const int blocks = (table.count + kThreads - 1) / kThreads;
    advance_steps_kernel<<<blocks, kThreads, 0, stream>>>(table, found_inf);
    LTA_CUDA_CHECK_LAUNCH("advance_steps_kernel");
  }
}

}  // namespace kernels::cuda
