#include <amp/autocast.h>

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

namespace amp {
namespace {

c10::DeviceType checked_device_type(c10::DeviceType device_type) {
  TORCH_CHECK(device_type == c10::DeviceType::CUDA || device_type == c10::DeviceType::CPU,
              "AutocastScope supports CUDA and CPU, got device type ", device_type);
  return device_type;
}

}  // namespace

// Note [autocast cache]
// Under autocast, the fp16/bf16 copy of an fp32 leaf weight that requires grad is cached for the life of
// the outermost autocast region, so a weight used by several ops is cast once per forward. The cache is
// keyed by the weight's TensorImpl, not its values: after optimizer.step() changes the weight in place the
// cached copy is stale. Closing the outermost region (nesting back at 0) clears the cache, which is what
// PyTorch's `torch.autocast.__exit__` does and what a hand-rolled LibTorch loop easily forgets.

AutocastScope::AutocastScope(c10::DeviceType device_type, c10::ScalarType dtype, bool enabled, bool cache_enabled)
    : device_type_(checked_device_type(device_type)),
      saved_enabled_(at::autocast::is_autocast_enabled(device_type)),
      saved_dtype_(at::autocast::get_autocast_dtype(device_type)),
      saved_cache_enabled_(at::autocast::is_autocast_cache_enabled()) {
  TORCH_CHECK(dtype == c10::ScalarType::Half || dtype == c10::ScalarType::BFloat16,
              "AutocastScope dtype must be Half or BFloat16, got ", dtype);
  at::autocast::set_autocast_enabled(device_type, enabled);
  at::autocast::set_autocast_dtype(device_type, dtype);
  at::autocast::set_autocast_cache_enabled(cache_enabled);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  at::autocast::set_autocast_enabled(device_type_, saved_enabled_);
  at::autocast::set_autocast_dtype(device_type_, saved_dtype_);
  at::autocast::set_autocast_cache_enabled(saved_cache_enabled_);
}

c10::ScalarType default_autocast_dtype(c10::DeviceType device_type) {
  return device_type == c10::DeviceType::CUDA ? c10::ScalarType::Half : c10::ScalarType::BFloat16;
}

}  // namespace amp
