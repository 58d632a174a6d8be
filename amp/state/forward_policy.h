#pragma once

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

#include <amp/autocast.h>
#include <amp/state/model_cast.h>

namespace amp {

/// What amp::Model does around the wrapped module's forward, decided by the resolved options: Apex patched
/// forward in Python; in C++ the wrapper does it. O1 opens an autocast scope; O2/O3 cast floating inputs to
/// the model's half dtype; every opt level returns a floating at::Tensor result in fp32 (see output()).
struct ForwardPolicy {
  bool autocast = false;     ///< O1: run() opens an AutocastScope(device_type, half_dtype)
  bool cast_inputs = false;  ///< the model was cast (O2/O3): input() casts floating tensors to half_dtype
  c10::ScalarType half_dtype = c10::ScalarType::Half;  ///< Options::half_dtype: input, autocast and kept-norm casts
  c10::DeviceType device_type = c10::DeviceType::CPU;  ///< the model's device type (for the autocast scope)
  /// keep_layernorm_fp32 under a model cast: the fp32 LayerNorm/GroupNorm modules whose ops get half casts of
  /// their parameters during the forward (Note [kept norms under a model cast] in amp/state/model_cast.h).
  std::vector<std::shared_ptr<torch::nn::Module>> kept_norms;

  /// One argument as f receives it: under cast_inputs a defined floating at::Tensor becomes a copy in half_dtype;
  /// other tensors pass as they are, and arguments of other types (containers of tensors included) are forwarded
  /// unchanged.
  template <typename T>
  decltype(auto) input(T&& arg) const {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      if (cast_inputs && arg.defined() && arg.is_floating_point()) return at::Tensor(arg.to(half_dtype));
      return at::Tensor(std::forward<T>(arg));
    } else {
      return std::forward<T>(arg);
    }
  }

  /// The result as run() returns it: a defined floating at::Tensor that is not fp32 becomes fp32; any other result
  /// (an fp32 or integer tensor, a tuple or vector of tensors, a non-tensor) is returned unchanged.
  template <typename T>
  static T output(T&& result) {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      if (result.defined() && result.is_floating_point() && result.scalar_type() != at::kFloat) {
        return result.to(at::kFloat);
      }
    }
    return std::forward<T>(result);
  }

  /// Calls f(cast args...) under the policy and returns its result with floating outputs in fp32. An op with no
  /// fp16 kernel on the CPU is reported with the policy that led to it and the fix (bf16 on CPUs).
  template <typename F, typename... Args>
  auto run(F&& f, Args&&... args) const {
    std::optional<AutocastScope> scope;
    if (autocast) scope.emplace(device_type, half_dtype);
    std::optional<KeptNormCast> norms;
    if (!kept_norms.empty()) norms.emplace(kept_norms, half_dtype);
    try {
      return output(f(input(std::forward<Args>(args))...));
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      TORCH_CHECK(!(device_type == c10::DeviceType::CPU && half_dtype == c10::ScalarType::Half &&
                    what.find("not implemented for 'Half'") != std::string::npos),
                  "amp: an op of this model has no float16 kernel on the CPU (", what,
                  "); use half_dtype(at::kBFloat16) on CPUs, or opt level O0");
      throw;
    }
  }
};

}  // namespace amp
