#include <kernels/multi_tensor_scale.h>

#include <c10/util/Exception.h>

#include <kernels/cpu/multi_tensor_scale_cpu.h>
#include <kernels/tensor_lists.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <kernels/cuda/multi_tensor_scale_cuda.h>
#endif

namespace kernels {

void multi_tensor_scale_(at::TensorList tensors, double scale) {
  if (tensors.empty()) return;
  const c10::Device device = tensors[0].defined() ? tensors[0].device() : c10::Device(c10::kCPU);
  check_floating_contiguous_list(tensors, "tensors", device);
  const auto scale_f = static_cast<float>(scale);
  for (const PointerLists<1>& group : group_by_dtype(tensors)) {
    if (device.is_cpu()) {
      cpu::multi_tensor_scale(group, scale_f);
      continue;
    }
#ifdef LIBTORCH_AMP_WITH_CUDA
    TORCH_CHECK(device.is_cuda(), "tensors must be on CPU or CUDA, got ", device);
    const c10::cuda::CUDAGuard guard(device);
    cuda::multi_tensor_scale(group, scale_f, c10::cuda::getCurrentCUDAStream(device.index()).stream());
#else
    TORCH_CHECK(false, "tensors are on ", device, " but libtorch_amp was built without CUDA (LIBTORCH_AMP_CUDA=OFF)");
#endif
  }
}

}  // namespace kernels
