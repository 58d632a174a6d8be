#include <amp/recompute/activation_checkpoint.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>

#include <amp/autocast.h>
#include <ddp/recompute.h>

namespace amp {
namespace {

using Fn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// The thread's autocast state for one device type, as the forward saw it (the dtype only matters when enabled).
struct AutocastState {
  bool enabled = false;
  c10::ScalarType dtype = c10::ScalarType::BFloat16;

  static AutocastState of(c10::DeviceType type) {
    const bool enabled = at::autocast::is_autocast_enabled(type);
    return {enabled, enabled ? at::autocast::get_autocast_dtype(type) : default_autocast_dtype(type)};
  }
};

/// Autocast's cast cache off while the wrapped function runs, restored after. The cache is process-wide and keyed by
/// the weight: a copy cast in the no-grad forward has no link to its weight, and a later use of the same weight in
/// the same autocast region (or the recompute, when backward runs inside the region) would take that copy, and the
/// weight would get no gradient. Uncached casts give the same values.
class NoCastCache {
 public:
  NoCastCache() : saved_(at::autocast::is_autocast_cache_enabled()) { at::autocast::set_autocast_cache_enabled(false); }
  ~NoCastCache() { at::autocast::set_autocast_cache_enabled(saved_); }
  NoCastCache(const NoCastCache&) = delete;
  NoCastCache& operator=(const NoCastCache&) = delete;

