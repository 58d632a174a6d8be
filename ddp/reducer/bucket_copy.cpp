#include <ddp/reducer/bucket_copy.h>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <kernels/flatten.h>

namespace ddp::detail {
namespace {

void check_layout(const at::Tensor& bucket, at::TensorList tensors) {
  TORCH_CHECK(bucket.dim() == 1 && bucket.is_contiguous(), "bucket must be a contiguous 1-D tensor, got shape ",
              bucket.sizes());
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].device() == bucket.device(), "tensors[", i, "] is on ", tensors[i].device(),
                " but the bucket is on ", bucket.device());
    total += tensors[i].numel();
  }
  TORCH_CHECK(total <= bucket.numel(), "bucket holds ", bucket.numel(), " elements, the tensors need ", total);
}

bool is_kernel_dtype(c10::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

}  // namespace

bool fusable(const at::Tensor& bucket, at::TensorList tensors) {
  if (!is_kernel_dtype(bucket.scalar_type())) return false;
  for (const at::Tensor& t : tensors) {
    if (!is_kernel_dtype(t.scalar_type()) || !t.is_contiguous()) return false;
  }
  return true;
}

void copy_into_bucket(const at::Tensor& bucket, at::TensorList tensors, double scale) {
  check_layout(bucket, tensors);
  if (fusable(bucket, tensors)) {
    kernels::flatten_into_(bucket, tensors, scale);
    return;
  }
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    const int64_t n = t.numel();
    at::Tensor slot = bucket.narrow(0, offset, n);
    if (scale == 1.0) {
      slot.copy_(t.reshape({n}));
    } else if (t.scalar_type() == bucket.scalar_type()) {
      at::mul_out(slot, t.reshape({n}), scale);
    } else {
      slot.copy_(t.reshape({n}).mul(scale));  // scaled in the gradient's dtype, rounded once to the bucket's
    }
    offset += n;
  }
}

void copy_from_bucket(const at::Tensor& bucket, at::TensorList tensors, double scale) {
  check_layout(bucket, tensors);
  if (fusable(bucket, tensors)) {
    kernels::unflatten_from_(bucket, tensors, scale);
    return;
  }
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    const int64_t n = t.numel();
    at::Tensor slot = bucket.narrow(0, offset, n).view(t.sizes());
    if (scale == 1.0) {
      t.copy_(slot);
    } else if (t.scalar_type() == bucket.scalar_type()) {
      at::mul_out(const_cast<at::Tensor&>(t), slot, scale);
    } else {
      t.copy_(slot);  // widening or narrowing first, then scaled in the gradient's dtype
      t.mul_(scale);
    }
    offset += n;
  }
}

}  // namespace ddp::detail
