#include <kernels/tensor_lists.h>

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
    TORCH_CHECK(t.device() == device, arg_name, "[", i, "] is on ", t.device(), " but the call runs on ", device,
                ": all tensors of one call must share a device");
    TORCH_CHECK(t.scalar_type() == c10::ScalarType::Float || t.scalar_type() == c10::ScalarType::Half ||
                    t.scalar_type() == c10::ScalarType::BFloat16,
                arg_name, "[", i, "] must be float32, float16 or bfloat16, got ", t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), arg_name, "[", i, "] must be contiguous, got sizes ", t.sizes(), " strides ",
                t.strides());
  }
}

void check_list_dtype(at::TensorList list, const char* arg_name, c10::ScalarType dtype) {
  for (size_t i = 0; i < list.size(); ++i) {
    TORCH_CHECK(list[i].scalar_type() == dtype, arg_name, "[", i, "] must be ", dtype, ", got ", list[i].scalar_type());
  }
}

void check_flag_tensor(const at::Tensor& flag, const char* arg_name, const c10::Device& device) {
  check_scalar_tensor(flag, arg_name, device, c10::ScalarType::Float);
}

void check_scalar_tensor(const at::Tensor& scalar, const char* arg_name, const c10::Device& device,
                         c10::ScalarType dtype) {
  TORCH_CHECK(scalar.defined(), arg_name, " is an undefined tensor; it must be a 1-element ", dtype, " tensor on ",
              device);
  TORCH_CHECK(scalar.numel() == 1 && scalar.scalar_type() == dtype && scalar.device() == device, arg_name,
              " must be a 1-element ", dtype, " tensor on ", device, ", got ", scalar.numel(), " element(s) of ",
              scalar.scalar_type(), " on ", scalar.device());
  TORCH_CHECK(scalar.is_contiguous(), arg_name, " must be contiguous");
}

int32_t* optional_index_tensor(const at::Tensor& index, const char* arg_name, const c10::Device& device) {
  if (!index.defined()) return nullptr;
  check_scalar_tensor(index, arg_name, device, c10::ScalarType::Int);
  return index.data_ptr<int32_t>();
}

c10::Device device_of(at::TensorList first_list) {
  if (first_list.empty() || !first_list[0].defined()) return c10::Device(c10::kCPU);
  return first_list[0].device();
}

std::vector<PointerLists<1>> group_by_dtype(at::TensorList list, const char* name, const c10::Device& device) {
  return group_lists<1>({list}, {name}, device);
}

}  // namespace kernels