 private:
  bool saved_;
};

/// What backward needs besides the inputs: the function, the random and autocast states of the forward, and what the
/// forward's outputs looked like (the recompute must give the same).
struct Stash : torch::CustomClassHolder {
  Fn fn;
  bool preserve_rng = true;
  std::vector<std::pair<c10::Device, at::Tensor>> rng;  // the CPU's generator state, then each CUDA input device's
  AutocastState cpu_autocast;
  AutocastState cuda_autocast;
  std::vector<bool> input_requires_grad;
  std::vector<std::vector<int64_t>> output_shapes;
  std::vector<c10::ScalarType> output_dtypes;
};

at::Tensor generator_state(const c10::Device& device) {
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_generator_state(const c10::Device& device, const at::Tensor& state) {
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

/// For the recompute: the forward's random states in, and the caller's back out when it ends (also on a throw), so
/// that the rest of the run draws what it would have drawn without checkpointing. Not locked: two threads that
/// recompute at once must not share a generator (the CPU's: dropout in CPU replicas of one process).
class RngFork {
 public:
  explicit RngFork(const Stash& stash) {
    if (!stash.preserve_rng) return;
    for (const auto& [device, state] : stash.rng) {
      now_.emplace_back(device, generator_state(device));
      set_generator_state(device, state);
    }
  }
  ~RngFork() {
    for (const auto& [device, state] : now_) {
      try {
        set_generator_state(device, state);
      } catch (...) {  // a destructor must not throw; a state read back a moment ago does not fail to set
      }
    }
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  std::vector<std::pair<c10::Device, at::Tensor>> now_;
};

std::string shape_text(const std::vector<int64_t>& shape, c10::ScalarType dtype) {
  return c10::str(c10::IntArrayRef(shape), " ", dtype);
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                const c10::intrusive_ptr<Stash>& stash) {
    std::vector<torch::Tensor> kept(inputs.begin(), inputs.end());
    ctx->save_for_backward(kept);
    ctx->set_materialize_grads(false);  // an output nothing used gets no gradient, not zeros to backpropagate
    std::vector<torch::Tensor> outputs;
    {
      NoCastCache no_cache;
      outputs = stash->fn(kept);  // grad is off here: no activation is kept
    }
    for (const torch::Tensor& out : outputs) {
      TORCH_CHECK(out.defined(), "amp::activation_checkpoint: the function returned an undefined tensor");
      stash->output_shapes.push_back(out.sizes().vec());
      stash->output_dtypes.push_back(out.scalar_type());
    }
    ctx->saved_data["stash"] = c10::IValue::make_capsule(stash);
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    // As PyTorch's reentrant checkpoint: the recompute's own backward accumulates into every leaf it reaches, which
    // autograd::grad and backward(inputs=...) must not see; and it builds no graph of the gradients.
    TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
                "amp::activation_checkpoint: not with torch::autograd::grad or backward with inputs: the recompute's "
                "backward would add gradients to the wrapped function's parameters too (call backward() on the loss)");
    TORCH_CHECK(!torch::GradMode::is_enabled(),
                "amp::activation_checkpoint: no double backward (create_graph): the recompute's gradients are not "
                "differentiable");
    const auto stash = c10::static_intrusive_pointer_cast<Stash>(ctx->saved_data["stash"].toCapsule());
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    std::vector<torch::Tensor> inputs;
    inputs.reserve(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      inputs.push_back(saved[i].detach().requires_grad_(stash->input_requires_grad[i]));
    }
    std::vector<torch::Tensor> outputs;
    {
      RngFork rng(*stash);
      ddp::RecomputeScope recompute;  // SyncBatchNorm leaves its running statistics alone
      torch::AutoGradMode grad(true);
      AutocastScope cpu(c10::kCPU, stash->cpu_autocast.dtype, stash->cpu_autocast.enabled, /*cache_enabled=*/false);
      AutocastScope cuda(c10::kCUDA, stash->cuda_autocast.dtype, stash->cuda_autocast.enabled, false);
      outputs = stash->fn(inputs);
    }
    TORCH_CHECK(outputs.size() == stash->output_shapes.size(), "amp::activation_checkpoint: the recompute returned ",
                outputs.size(), " tensor(s), the forward ", stash->output_shapes.size(),
                ": the wrapped function must compute the same thing each time");
    std::vector<torch::Tensor> differentiable, grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      const bool same = outputs[i].defined() && outputs[i].sizes().vec() == stash->output_shapes[i] &&
                        outputs[i].scalar_type() == stash->output_dtypes[i];
      TORCH_CHECK(same, "amp::activation_checkpoint: output ", i, " of the recompute is ",
                  outputs[i].defined() ? shape_text(outputs[i].sizes().vec(), outputs[i].scalar_type()) : "undefined",
                  ", of the forward ", shape_text(stash->output_shapes[i], stash->output_dtypes[i]),
                  ": the wrapped function must compute the same thing each time");
      if (outputs[i].requires_grad() && i < grad_outputs.size() && grad_outputs[i].defined()) {
        differentiable.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!differentiable.empty()) {
      // DDP's end-of-backward step, if a gradient here is the pass's first, belongs to the outer backward.
      ddp::NestedBackwardScope nested;
      torch::autograd::backward(differentiable, grads);
      nested.finish();
    }
    torch::autograd::variable_list input_grads;
    input_grads.reserve(inputs.size() + 1);
    for (const torch::Tensor& input : inputs) input_grads.push_back(input.grad());
    input_grads.emplace_back();  // the stash: not a tensor
    return input_grads;
  }
};

}  // namespace

std::vector<torch::Tensor> activation_checkpoint(const Fn& fn, const std::vector<torch::Tensor>& inputs,
                                                 const ActivationCheckpointOptions& options) {
  TORCH_CHECK(fn, "amp::activation_checkpoint: no function given");
  if (!torch::GradMode::is_enabled()) return fn(inputs);  // evaluation: nothing to rebuild
  auto stash = c10::make_intrusive<Stash>();
  bool any_requires_grad = false;
  for (const torch::Tensor& input : inputs) {
    TORCH_CHECK(input.defined(), "amp::activation_checkpoint: an input is an undefined tensor");
    stash->input_requires_grad.push_back(input.requires_grad());
    any_requires_grad = any_requires_grad || input.requires_grad();
  }
  TORCH_CHECK(any_requires_grad, "amp::activation_checkpoint: none of the ", inputs.size(),
              " input(s) requires grad, so backward would "
              "never reach the wrapped function and its parameters would get no gradient (wrap a block whose input "
              "comes from a layer that trains, or call requires_grad_() on the input)");
  stash->fn = fn;
  stash->preserve_rng = options.preserve_rng_state;
  if (stash->preserve_rng) {  // the CPU's generator, and each CUDA device's that an input is on
    stash->rng.emplace_back(c10::Device(c10::kCPU), generator_state(c10::Device(c10::kCPU)));
    for (const torch::Tensor& input : inputs) {
      const bool seen = std::any_of(stash->rng.begin(), stash->rng.end(),
                                    [&](const auto& entry) { return entry.first == input.device(); });
      if (input.is_cuda() && !seen) stash->rng.emplace_back(input.device(), generator_state(input.device()));
    }
  }
  stash->cpu_autocast = AutocastState::of(c10::kCPU);
  stash->cuda_autocast = AutocastState::of(c10::kCUDA);
  return CheckpointFunction::apply(at::TensorList(inputs), stash);
}

torch::Tensor activation_checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                                    const torch::Tensor& input, const ActivationCheckpointOptions& options) {
  TORCH_CHECK(fn, "amp::activation_checkpoint: no function given");
  return activation_checkpoint(
      [fn](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{fn(in[0])}; }, {input},
      options)[0];
}

torch::Tensor checkpoint_sequential(torch::nn::Sequential& sequential, int64_t segments, const torch::Tensor& input,
                                    const ActivationCheckpointOptions& options) {
  const auto size = static_cast<int64_t>(sequential->size());
  TORCH_CHECK(segments >= 1 && segments <= size, "amp::checkpoint_sequential: segments must be in [1, ", size,
              "] (the modules of the Sequential), got ", segments);
  if (!torch::GradMode::is_enabled()) return sequential->forward(input);
  // The holder by value (a shared pointer): backward may run after the caller's variable is gone.
  const auto run = [held = sequential.ptr()](int64_t begin, int64_t end, torch::Tensor x) {
    for (auto module = held->begin() + begin; module != held->begin() + end; ++module) x = module->forward(x);
    return x;
  };
  const int64_t per_segment = size / segments;
  torch::Tensor x = input;
  int64_t begin = 0;
  for (int64_t s = 0; s + 1 < segments; ++s, begin += per_segment) {
    const int64_t end = begin + per_segment;
    if (!x.requires_grad()) {  // fed the data: a checkpoint would cut it off from backward
      x = run(begin, end, x);
      continue;
    }
    x = activation_checkpoint([run, begin, end](const torch::Tensor& in) { return run(begin, end, in); }, x, options);
  }
  return run(begin, size, x);
}

}  // namespace amp
