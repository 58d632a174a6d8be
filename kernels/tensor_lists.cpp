#include <kernels/tensor_lists.h>

#include <array>

#include <c10/util/Exception.h>

namespace kernels {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "unknown";
}

DType to_kernel_dtype(c10::ScalarType type, const char* what) {
  switch (type) {
    case c10::ScalarType::Float:
      return DType::kFloat32;
    case c10::ScalarType::Half:
      return DType::kFloat16;
    case c10::ScalarType::BFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, what, " must be float32, float16 or bfloat16, got ", type);
  }
}

void check_floating_contiguous_list(at::TensorList list, const char* arg_name, const c10::Device& device) {
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    TORCH_CHECK(t.defined(), arg_name, "[", i, "] is an undefined tensor");
    TORCH_CHECK(t.device() == device, arg_name, "[", i, "] is on ", t.device(), " but ", arg_name, "[0] is on ", device,
                ": all tensors of one call must share a device");
    TORCH_CHECK(t.scalar_type() == c10::ScalarType::Float || t.scalar_type() == c10::ScalarType::Half ||
                    t.scalar_type() == c10::ScalarType::BFloat16,
                arg_name, "[", i, "] must be float32, float16 or bfloat16, got ", t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), arg_name, "[", i, "] must be contiguous, got sizes ", t.sizes(), " strides ",
                t.strides());
  }
}

std::vector<PointerLists<1>> group_by_dtype(at::TensorList list) {
  std::array<PointerLists<1>, 3> by_dtype;
  for (size_t i = 0; i < list.size(); ++i) {
    const DType dtype = to_kernel_dtype(list[i].scalar_type(), "tensor");
    auto& group = by_dtype[static_cast<int>(dtype)];
    group.dtype = dtype;
    group.push_back({list[i].data_ptr()}, list[i].numel(), static_cast<int64_t>(i));
  }
  std::vector<PointerLists<1>> groups;
  for (auto& group : by_dtype) {
    if (group.size() > 0) groups.push_back(std::move(group));
  }
  return groups;
}

}  // namespace kernels
