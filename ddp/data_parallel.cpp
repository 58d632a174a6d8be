#include <ddp/data_parallel.h>

#include <exception>
#include <optional>
#include <string>
#include <thread>

#include <ATen/Functions.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace ddp::detail {

std::vector<c10::Device> resolve_devices(const DataParallelOptions& options) {
  if (!options.devices().empty()) return options.devices();
  std::vector<c10::Device> devices;
  const c10::DeviceIndex count = c10::impl::VirtualGuardImpl(c10::kCUDA).deviceCount();
  for (c10::DeviceIndex i = 0; i < count; ++i) devices.emplace_back(c10::kCUDA, i);
  TORCH_CHECK(!devices.empty(),
              "DataParallel: no CUDA device is visible and DataParallelOptions().devices() is empty; name the devices "
              "to replicate over (e.g. {torch::kCPU} to run on the CPU)");
  return devices;
}

void check_module_on(const torch::nn::Module& module, const c10::Device& device) {
  auto check = [&](const std::string& kind, const std::string& name, const at::Tensor& t) {
    TORCH_CHECK(t.device() == device, "DataParallel: the module's ", kind, " '", name, "' is on ", t.device(),
                " but the first replica device is ", device,
                "; move the module there before wrapping it (and before amp::initialize)");
  };
  for (const auto& p : module.named_parameters(/*recurse=*/true)) check("parameter", p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/true)) check("buffer", b.key(), b.value());
}

std::vector<at::Tensor> scatter(const at::Tensor& input, const std::vector<c10::Device>& devices, int64_t dim) {
  TORCH_CHECK(input.defined(), "DataParallel: the input is an undefined tensor");
  TORCH_CHECK(input.dim() > 0, "DataParallel: cannot split a 0-dimensional input along dim ", dim);
  TORCH_CHECK(dim >= -input.dim() && dim < input.dim(), "DataParallel: dim ", dim,
              " is out of range for an input of shape ", input.sizes());
  TORCH_CHECK(input.size(dim) > 0, "DataParallel: the input of shape ", input.sizes(), " is empty along dim ", dim);
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(devices.size()), input.size(dim));
  std::vector<at::Tensor> chunks = input.chunk(n, dim);
  for (size_t i = 0; i < chunks.size(); ++i) chunks[i] = chunks[i].to(devices[i]);
  return chunks;
}

std::vector<at::Tensor> parallel_apply(const std::function<at::Tensor(size_t)>& forward,
                                       const std::vector<c10::Device>& devices) {
  std::vector<at::Tensor> outputs(devices.size());
  std::vector<std::exception_ptr> errors(devices.size());
  // Each replica runs on the stream that is current for its device on the calling thread (where its inputs and
  // parameters were copied), not on the worker thread's default stream.
  std::vector<std::optional<c10::Stream>> streams(devices.size());
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i].type() != c10::kCPU)
      streams[i] = c10::impl::VirtualGuardImpl(devices[i].type()).getStream(devices[i]);
  }
  auto run = [&](size_t i) {
    try {
      c10::DeviceGuard on_device(devices[i]);
      std::optional<c10::StreamGuard> on_stream;
      if (streams[i]) on_stream.emplace(*streams[i]);
      outputs[i] = forward(i);
      TORCH_CHECK(outputs[i].defined(), "returned an undefined tensor");
    } catch (c10::Error& e) {
      e.add_context(c10::str("in DataParallel replica ", i, " on ", devices[i]));
      errors[i] = std::current_exception();
    } catch (...) {
      errors[i] = std::current_exception();
    }
  };
  // Thread-local state (autocast on and its dtype, grad mode, ...) does not follow work to other threads unless
  // it is carried there.
  const at::ThreadLocalState caller_state;
  std::vector<std::thread> threads;
  struct JoinAll {  // also when starting a thread throws: never leave a joinable std::thread behind
    std::vector<std::thread>& threads;
    ~JoinAll() {
      for (std::thread& t : threads) {
        if (t.joinable()) t.join();
      }
    }
  } join_all{threads};
  threads.reserve(devices.size() - 1);
  for (size_t i = 1; i < devices.size(); ++i) {
    threads.emplace_back([&, i] {
      at::ThreadLocalStateGuard state(caller_state);
      run(i);
    });
  }
  run(0);
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return outputs;
}

at::Tensor gather(const std::vector<at::Tensor>& outputs, const c10::Device& device, int64_t dim) {
  std::vector<at::Tensor> moved;
  moved.reserve(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    TORCH_CHECK(outputs[i].dim() > 0 && dim >= -outputs[i].dim() && dim < outputs[i].dim(), "DataParallel: replica ", i,
                " returned an output of shape ", outputs[i].sizes(), ", which cannot be gathered along dim ", dim);
    TORCH_CHECK(outputs[i].scalar_type() == outputs[0].scalar_type(), "DataParallel: replica ", i, " returned ",
                outputs[i].scalar_type(), " but replica 0 returned ", outputs[0].scalar_type());
    moved.push_back(outputs[i].to(device));
  }
  return at::cat(moved, dim);
}

void copy_buffers(const torch::nn::Module& from, torch::nn::Module& to) {
  const auto source = from.named_buffers(/*recurse=*/true);
  at::NoGradGuard no_grad;
  for (auto& b : to.named_buffers(/*recurse=*/true)) {
    const at::Tensor* value = source.find(b.key());
    if (value != nullptr && value->defined()) b.value().copy_(*value);
  }
}

}  // namespace ddp::detail
