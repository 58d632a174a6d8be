#include <kernels/multi_tensor/unscale.h>

#include <c10/util/Exception.h>

#include <kernels/cpu/capability.h>
#include <kernels/cpu/unscale_cpu.h>
#include <kernels/device_call.h>
#include <kernels/tensor_lists.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <kernels/cuda/unscale_cuda.h>
#endif

namespace kernels {
namespace cpu {
LTA_CPU_DISPATCH(unscale_and_check,
                 (const PointerLists<1>& lists, const float* inv_scale, float* found_inf, int32_t* first_index),
                 (lists, inv_scale, found_inf, first_index))
}  // namespace cpu

namespace {

void unscale_groups(std::vector<PointerLists<1>>& groups, const c10::Device& device, const at::Tensor& inv_scale,
                    const at::Tensor& found_inf, int32_t* first_index) {
  const auto* inv = inv_scale.data_ptr<float>();
  auto* found = found_inf.data_ptr<float>();
  for (const PointerLists<1>& group : groups) {
    on_device(
        device, [&] { cpu::unscale_and_check(group, inv, found, first_index); },
        [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
          cuda::unscale_and_check(group, inv, found, first_index, stream);
#endif
        });
  }
}

}  // namespace

void unscale_and_check_(at::TensorList grads, const at::Tensor& inv_scale, const at::Tensor& found_inf,
                        const at::Tensor& first_nonfinite_index, int64_t index_offset) {
  if (grads.empty()) return;
  const c10::Device device = device_of(grads);
  check_scalar_tensor(inv_scale, "inv_scale", device, c10::ScalarType::Float);
  check_flag_tensor(found_inf, "found_inf", device);
  int32_t* first_index = optional_index_tensor(first_nonfinite_index, "first_nonfinite_index", device);
  auto groups = group_by_dtype(grads, "grads", device);
  apply_index_offset(groups, index_offset);
  unscale_groups(groups, device, inv_scale, found_inf, first_index);
}

void unscale_and_check_(at::TensorList grads, const at::Tensor& inv_scale, const at::Tensor& found_inf,
                        const at::Tensor& first_nonfinite_index, c10::ArrayRef<int64_t> indices) {
  if (grads.empty()) return;
  const c10::Device device = device_of(grads);
  check_scalar_tensor(inv_scale, "inv_scale", device, c10::ScalarType::Float);
  check_flag_tensor(found_inf, "found_inf", device);
  int32_t* first_index = optional_index_tensor(first_nonfinite_index, "first_nonfinite_index", device);
  auto groups = group_by_dtype(grads, "grads", device);
  apply_explicit_indices(groups, indices, grads.size());
  unscale_groups(groups, device, inv_scale, found_inf, first_index);
}

}  // namespace kernels
