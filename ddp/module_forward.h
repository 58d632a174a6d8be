#pragma once

// How a wrapper of a whole model (DistributedDataParallel, FullyShardedDataParallel) calls the model's forward: a
// module with a single forward() through torch::nn::AnyModule, a Sequential (whose forward is a template) directly.
// Internal to ddp/ (ddp::detail).

#include <memory>
#include <type_traits>
#include <utility>

#include <torch/detail/static.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

namespace ddp::detail {

/// The model's forward, when it has one that can be called with any arguments; empty otherwise.
class ModuleForward {
 public:
  ModuleForward() = default;

  /// The forward of `module`: its single forward(), a Sequential's, or none.
  template <typename ModuleType>
  static ModuleForward of(const std::shared_ptr<ModuleType>& module) {
    ModuleForward f;
    if constexpr (std::is_base_of_v<torch::nn::SequentialImpl, ModuleType>) {
      f.sequential_ = module;
    } else if constexpr (torch::detail::has_forward<ModuleType>::value) {
      f.any_ = torch::nn::AnyModule(module);
    }
    return f;
  }

  /// Whether call() can run.
  bool callable() const { return sequential_ || !any_.is_empty(); }

  /// The module's forward(args...); callable() must hold.
  template <typename ReturnType, typename... Args>
  ReturnType call(Args&&... args) {
    if (sequential_) return sequential_->forward<ReturnType>(std::forward<Args>(args)...);
    return any_.forward<ReturnType>(std::forward<Args>(args)...);
  }

 private:
  torch::nn::AnyModule any_;                               ///< a module with a single forward()
  std::shared_ptr<torch::nn::SequentialImpl> sequential_;  ///< Sequential's forward is a template
};

}  // namespace ddp::detail
