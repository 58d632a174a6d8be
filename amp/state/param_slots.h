#pragma once

// The parameters amp's optimizer updates and their fp32 masters: one of State's parts (Note [State's parts] in
// amp/state/state.h). Internal: users go through amp/amp.h.

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

namespace amp::detail {

/// One parameter the optimizer updates: the model's tensor (where autograd writes the gradient) and the
/// tensor the optimizer holds (its fp32 master, or the model tensor itself when it needs no master).
struct ParamSlot {
  std::string name;
  at::Tensor model;
  at::Tensor master;
  bool has_master = false;
};

/// The optimizer's parameters in param-group order, each named after the model parameter it is. Slot indices are
/// what the fused kernels record as the first non-finite gradient, so an index names a parameter.
class ParamSlots {
 public:
  /// Checks that the model has parameters, all fp32 on one device, and that every optimizer parameter is one of them.
  ParamSlots(torch::nn::Module& module, const torch::optim::Optimizer& optimizer);
  /// The same over `named` tensors instead of a module's parameters (full sharding: the shards, named after their
  /// units); `of_what` ends the refusal of a foreign optimizer parameter ("is not <of_what>").
  ParamSlots(const std::vector<std::pair<std::string, at::Tensor>>& named, const torch::optim::Optimizer& optimizer,
             const std::string& of_what);

  const c10::Device& device() const { return device_; }
  size_t size() const { return slots_.size(); }
  ParamSlot& operator[](size_t i) { return slots_[i]; }
  const ParamSlot& operator[](size_t i) const { return slots_[i]; }
  std::vector<ParamSlot>::iterator begin() { return slots_.begin(); }
  std::vector<ParamSlot>::iterator end() { return slots_.end(); }
  std::vector<ParamSlot>::const_iterator begin() const { return slots_.begin(); }
  std::vector<ParamSlot>::const_iterator end() const { return slots_.end(); }
  /// The slot whose model tensor is `model`, or -1 (a parameter the optimizer does not update).
  int64_t index_of(const at::Tensor& model) const;
  /// The slot whose parameter is named `name`, or -1.
  int64_t index_of(const std::string& name) const;
  /// Name of the parameter at slot `index`, or "<none>" (what scalers record when no gradient was non-finite).
  std::string name(int64_t index) const;

  /// Gives every half parameter that requires grad an fp32 master, from `fp32_values` (one per slot, taken before
  /// the model was cast, so they start exact), and puts it in the optimizer in the parameter's place, re-keying any
  /// optimizer state (torch::optim keys it by TensorImpl*) to the master.
  void create_masters(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& fp32_values);
  /// Another part keeps the masters from now on (ZeRO's shard): every slot's master becomes its model tensor.
  void drop_masters();
  /// A plain torch::optim step updated the masters: their values rounded into the half model parameters.
  void copy_masters_to_models();
  /// Drops every model and master gradient.
  void clear_grads();

 private:
  std::vector<ParamSlot> slots_;
  std::unordered_map<const c10::TensorImpl*, int64_t> index_of_;  ///< model tensor -> slot
  std::unordered_map<std::string, int64_t> index_of_name_;        ///< parameter name -> slot
  c10::Device device_ = c10::kCPU;
};

}  // namespace amp::detail
