#include <amp/nn/float8_linear.h>

#include <sstream>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/nn/functional/linear.h>

#include <amp/nn/dense_util.h>
#include <kernels/gemm/fp8.h>

namespace amp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kFp8RowMultiple = 16;  // cuBLASLt's FP8 GEMMs want every dimension a multiple of 16

/// A cast 2-D tensor: q (row-major), qt (its transpose, rows padded), and the scale_inv both are read back with.
struct Cast {
  at::Tensor q;
  at::Tensor qt;
  at::Tensor scale_inv;
};

int64_t padded(int64_t rows) { return (rows + kFp8RowMultiple - 1) / kFp8RowMultiple * kFp8RowMultiple; }

/// Casts t (2-D, contiguous) for tensor `role` in one pass (kernels::fp8_cast_transpose): delayed scaling with the
/// row's scale, current scaling with t's own amax (one more pass). Records max|t| in the row's current amax (column
/// 0) when `record`. qt's columns (t's rows) are zero-padded to a multiple of 16: in the weight gradient they are the
/// GEMM's inner dimension, which cuBLASLt wants a multiple of 16 (zeros add nothing to a product or an amax).
Cast cast_fp8(const at::Tensor& t, int role, const at::Tensor& history, const at::Tensor& scale,
              const at::Tensor& scale_inv, const Fp8Recipe& recipe, bool record, bool want_q, bool want_qt) {
  const c10::ScalarType dtype = recipe.dtype(role);
  const at::Tensor slot = record ? history.select(0, role).narrow(0, 0, 1) : at::Tensor();
  at::Tensor s, s_inv;
  if (recipe.scaling() == Fp8Scaling::kCurrent) {
    const auto f32 = t.options().dtype(at::kFloat);
    at::Tensor amax = at::zeros({1}, f32);
    s = at::empty({1}, f32);
    s_inv = at::empty({1}, f32);
    kernels::fp8_amax_(t, amax);
    kernels::fp8_current_scale_(amax, s, s_inv, kernels::fp8_max(dtype), recipe.margin());
  } else {
    // scale_inv is copied: the step's update rewrites the row, and backward must read what forward used.
    s = scale.narrow(0, role, 1);
    s_inv = scale_inv.narrow(0, role, 1).clone();
  }
  kernels::Fp8Cast cast = kernels::fp8_cast_transpose(t, s, dtype, slot, padded(t.size(0)), want_q, want_qt);
  return {cast.q, cast.qt, s_inv};
}

c10::ScalarType code_dtype(int64_t code) { return static_cast<c10::ScalarType>(code); }

Fp8Recipe recipe_of(AutogradContext* ctx) {
  return Fp8Recipe()
      .scaling(static_cast<Fp8Scaling>(ctx->saved_data["scaling"].toInt()))
      .format(static_cast<Fp8Format>(ctx->saved_data["format"].toInt()))
      .margin(ctx->saved_data["margin"].toInt());
}

