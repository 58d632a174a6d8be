#pragma once

// The tutorial's first way: one process, the model replicated over several devices each forward
// (PyTorch's nn.DataParallel). torch::nn::parallel::data_parallel does the replication; this wrapper adds what
// training with amp needs from it:
// - each replica runs with the caller's thread-local state (autocast on and its dtype, grad mode), so amp's O1
//   policy reaches every replica (LibTorch's parallel_apply runs replicas on at::parallel_for threads, which
//   start with autocast off: the replicas would silently run in fp32);
// - the module is never moved: it must already live on devices[0] (LibTorch's single-device path calls
//   module->to(), which would detach amp's model tensors from their fp32 masters);
// - the first replica's buffers (BatchNorm statistics) are written back to the module, as nn.DataParallel does by
//   sharing them, instead of being lost with the replica;
// - errors name the replica, its device and the shapes.
//
//   auto [model, optimizer] = amp::initialize(net, sgd, amp::Options().opt_level(amp::OptLevel::O1));
//   ddp::DataParallel dp(net, ddp::DataParallelOptions().output_device(torch::kCPU));
//   auto out = model.call([&](const at::Tensor& x) { return dp.forward(x); }, images);

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/parallel/data_parallel.h>
#include <torch/nn/pimpl.h>

namespace ddp {

/// Options of DataParallel: the replica devices, the output device and the split dimension.
struct DataParallelOptions {
  /// The devices to replicate over, one replica each (a device may repeat). Empty: every visible CUDA device.
  TORCH_ARG(std::vector<c10::Device>, devices) = {};
  /// Where the outputs are gathered (any device, the CPU included). Default: devices[0].
  TORCH_ARG(std::optional<c10::Device>, output_device) = std::nullopt;
  /// The dimension along which inputs are split and outputs concatenated.
  TORCH_ARG(int64_t, dim) = 0;
};

namespace detail {

/// The devices `options` name (every visible CUDA device when empty), checked: an error when there are none.
std::vector<c10::Device> resolve_devices(const DataParallelOptions& options);
/// Checks that every parameter and buffer of `module` lives on `device`; the error names the first that does not.
void check_module_on(const torch::nn::Module& module, const c10::Device& device);
/// Splits `input` along `dim` into at most devices.size() chunks, each moved to its device (autograd-aware).
std::vector<at::Tensor> scatter(const at::Tensor& input, const std::vector<c10::Device>& devices, int64_t dim);
/// Runs forward(i) for every i, replica 0 on the calling thread and the others on threads of their own, each with
/// the caller's thread-local state and devices[i] as the current device. Rethrows the first failure, naming the
/// replica and its device.
std::vector<at::Tensor> parallel_apply(const std::function<at::Tensor(size_t)>& forward,
                                       const std::vector<c10::Device>& devices);
/// Moves every output to `device` and concatenates them along `dim` (autograd-aware).
at::Tensor gather(const std::vector<at::Tensor>& outputs, const c10::Device& device, int64_t dim);
/// Copies `from`'s buffers into `to`'s (same module structure), without recording autograd history.
void copy_buffers(const torch::nn::Module& from, torch::nn::Module& to);

}  // namespace detail

/// Single-process data parallel training of `module` (a torch::nn::Cloneable whose forward takes and returns one
/// tensor) over several devices: every forward splits the input along dim, runs a fresh replica per chunk on its
/// device in parallel, and gathers the outputs on output_device. Backward sums the replicas' gradients into the
/// module's own parameters, so an optimizer over module->parameters() (or amp's) trains it as usual. With one
/// device (or a batch of one) the module itself runs, without replication. Host syncs: those of the device copies.
/// Replicas are made with LibTorch's Module::clone, which runs the module's reset() (its initializers, on the CPU,
/// drawing from the global generator) before copying the parameters in: a cost per forward that grows with the
/// model, as for torch::nn::parallel::data_parallel, and random draws that a single-device run does not make.
template <typename ModuleType>
class DataParallel {
 public:
  /// Wraps `module`, which must be non-null and have every parameter and buffer on the first device already (it is
  /// never moved). Throws c10::Error when the module is null, when no device is named and no CUDA device is visible,
  /// or when a parameter or buffer is elsewhere (the error names it).
  explicit DataParallel(std::shared_ptr<ModuleType> module, DataParallelOptions options = {})
      : module_(std::move(module)), options_(std::move(options)) {
    TORCH_CHECK(module_ != nullptr, "DataParallel: module is null");
    devices_ = detail::resolve_devices(options_);
    output_device_ = options_.output_device().value_or(devices_.front());
    detail::check_module_on(*module_, devices_.front());
  }
  /// Wraps the module that the holder `module` points to; the same checks as the shared_ptr constructor.
  explicit DataParallel(const torch::nn::ModuleHolder<ModuleType>& module, DataParallelOptions options = {})
      : DataParallel(module.ptr(), std::move(options)) {}

  /// Splits `input` along dim into at most devices().size() chunks (fewer when the batch is smaller), runs one
  /// replica per chunk, copies replica 0's buffers back into the module and returns the outputs concatenated on
  /// output_device(). With a single chunk the module itself runs. Throws c10::Error for an undefined, 0-dimensional
  /// or empty input, a dim out of range, or a failing replica (the error names the replica and its device).
  at::Tensor forward(const at::Tensor& input) {
    const std::vector<at::Tensor> chunks = detail::scatter(input, devices_, options_.dim());
    if (chunks.size() == 1) return module_->forward(chunks.front()).to(output_device_);
    const std::vector<c10::Device> used(devices_.begin(),
                                        devices_.begin() + static_cast<std::ptrdiff_t>(chunks.size()));
    std::vector<std::shared_ptr<ModuleType>> replicas = torch::nn::parallel::replicate(module_, used);
    const std::vector<at::Tensor> outputs =
        detail::parallel_apply([&](size_t i) { return replicas[i]->forward(chunks[i]); }, used);
    detail::copy_buffers(*replicas.front(), *module_);
    return detail::gather(outputs, output_device_, options_.dim());
  }
  /// Same as forward(input).
  at::Tensor operator()(const at::Tensor& input) { return forward(input); }

  /// The wrapped module, whose parameters receive the gradients.
  const std::shared_ptr<ModuleType>& module() const { return module_; }
  /// The replica devices: the ones the options name, or every visible CUDA device.
  const std::vector<c10::Device>& devices() const { return devices_; }
  /// Where forward() gathers the outputs: the options' output_device, or devices()[0].
  const c10::Device& output_device() const { return output_device_; }

 private:
  std::shared_ptr<ModuleType> module_;
  DataParallelOptions options_;
  std::vector<c10::Device> devices_;
  c10::Device output_device_{c10::kCPU};
};

}  // namespace ddp
