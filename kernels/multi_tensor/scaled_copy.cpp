#include <kernels/multi_tensor/scaled_copy.h>

#include <c10/util/Exception.h>

#include <kernels/cpu/capability.h>
#include <kernels/cpu/scaled_copy_cpu.h>
#include <kernels/device_call.h>
#include <kernels/scalar_arg.h>
#include <kernels/tensor_lists.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <kernels/cuda/scaled_copy_cuda.h>
#endif

namespace kernels {
namespace cpu {
LTA_CPU_DISPATCH(scaled_copy, (const PointerLists<2>& lists, ScalarArg scale, float* found_inf, int32_t* first_index),
                 (lists, scale, found_inf, first_index))
}  // namespace cpu

namespace {

// `scale_tensor` is checked here when defined (the tensor overload); otherwise `scale` carries the value.
void scaled_copy_impl(at::TensorList src, at::TensorList dst, const at::Tensor& scale_tensor, float scale_value,
                      const at::Tensor& found_inf, const at::Tensor& first_nonfinite_index, int64_t index_offset,
                      const c10::ArrayRef<int64_t>* indices = nullptr) {
  if (src.empty() && dst.empty()) return;
  const c10::Device device = device_of(src);
  auto groups = group_lists<2>({src, dst}, {"src", "dst"}, device);
  ScalarArg scale = ScalarArg::from_value(scale_value);
  if (scale_tensor.defined()) {
    check_scalar_tensor(scale_tensor, "scale", device, c10::ScalarType::Float);
    scale = ScalarArg::from_device(scale_tensor.data_ptr<float>());
  }
  float* found = nullptr;
  if (found_inf.defined()) {
    check_flag_tensor(found_inf, "found_inf", device);
    found = found_inf.data_ptr<float>();
  }
  int32_t* first_index = optional_index_tensor(first_nonfinite_index, "first_nonfinite_index", device);
  if (indices != nullptr) {
    apply_explicit_indices(groups, *indices, src.size());
  } else {
    apply_index_offset(groups, index_offset);
  }
  for (const PointerLists<2>& group : groups) {
    on_device(
        device, [&] { cpu::scaled_copy(group, scale, found, first_index); },
        [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
          cuda::scaled_copy(group, scale, found, first_index, stream);
#endif
        });
  }
}

}  // namespace

void scaled_copy_(at::TensorList src, at::TensorList dst, const at::Tensor& scale, const at::Tensor& found_inf,
                  const at::Tensor& first_nonfinite_index, int64_t index_offset) {
  TORCH_CHECK(scale.defined(), "scale is an undefined tensor; pass a 1-element float32 tensor or a double");
  scaled_copy_impl(src, dst, scale, 0.0f, found_inf, first_nonfinite_index, index_offset);
}

void scaled_copy_(at::TensorList src, at::TensorList dst, double scale, const at::Tensor& found_inf,
                  const at::Tensor& first_nonfinite_index, int64_t index_offset) {
  scaled_copy_impl(src, dst, at::Tensor(), static_cast<float>(scale), found_inf, first_nonfinite_index, index_offset);
}

void scaled_copy_(at::TensorList src, at::TensorList dst, const at::Tensor& scale, const at::Tensor& found_inf,
                  const at::Tensor& first_nonfinite_index, c10::ArrayRef<int64_t> indices) {
  TORCH_CHECK(scale.defined(), "scale is an undefined tensor; pass a 1-element float32 tensor");
  scaled_copy_impl(src, dst, scale, 0.0f, found_inf, first_nonfinite_index, 0, &indices);
}

}  // namespace kernels
