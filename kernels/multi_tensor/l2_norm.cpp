#include <kernels/multi_tensor/l2_norm.h>

#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <kernels/optim/clip_rule.h>
#include <kernels/cpu/capability.h>
#include <kernels/cpu/chunks.h>
#include <kernels/cpu/l2_norm_cpu.h>
#include <kernels/cpu/multi_tensor_scale_cpu.h>
#include <kernels/device_call.h>
#include <kernels/tensor_lists.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <kernels/cuda/l2_norm_cuda.h>
#endif

namespace kernels {
namespace cpu {
LTA_CPU_DISPATCH(l2_norm_partials,
                 (const PointerLists<1>& lists, const int64_t* slot_base, const float* inv_scale, double* partials),
                 (lists, slot_base, inv_scale, partials))
LTA_CPU_DISPATCH(l2_norm_reduce,
                 (const double* partials, const int64_t* slot_base, int64_t num_tensors, int64_t num_slots,
                  float* total, float* per_tensor, float* found_inf),
                 (partials, slot_base, num_tensors, num_slots, total, per_tensor, found_inf))
}  // namespace cpu

namespace {

/// The slot table of Note [deterministic two-stage norm], filled on the host: tensor i owns slots
/// [table[i], table[i + 1]), one per chunk (the CUDA launcher counts the same chunks: static_assert in
/// kernels/cuda/l2_norm.cu). A CUDA call hands it to the device in kernel parameters (cuda::write_slot_table), never
/// through a host buffer, so a launch captured in a CUDA graph replays with these values.
at::Tensor slot_table(at::TensorList tensors) {
  const auto n = static_cast<int64_t>(tensors.size());
  at::Tensor table = at::empty({n + 1}, at::TensorOptions().dtype(at::kLong));
  auto* base = table.data_ptr<int64_t>();
  base[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    base[i + 1] = base[i] + (tensors[i].numel() + cpu::kChunkElements - 1) / cpu::kChunkElements;
  }
  return table;
}

/// l2_norm over already checked and grouped tensors; found_inf (may be null) is raised when the total is not
/// finite.
L2NormResult norm_of_groups(at::TensorList tensors, const std::vector<PointerLists<1>>& groups,
                            const c10::Device& device, bool per_tensor, const float* inv_scale, float* found_inf) {
  const auto n = static_cast<int64_t>(tensors.size());
  const auto options = at::TensorOptions().dtype(at::kFloat).device(device);
  L2NormResult result{at::empty({}, options), per_tensor ? at::empty({n}, options) : at::Tensor()};
  float* total = result.total.data_ptr<float>();
  float* per = per_tensor ? result.per_tensor.data_ptr<float>() : nullptr;
  const at::Tensor host_slots = slot_table(tensors);
  const int64_t num_slots = host_slots.data_ptr<int64_t>()[n];
  // Every slot is written by stage 1 before stage 2 reads it: no zeroing needed.
  const at::Tensor partials = at::empty({num_slots}, options.dtype(at::kDouble));
  double* work = partials.data_ptr<double>();
  on_device(
      device,
      [&] {
        const auto* slots = host_slots.data_ptr<int64_t>();
        for (const PointerLists<1>& group : groups) cpu::l2_norm_partials(group, slots, inv_scale, work);
        cpu::l2_norm_reduce(work, slots, n, num_slots, total, per, found_inf);
      },
      [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
        const at::Tensor device_slots = at::empty({n + 1}, options.dtype(at::kLong));
        auto* slots = device_slots.data_ptr<int64_t>();
        cuda::write_slot_table(host_slots.data_ptr<int64_t>(), n + 1, slots, stream);
        for (const PointerLists<1>& group : groups) cuda::l2_norm_partials(group, slots, inv_scale, work, stream);
        cuda::l2_norm_reduce(work, slots, n, num_slots, total, per, found_inf, stream);
#endif
      });
  return result;
}

L2NormResult empty_list_norm(bool per_tensor) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  return {at::zeros({}, options), per_tensor ? at::zeros({0}, options) : at::Tensor()};
}

}  // namespace

L2NormResult l2_norm(at::TensorList tensors, bool per_tensor, const at::Tensor& inv_scale) {
  const c10::Device device = device_of(tensors);
  const auto groups = group_by_dtype(tensors, "tensors", device);
  if (tensors.empty()) return empty_list_norm(per_tensor);
  const float* inv = nullptr;
  if (inv_scale.defined()) {
    check_scalar_tensor(inv_scale, "inv_scale", device, c10::ScalarType::Float);
    inv = inv_scale.data_ptr<float>();
  }
  return norm_of_groups(tensors, groups, device, per_tensor, inv, nullptr);
}

at::Tensor clip_grad_norm_(at::TensorList grads, double max_norm, const at::Tensor& found_inf) {
  const auto max_norm_f = static_cast<float>(max_norm);
  // Also rejects NaN, and values that round to 0 in fp32 (they would zero every gradient).
  TORCH_CHECK(max_norm_f > 0.0f, "max_norm must be > 0 (as a float32; +inf never clips), got ", max_norm);
  const c10::Device device = device_of(grads);
  const auto groups = group_by_dtype(grads, "grads", device);
  if (grads.empty()) return empty_list_norm(false).total;
  float* found = nullptr;
  if (found_inf.defined()) {
    check_flag_tensor(found_inf, "found_inf", device);
    found = found_inf.data_ptr<float>();
  }
  const L2NormResult norm = norm_of_groups(grads, groups, device, false, nullptr, found);
  const float* total = norm.total.data_ptr<float>();
  for (const PointerLists<1>& group : groups) {
    on_device(
        device,
        [&] {
          const float coef = clip_coefficient(*total, max_norm_f);
          if (coef != 1.0f) cpu::multi_tensor_scale(group, coef);
        },
        [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
          cuda::clip_by_norm(group, total, max_norm_f, stream);
#endif
        });
  }
  return norm.total;
}

}  // namespace kernels
