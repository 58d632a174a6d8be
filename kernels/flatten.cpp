#include <kernels/flatten.h>

#include <cstdint>
#include <map>
#include <vector>

#include <c10/util/Exception.h>

#include <kernels/cpu/scaled_copy_cpu.h>
#include <kernels/device_call.h>
#include <kernels/scalar_arg.h>
#include <kernels/tensor_lists.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <kernels/cuda/scaled_copy_cuda.h>
#endif

namespace kernels {
namespace {

enum class Direction { kIntoBucket, kFromBucket };

// Checks the arguments and builds, per tensor dtype, the (src, dst) lists of the scaled copy: each tensor paired
// with its view of the bucket (Note [bucket layout]), computed here on the host as base + offset * element size.
std::vector<PointerLists<2>> bucket_copy_lists(const at::Tensor& bucket, at::TensorList tensors, Direction direction) {
  TORCH_CHECK(bucket.defined(), "bucket is an undefined tensor");
  const DType bucket_dtype = to_kernel_dtype(bucket.scalar_type(), "bucket");
  TORCH_CHECK(bucket.dim() == 1, "bucket must be 1-D, got sizes ", bucket.sizes());
  TORCH_CHECK(bucket.is_contiguous(), "bucket must be contiguous, got stride ", bucket.stride(0));
  check_floating_contiguous_list(tensors, "tensors", bucket.device());
  int64_t total = 0;
  for (const at::Tensor& t : tensors) total += t.numel();
  TORCH_CHECK(total <= bucket.numel(), "bucket has ", bucket.numel(), " elements but the ", tensors.size(),
              " tensors hold ", total, " in all");

  auto* base = static_cast<char*>(bucket.data_ptr());
  const int64_t element_bytes = bucket.element_size();
  std::map<DType, PointerLists<2>> groups;
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const DType dtype = to_kernel_dtype(t.scalar_type(), "tensors");
    void* bucket_view = base + offset * element_bytes;
    auto& group = groups[dtype];
    if (direction == Direction::kIntoBucket) {
      group.dtypes = {dtype, bucket_dtype};
      group.push_back({t.data_ptr(), bucket_view}, t.numel(), static_cast<int64_t>(i));
    } else {
      group.dtypes = {bucket_dtype, dtype};
      group.push_back({bucket_view, t.data_ptr()}, t.numel(), static_cast<int64_t>(i));
    }
    offset += t.numel();
  }
  std::vector<PointerLists<2>> out;
  for (auto& entry : groups) out.push_back(std::move(entry.second));
  return out;
}

void bucket_copy(const at::Tensor& bucket, at::TensorList tensors, double scale, Direction direction) {
  const ScalarArg scale_arg = ScalarArg::from_value(static_cast<float>(scale));
  for (const PointerLists<2>& group : bucket_copy_lists(bucket, tensors, direction)) {
    on_device(
        bucket.device(), [&] { cpu::scaled_copy(group, scale_arg, nullptr, nullptr); },
        [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
          cuda::scaled_copy(group, scale_arg, nullptr, nullptr, stream);
#endif
        });
  }
}

}  // namespace

void flatten_into_(const at::Tensor& bucket, at::TensorList tensors, double scale) {
  bucket_copy(bucket, tensors, scale, Direction::kIntoBucket);
}

void unflatten_from_(const at::Tensor& bucket, at::TensorList tensors, double scale) {
  bucket_copy(bucket, tensors, scale, Direction::kFromBucket);
}

}  // namespace kernels
