#pragma once

// Scopes a benchmark run sits in on its device: TF32 on or off, and the peak memory it allocates.

#include <optional>

#include <torch/torch.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace bench {

constexpr double kBytesPerMiB = 1024.0 * 1024.0;

/// TF32 for cuBLAS and cuDNN on (the TF32 run) or off (every other run: strict FP32 where ops stay fp32; note
/// that PyTorch's default leaves cuDNN's TF32 on). Restores the previous settings.
class Tf32Scope {
 public:
  explicit Tf32Scope(bool enabled)
      : saved_cublas_(at::globalContext().allowTF32CuBLAS()), saved_cudnn_(at::globalContext().allowTF32CuDNN()) {
    at::globalContext().setAllowTF32CuBLAS(enabled);
    at::globalContext().setAllowTF32CuDNN(enabled);
  }
  ~Tf32Scope() {
    at::globalContext().setAllowTF32CuBLAS(saved_cublas_);
    at::globalContext().setAllowTF32CuDNN(saved_cudnn_);
  }
  Tf32Scope(const Tf32Scope&) = delete;
  Tf32Scope& operator=(const Tf32Scope&) = delete;

 private:
  bool saved_cublas_, saved_cudnn_;
};

/// CUDA: peak bytes allocated through the caching allocator during a run, above what was allocated at its start
/// (the data set). CPU: not measured (no allocator statistics; max RSS never goes down between runs).
class PeakMemory {
 public:
  explicit PeakMemory(const torch::Device& device) : device_(device) {
#ifdef LIBTORCH_AMP_WITH_CUDA
    if (device_.is_cuda()) {
      index_ = device_.has_index() ? device_.index() : c10::cuda::current_device();
      torch::cuda::synchronize(index_);
      c10::cuda::CUDACachingAllocator::resetPeakStats(index_);
      start_bytes_ = aggregate().current;
    }
#endif
  }
  std::optional<double> peak_mib() const {
#ifdef LIBTORCH_AMP_WITH_CUDA
    if (device_.is_cuda()) {
      torch::cuda::synchronize(index_);
      return static_cast<double>(aggregate().peak - start_bytes_) / kBytesPerMiB;
    }
#endif
    return std::nullopt;
  }

 private:
#ifdef LIBTORCH_AMP_WITH_CUDA
  c10::CachingAllocator::Stat aggregate() const {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(index_)
        .allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  }
  c10::DeviceIndex index_ = 0;
  int64_t start_bytes_ = 0;
#endif
  torch::Device device_;
};

}  // namespace bench