/// Forward and backward of Float8Linear on 2-D inputs. `record`: collect amaxes (training; a forward under
/// no_grad, as in evaluation, casts with the current scales and leaves the histories alone). history/scale/scale_inv
/// are the layer's scaling state, modified in place (amaxes) and therefore kept in saved_data, not saved_for_backward
/// (whose version check would refuse them).
struct Float8LinearFunction : public torch::autograd::Function<Float8LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias_or_empty, const at::Tensor& history, const at::Tensor& scale,
                            const at::Tensor& scale_inv, int64_t scaling, int64_t format, int64_t margin,
                            int64_t out_dtype_code, bool record) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor bias = detail::present(bias_or_empty);
    const Fp8Recipe recipe =
        Fp8Recipe().scaling(static_cast<Fp8Scaling>(scaling)).format(static_cast<Fp8Format>(format)).margin(margin);
    const c10::ScalarType out_dtype = code_dtype(out_dtype_code);
    // Forward reads x and W row-major; backward reads x^T (weight gradient) and W^T (input gradient): the one
    // cast pass writes both layouts where they will be needed, and backward keeps only the transposes.
    const bool backward_w = record && weight.requires_grad();
    const bool backward_x = record && x.requires_grad();
    const Cast xq = cast_fp8(x, kFp8Input, history, scale, scale_inv, recipe, record, true, backward_w);
    const Cast wq =
        cast_fp8(weight.contiguous(), kFp8Weight, history, scale, scale_inv, recipe, record, true, backward_x);
    const bool bias_in_gemm = bias.defined() && out_dtype != at::kFloat;  // cuBLASLt's FP8 bias is bf16/fp16
    at::Tensor y =
        detail::fp8_mm(xq.q, wq.q.t(), xq.scale_inv, wq.scale_inv,
                       bias_in_gemm ? std::optional<at::Tensor>(bias.to(out_dtype)) : std::nullopt, out_dtype);
    if (bias.defined() && !bias_in_gemm) y = y + bias.to(out_dtype);
    ctx->save_for_backward({xq.qt, xq.scale_inv, wq.qt, wq.scale_inv});
    ctx->saved_data["history"] = history;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["scale_inv"] = scale_inv;
    ctx->saved_data["scaling"] = scaling;
    ctx->saved_data["format"] = format;
    ctx->saved_data["margin"] = margin;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["b_dtype"] = bias.defined() ? static_cast<int64_t>(bias.scalar_type()) : int64_t{-1};
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x_t = saved[0];  // [in, padded rows]: x as the column-major [rows, in] operand
    const at::Tensor& x_inv = saved[1];
    const at::Tensor& w_t = saved[2];  // [in, out]: W as the column-major [out, in] operand
    const at::Tensor& w_inv = saved[3];
    const Fp8Recipe recipe = recipe_of(ctx);
    const at::Tensor g = grads[0].contiguous();
    const bool want_dx = ctx->needs_input_grad(0), want_dw = ctx->needs_input_grad(1);
    const Cast gq = cast_fp8(g, kFp8GradOutput, ctx->saved_data["history"].toTensor(),
                             ctx->saved_data["scale"].toTensor(), ctx->saved_data["scale_inv"].toTensor(), recipe,
                             /*record=*/true, want_dx, want_dw);
    at::Tensor dx, dw, db;
    if (want_dx) {
      TORCH_CHECK(w_t.defined(), "Float8Linear: backward needs the input's gradient but forward did not keep W^T");
      dx = detail::fp8_mm(gq.q, w_t.t(), gq.scale_inv, w_inv, std::nullopt,
                          code_dtype(ctx->saved_data["x_dtype"].toInt()));
    }
    if (want_dw) {
      TORCH_CHECK(x_t.defined(), "Float8Linear: backward needs the weight's gradient but forward did not keep x^T");
      dw = detail::fp8_mm(gq.qt, x_t.t(), gq.scale_inv, x_inv, std::nullopt,
                          code_dtype(ctx->saved_data["w_dtype"].toInt()));
    }
    const int64_t b_dtype = ctx->saved_data["b_dtype"].toInt();
    if (b_dtype >= 0 && ctx->needs_input_grad(2)) db = at::sum(g, {0}, false, code_dtype(b_dtype));
    variable_list out(11);
    out[0] = dx;
    out[1] = dw;
    out[2] = db;
    return out;
  }
};

}  // namespace

namespace detail {
at::Tensor fp8_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale, const at::Tensor& b_scale,
                  const std::optional<at::Tensor>& bias, c10::ScalarType out_dtype) {
  if (!a.is_cpu()) return at::_scaled_mm(a, b, a_scale, b_scale, bias, std::nullopt, out_dtype);
  // FP8 -> fp32 is exact, and so is each product of two FP8 values; the sum is an fp32 GEMM, scaled by the same
  // fp32 alpha = a_scale * b_scale that cuBLASLt applies, then the bias, then one rounding to out_dtype.
  at::Tensor out = at::mm(a.to(at::kFloat), b.to(at::kFloat)).mul_(a_scale * b_scale);
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out_dtype == at::kFloat ? out : out.to(out_dtype);
}

at::Tensor fp8_max_per_row(const Fp8Recipe& recipe, int64_t layers, const c10::Device& device) {
  std::vector<float> max;
  for (int64_t l = 0; l < layers; ++l) {
    for (int role = 0; role < kFp8TensorsPerLayer; ++role) max.push_back(kernels::fp8_max(recipe.dtype(role)));
  }
  return at::tensor(max, at::kFloat).to(device);
}
}  // namespace detail

Float8LinearImpl::Float8LinearImpl(const Float8LinearOptions& options_) : options(options_) {
  TORCH_CHECK(options.in_features() > 0 && options.out_features() > 0,
              "Float8Linear: in_features and out_features must be > 0, got ", options.in_features(), " and ",
              options.out_features());
  reset();
}

void Float8LinearImpl::reset() {
  // The same registrations and draws as torch::nn::LinearImpl::reset, so the two are interchangeable.
  detail::register_linear_parameters(*this, options.in_features(), options.out_features(), options.bias(), weight,
                                     bias);
}

void Float8LinearImpl::reset_parameters() { detail::reset_linear_parameters(weight, bias); }

void Float8LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "amp::Float8Linear(in_features=" << options.in_features() << ", out_features=" << options.out_features()
         << ", bias=" << std::boolalpha << options.bias();
  if (fp8_enabled()) stream << ", fp8=" << meta_.recipe.to_string();
  stream << ")";
}

