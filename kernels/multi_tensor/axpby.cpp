#include <kernels/multi_tensor/axpby.h>

#include <c10/util/Exception.h>

#include <kernels/cpu/axpby_cpu.h>
#include <kernels/cpu/capability.h>
#include <kernels/device_call.h>
#include <kernels/tensor_lists.h>
#ifdef LIBTORCH_AMP_WITH_CUDA
#include <kernels/cuda/axpby_cuda.h>
#endif

namespace kernels {
namespace cpu {
LTA_CPU_DISPATCH(axpby, (const PointerLists<3>& lists, float a, float b, float* found_inf, bool check_x, bool check_y),
                 (lists, a, b, found_inf, check_x, check_y))
}  // namespace cpu

namespace {

const char* check_name(CheckInputs check) {
  switch (check) {
    case CheckInputs::kNone:
      return "kNone";
    case CheckInputs::kX:
      return "kX";
    case CheckInputs::kY:
      return "kY";
    case CheckInputs::kBoth:
      return "kBoth";
  }
  return "unknown";
}

}  // namespace

void axpby_(at::TensorList out, at::TensorList x, at::TensorList y, double a, double b, const at::Tensor& found_inf,
            CheckInputs check) {
  TORCH_CHECK(found_inf.defined() || check == CheckInputs::kNone || check == CheckInputs::kBoth,
              "check=", check_name(check), " asks to check inputs but found_inf is undefined");
  if (out.empty() && x.empty() && y.empty()) return;
  const c10::Device device = device_of(x);
  // The kernels' list order (list 0 = x, 1 = y, 2 = out); errors compare against x.
  const auto groups = group_lists<3>({x, y, out}, {"x", "y", "out"}, device);
  if (found_inf.defined()) check_flag_tensor(found_inf, "found_inf", device);
  const bool check_x = check == CheckInputs::kX || check == CheckInputs::kBoth;
  const bool check_y = check == CheckInputs::kY || check == CheckInputs::kBoth;
  // With nothing to check the kernels skip the per-block flag reduction altogether.
  float* found = found_inf.defined() && (check_x || check_y) ? found_inf.data_ptr<float>() : nullptr;
  const auto a_f = static_cast<float>(a);
  const auto b_f = static_cast<float>(b);
  for (const PointerLists<3>& group : groups) {
    on_device(
        device, [&] { cpu::axpby(group, a_f, b_f, found, check_x, check_y); },
        [&]([[maybe_unused]] CudaStreamHandle stream) {
#ifdef LIBTORCH_AMP_WITH_CUDA
          cuda::axpby(group, a_f, b_f, found, check_x, check_y, stream);
#endif
        });
  }
}

}  // namespace kernels
