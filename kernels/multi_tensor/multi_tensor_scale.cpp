#include <kernels/multi_tensor/multi_tensor_scale.h>

#include <c10/util/Exception.h>

#include <kernels/cpu/capability.h>
#include <kernels/cpu/multi_tensor_scale_cpu.h>
#include <kernels/device_call.h>
#include <kernels/tensor_lists.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <kernels/cuda/multi_tensor_scale_cuda.h>
#endif

namespace kernels {
namespace cpu {
LTA_CPU_DISPATCH(multi_tensor_scale, (const PointerLists<1>& lists, float scale), (lists, scale))
}  // namespace cpu

void multi_tensor_scale_(at::TensorList tensors, double scale) {
  const c10::Device device = device_of(tensors);
  const auto scale_f = static_cast<float>(scale);
  for (const PointerLists<1>& group : group_by_dtype(tensors, "tensors", device)) {
    on_device(
        device, [&] { cpu::multi_tensor_scale(group, scale_f); },
        [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
          cuda::multi_tensor_scale(group, scale_f, stream);
#endif
        });
  }
}

}  // namespace kernels
