#include <amp/nn/dense_util.h>

#include <cmath>

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/init.h>

namespace amp::detail {

at::Tensor autocast_input(const at::Tensor& t, c10::DeviceType device_type) {
  if (!t.defined() || !at::autocast::is_autocast_enabled(device_type)) return t;
  return at::autocast::cached_cast(at::autocast::get_autocast_dtype(device_type), t, device_type);
}

void check_dtypes(const char* layer, const at::Tensor& input, const at::Tensor& weight, const char* weight_name) {
  TORCH_CHECK(input.scalar_type() == weight.scalar_type(), layer, ": input ", input.sizes(), " is ",
              input.scalar_type(), " but ", weight_name, " ", weight.sizes(), " is ", weight.scalar_type(),
              ": cast one of them, or let amp do it (O1 autocasts, O2/O3 cast the inputs)");
}

void check_features(const char* layer, const at::Tensor& input, int64_t in_features) {
  TORCH_CHECK(input.defined(), layer, ": input is an undefined tensor");
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == in_features, layer,
              ": input's last dimension must be in_features=", in_features, ", got input sizes ", input.sizes());
}

std::vector<int64_t> output_sizes(const at::Tensor& input, int64_t out_features) {
  std::vector<int64_t> sizes(input.sizes().begin(), input.sizes().end() - 1);
  sizes.push_back(out_features);
  return sizes;
}

at::Tensor bias_argument(const at::Tensor& bias, const at::Tensor& like) {
  return bias.defined() ? bias : at::empty({0}, like.options());
}

at::Tensor present(const at::Tensor& bias_or_empty) { return bias_or_empty.numel() > 0 ? bias_or_empty : at::Tensor(); }

void register_linear_parameters(torch::nn::Module& module, int64_t in_features, int64_t out_features, bool with_bias,
                                at::Tensor& weight, at::Tensor& bias) {
  weight = module.register_parameter("weight", torch::empty({out_features, in_features}));
  if (with_bias) {
    bias = module.register_parameter("bias", torch::empty(out_features));
  } else {
    bias = module.register_parameter("bias", {}, /*requires_grad=*/false);
  }
  reset_linear_parameters(weight, bias);
}

void reset_linear_parameters(at::Tensor& weight, at::Tensor& bias) {
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5));
  if (bias.defined()) {
    const auto fans = torch::nn::init::_calculate_fan_in_and_fan_out(weight);
    const double bound = 1.0 / std::sqrt(static_cast<double>(std::get<0>(fans)));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

}  // namespace amp::detail