std::string Float8LinearImpl::fp8_ineligibility(const c10::Device& device) const {
  const std::string device_reason = kernels::fp8_gemm_unsupported_reason(device);
  if (!device_reason.empty()) return device_reason;
  std::ostringstream why;
  for (const auto& [name, value] : {std::pair<const char*, int64_t>("in_features", options.in_features()),
                                    std::pair<const char*, int64_t>("out_features", options.out_features())}) {
    if (value % kFp8RowMultiple != 0) {
      if (why.tellp() > 0) why << " and ";
      why << name << "=" << value << " is not a multiple of " << kFp8RowMultiple;
    }
  }
  if (why.tellp() > 0) why << " (cuBLASLt's FP8 GEMMs need every dimension a multiple of 16)";
  return why.str();
}

void Float8LinearImpl::enable_fp8(const Fp8Recipe& recipe) {
  recipe.check();
  const auto f32 = weight.options().dtype(at::kFloat);
  Fp8Meta meta;
  meta.recipe = recipe;
  meta.history = at::zeros({kFp8TensorsPerLayer, recipe.amax_history_len()}, f32);
  meta.scale = at::ones({kFp8TensorsPerLayer}, f32);
  meta.scale_inv = at::ones({kFp8TensorsPerLayer}, f32);
  enable_fp8(std::move(meta));
  owns_state_ = true;
}

void Float8LinearImpl::enable_fp8(Fp8Meta meta) {
  const std::string why = fp8_ineligibility(weight.device());
  TORCH_CHECK(why.empty(), "Float8Linear(", options.in_features(), " -> ", options.out_features(),
              ") cannot run in FP8: ", why);
  meta.recipe.check();
  TORCH_CHECK(meta.history.defined() && meta.history.dim() == 2 && meta.history.size(0) == kFp8TensorsPerLayer &&
                  meta.history.size(1) == meta.recipe.amax_history_len() && meta.history.scalar_type() == at::kFloat,
              "Float8Linear: the FP8 history must be fp32 [3, ", meta.recipe.amax_history_len(), "]");
  for (const at::Tensor* t : {&meta.scale, &meta.scale_inv}) {
    TORCH_CHECK(t->defined() && t->numel() == kFp8TensorsPerLayer && t->scalar_type() == at::kFloat,
                "Float8Linear: FP8 scales must be fp32 [3]");
  }
  fp8_max_ = detail::fp8_max_per_row(meta.recipe, 1, meta.history.device());
  meta_ = std::move(meta);
  owns_state_ = false;
}

void Float8LinearImpl::update_fp8_scales(const at::Tensor& found_inf) {
  TORCH_CHECK(fp8_enabled(), "Float8Linear::update_fp8_scales: FP8 is not enabled on this layer");
  TORCH_CHECK(owns_state_,
              "Float8Linear::update_fp8_scales: this layer's FP8 state belongs to amp (Options::fp8), which updates "
              "it once per optimizer.step(); a second update would roll the histories twice");
  const at::Tensor flag = found_inf.defined() ? found_inf : at::zeros({1}, meta_.history.options());
  kernels::fp8_update_scales_(meta_.history, meta_.scale, meta_.scale_inv, fp8_max_, flag, meta_.recipe.margin(),
                              meta_.recipe.amax_compute() == Fp8AmaxCompute::kMax);
}

at::Tensor Float8LinearImpl::forward(const at::Tensor& input) {
  if (!fp8_enabled()) return torch::nn::functional::linear(input, weight, bias);
  detail::check_features("Float8Linear", input, options.in_features());
  const c10::DeviceType device_type = input.device().type();
  TORCH_CHECK(input.device() == weight.device(), "Float8Linear: input is on ", input.device(), " but weight on ",
              weight.device());
  TORCH_CHECK(meta_.history.device() == weight.device(), "Float8Linear: the FP8 state is on ", meta_.history.device(),
              " but the weight on ", weight.device(), ": enable FP8 after moving the layer (amp::initialize does)");
  const bool autocast = at::autocast::is_autocast_enabled(device_type);
  const c10::ScalarType out_dtype = autocast ? at::autocast::get_autocast_dtype(device_type) : input.scalar_type();
  if (!autocast) detail::check_dtypes("Float8Linear", input, weight, "weight");
  const at::Tensor x = input.reshape({-1, options.in_features()}).contiguous();
  const at::Tensor y = Float8LinearFunction::apply(
      x, weight, detail::bias_argument(bias, x), meta_.history, meta_.scale, meta_.scale_inv,
      static_cast<int64_t>(meta_.recipe.scaling()), static_cast<int64_t>(meta_.recipe.format()), meta_.recipe.margin(),
      static_cast<int64_t>(out_dtype),
      /*record=*/at::GradMode::is_enabled());
  return y.view(detail::output_sizes(input, options.out_features()));
}

}  // namespace amp
