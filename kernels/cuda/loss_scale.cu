#include <kernels/cuda/check.h>
#include <kernels/cuda/loss_scale_cuda.h>

namespace kernels::cuda {
namespace {

__global__ void update_scale_kernel(LossScaleRule rule, float* scale, int32_t* growth_tracker,
                                    int32_t* hysteresis_tracker, const float* found_inf) {
  apply_loss_scale_rule(rule, scale, growth_tracker, hysteresis_tracker, *found_inf != 0.0f);
}

}  // namespace

void update_scale(const LossScaleRule& rule, float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                  const float* found_inf, cudaStream_t stream) {
  update_scale_kernel<<<1, 1, 0, stream>>>(rule, scale, growth_tracker, hysteresis_tracker, found_inf);
  LTA_CUDA_CHECK_LAUNCH("update_scale_kernel");
}

}  // namespace kernels::cuda
