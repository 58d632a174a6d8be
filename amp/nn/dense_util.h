#pragma once

// Shared by amp's dense layers (FusedDense, Float8Linear): argument checks and autocast of inputs.

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <torch/nn/module.h>

namespace amp::detail {

/// t cast to the autocast dtype when autocast is on for `device_type` (as Linear's inputs are), else t.
at::Tensor autocast_input(const at::Tensor& t, c10::DeviceType device_type);
/// input and weight have one dtype, or an error naming the layer, both sizes and dtypes, and the fix.
void check_dtypes(const char* layer, const at::Tensor& input, const at::Tensor& weight, const char* weight_name);
/// input is defined with last dimension in_features, or an error naming the layer and the sizes.
void check_features(const char* layer, const at::Tensor& input, int64_t in_features);
/// Registers `weight` [out, in] and `bias` [out] (undefined without bias) on `module` as torch::nn::LinearImpl::reset
/// does, then draws them as torch::nn::Linear (kaiming_uniform(a=sqrt(5)), bias U(+-1/sqrt(in))): a layer that
/// calls this is interchangeable with Linear in state dicts and checkpoints.
void register_linear_parameters(torch::nn::Module& module, int64_t in_features, int64_t out_features, bool with_bias,
                                at::Tensor& weight, at::Tensor& bias);
/// Re-draws weight and bias as torch::nn::Linear does.
void reset_linear_parameters(at::Tensor& weight, at::Tensor& bias);
/// An autograd Function's bias argument: the bias, or an empty tensor for none (a Function's inputs must be defined
/// tensors); present() turns it back.
at::Tensor bias_argument(const at::Tensor& bias, const at::Tensor& like);
at::Tensor present(const at::Tensor& bias_or_empty);
/// input's sizes with the last replaced by out_features.
std::vector<int64_t> output_sizes(const at::Tensor& input, int64_t out_features);

}  // namespace amp::detail
