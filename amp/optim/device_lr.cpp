#include <amp/optim/device_lr.h>

#include <cmath>

#include <ATen/ops/full.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace amp::detail {

void update_device_lr(at::Tensor& device_lr, double& written, double lr, const c10::Device& device, bool capturing,
                      const std::string& who, size_t group) {
  // NaN never equals itself, so a tensor of unknown value is always written (and refused while capturing).
  const bool current = device_lr.defined() && written == lr;
  if (current) return;
  TORCH_CHECK(!capturing, who, ": param group ", group, "'s learning rate is ", lr, " but its device copy ",
              !device_lr.defined()  ? std::string("does not exist yet")
              : std::isnan(written) ? std::string("has not been written")
                                    : c10::str("holds ", written),
              ", and nothing can be written while a CUDA graph is being captured on ", device,
              ". Run one step outside the capture first (warm-up), and call sync_lr() after changing the learning "
              "rate, before capturing or replaying");
  if (!device_lr.defined()) {
    device_lr = at::full({1}, lr, at::TensorOptions().dtype(at::kFloat).device(device));
  } else {
    device_lr.fill_(lr);  // a device fill: no host sync
  }
  written = lr;
}

}  // namespace amp::detail
