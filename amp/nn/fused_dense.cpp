#include <amp/nn/fused_dense.h>

#include <functional>
#include <tuple>
#include <vector>

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/utils.h>

#include <amp/nn/dense_util.h>
#include <kernels/gemm/path_autotune.h>

namespace amp {

const char* dense_path_name(DensePath path) {
  switch (path) {
    case DensePath::kAuto:
      return "auto";
    case DensePath::kCublasLt:
      return "cublaslt";
    case DensePath::kAten:
      return "aten";
  }
  return "unknown";
}

namespace {

using detail::autocast_input;
using detail::bias_argument;
using detail::check_dtypes;
using detail::check_features;
using detail::output_sizes;
using detail::present;
using kernels::Epilogue;
using kernels::gemm_epilogue;
using kernels::GemmPath;
using kernels::GemmResult;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Slots of a layer's paths_ tensor.
constexpr int kForwardSlot = 0;
constexpr int kBackwardSlot = 1;
// PathKey tags: which block a measured choice belongs to.
constexpr int64_t kDenseTag = 1;
constexpr int64_t kDenseGeluDenseTag = 2;

at::Tensor new_paths_record() { return at::full({2}, static_cast<int8_t>(GemmPath::kAten), at::kChar); }

void record(const at::Tensor& paths, int slot, GemmPath path) {
  paths.data_ptr<int8_t>()[slot] = static_cast<int8_t>(path);
}

DensePathsTaken read_paths(const at::Tensor& paths) {
  const int8_t* p = paths.data_ptr<int8_t>();
  return {static_cast<GemmPath>(p[kForwardSlot]), static_cast<GemmPath>(p[kBackwardSlot])};
}

// A pass reports cuBLASLt only when every GEMM of it ran there.
struct PathTally {
  bool all_lt = true;
  GemmResult add(GemmResult r) {
    all_lt = all_lt && r.path == GemmPath::kCublasLt;
    return r;
  }
  GemmPath path() const { return all_lt ? GemmPath::kCublasLt : GemmPath::kAten; }
};

// Under autocast (amp O1) a Linear runs in the autocast dtype: cast input and parameters the way autocast would
// (cached_cast reuses one cast of an fp32 leaf weight per autocast region), since a custom autograd function is
// not itself autocast-dispatched.
bool allow_cublaslt(DensePath policy, const c10::Device& device, const kernels::PathKey& key,
                    const std::function<void(GemmPath)>& run) {
  switch (policy) {
    case DensePath::kAten:
      return false;
    case DensePath::kCublasLt:
      return true;
    case DensePath::kAuto:
      break;
  }
  if (!device.is_cuda()) return false;
  return kernels::autotuned_path(key, device, run).path == GemmPath::kCublasLt;
}

// Custom autograd functions cannot take undefined tensors as inputs: a missing bias travels as an empty tensor.

// y = x W^T + b. Saved for backward: x and W.
struct DenseFunction : public torch::autograd::Function<DenseFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias_or_empty, bool allow_lt, const at::Tensor& paths) {
    const at::Tensor bias = present(bias_or_empty);
    const GemmResult r = gemm_epilogue(x, weight.t(), Epilogue::kBias, bias, {}, allow_lt);
    record(paths, kForwardSlot, r.path);
    ctx->save_for_backward({x, weight});
    ctx->saved_data["allow_lt"] = allow_lt;
    ctx->saved_data["has_bias"] = bias.defined();
    ctx->saved_data["paths"] = paths;
    return r.out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const bool allow_lt = ctx->saved_data["allow_lt"].toBool();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const at::Tensor dy = grads[0].contiguous();
    PathTally tally;
    at::Tensor dx, dweight, dbias;
    if (ctx->needs_input_grad(0)) dx = tally.add(gemm_epilogue(dy, weight, Epilogue::kNone, {}, {}, allow_lt)).out;
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) {
      // dW = dy^T x; with a bias, its gradient (dy summed over rows) comes out of the same GEMM (BGRADB).
      const GemmResult r =
          tally.add(gemm_epilogue(dy.t(), x, has_bias ? Epilogue::kBGradB : Epilogue::kNone, {}, {}, allow_lt));
      dweight = r.out;
      dbias = r.bias_grad;
    }
    record(ctx->saved_data["paths"].toTensor(), kBackwardSlot, tally.path());
    return {dx, dweight, dbias, at::Tensor(), at::Tensor()};
  }
};

// The forward of Linear -> GELU -> Linear: h = gelu(pre), pre = x W1^T + b1 (GELU_AUX_BIAS), y = h W2^T + b2.
struct GeluForward {
  GemmResult first;
  GemmResult second;
};
GeluForward gelu_block_forward(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                               const at::Tensor& b2, bool allow_lt) {
  GeluForward f;
  f.first = gemm_epilogue(x, w1.t(), Epilogue::kGeluAuxBias, b1, {}, allow_lt);
  f.second = gemm_epilogue(f.first.out, w2.t(), Epilogue::kBias, b2, {}, allow_lt);
  return f;
}

struct GeluBackward {
  at::Tensor dx, dw1, db1, dw2, db2;
  GemmPath path = GemmPath::kAten;
};
GeluBackward gelu_block_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                                 const at::Tensor& pre, const at::Tensor& h, bool has_bias, bool need_dx,
                                 bool need_first, bool need_second, bool allow_lt) {
  GeluBackward g;
  PathTally tally;
  if (need_second) {
    // dW2 = dy^T h, db2 = dy summed over rows, in one GEMM (BGRADB).
    const GemmResult r =
        tally.add(gemm_epilogue(dy.t(), h, has_bias ? Epilogue::kBGradB : Epilogue::kNone, {}, {}, allow_lt));
    g.dw2 = r.out;
    g.db2 = r.bias_grad;
  }
  if (need_dx || need_first) {
    // dpre = (dy W2) * gelu'(pre), db1 = dpre summed over rows, in one GEMM (DGELU_BGRAD).
    const GemmResult r =
        tally.add(gemm_epilogue(dy, w2, has_bias ? Epilogue::kDGeluBGrad : Epilogue::kDGelu, {}, pre, allow_lt));
    const at::Tensor dpre = r.out;
    g.db1 = r.bias_grad;
    if (need_first) g.dw1 = tally.add(gemm_epilogue(dpre.t(), x, Epilogue::kNone, {}, {}, allow_lt)).out;
    if (need_dx) g.dx = tally.add(gemm_epilogue(dpre, w1, Epilogue::kNone, {}, {}, allow_lt)).out;
  }
  g.path = tally.path();
  return g;
}

struct DenseGeluDenseFunction : public torch::autograd::Function<DenseGeluDenseFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1,
                            const at::Tensor& b1_or_empty, const at::Tensor& w2, const at::Tensor& b2_or_empty,
                            bool allow_lt, const at::Tensor& paths) {
    const at::Tensor b1 = present(b1_or_empty);
    GeluForward f = gelu_block_forward(x, w1, b1, w2, present(b2_or_empty), allow_lt);
    PathTally tally;
    tally.add(f.first);
    tally.add(f.second);
    record(paths, kForwardSlot, tally.path());
    ctx->save_for_backward({x, w1, w2, f.first.pre_activation, f.first.out});
    ctx->saved_data["allow_lt"] = allow_lt;
    ctx->saved_data["has_bias"] = b1.defined();
    ctx->saved_data["paths"] = paths;
    return f.second.out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const GeluBackward g =
        gelu_block_backward(grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4], ctx->saved_data["has_bias"].toBool(),
                            ctx->needs_input_grad(0), ctx->needs_input_grad(1) || ctx->needs_input_grad(2),
                            ctx->needs_input_grad(3) || ctx->needs_input_grad(4), ctx->saved_data["allow_lt"].toBool());
    record(ctx->saved_data["paths"].toTensor(), kBackwardSlot, g.path);
    return {g.dx, g.dw1, g.db1, g.dw2, g.db2, at::Tensor(), at::Tensor()};
  }
};

int64_t dtype_code(const at::Tensor& t) { return static_cast<int64_t>(t.scalar_type()); }

}  // namespace

FusedDenseImpl::FusedDenseImpl(const FusedDenseOptions& options_) : options(options_) {
  TORCH_CHECK(options.in_features() > 0 && options.out_features() > 0,
              "FusedDense: in_features and out_features must be > 0, got ", options.in_features(), " and ",
              options.out_features());
  reset();
}

void FusedDenseImpl::reset() {
  // The same registrations and draws as torch::nn::LinearImpl::reset, so the two are interchangeable.
  detail::register_linear_parameters(*this, options.in_features(), options.out_features(), options.bias(), weight,
                                     bias);
  paths_ = new_paths_record();
}

void FusedDenseImpl::reset_parameters() { detail::reset_linear_parameters(weight, bias); }

void FusedDenseImpl::pretty_print(std::ostream& stream) const {
  stream << "amp::FusedDense(in_features=" << options.in_features() << ", out_features=" << options.out_features()
         << ", bias=" << std::boolalpha << options.bias() << ", path=" << dense_path_name(options.path()) << ")";
}

at::Tensor FusedDenseImpl::forward(const at::Tensor& input) {
  check_features("FusedDense", input, options.in_features());
  const c10::DeviceType device_type = input.device().type();
  const at::Tensor x = autocast_input(input, device_type).reshape({-1, options.in_features()}).contiguous();
  const at::Tensor w = autocast_input(weight, device_type);
  const at::Tensor b = autocast_input(bias, device_type);
  check_dtypes("FusedDense", x, w, "weight");
  const kernels::PathKey key = {kDenseTag,     x.size(0),          options.in_features(), 0, options.out_features(),
                                dtype_code(x), x.device().index(), b.defined() ? 1 : 0};
  const bool allow_lt = allow_cublaslt(options.path(), x.device(), key, [&](GemmPath path) {
    const torch::NoGradGuard no_grad;
    const bool lt = path == GemmPath::kCublasLt;
    const at::Tensor y = gemm_epilogue(x, w.t(), Epilogue::kBias, b, {}, lt).out;
    gemm_epilogue(y, w, Epilogue::kNone, {}, {}, lt);
    gemm_epilogue(y.t(), x, b.defined() ? Epilogue::kBGradB : Epilogue::kNone, {}, {}, lt);
  });
  const at::Tensor y = DenseFunction::apply(x, w, bias_argument(b, x), allow_lt, paths_);
  return y.view(output_sizes(input, options.out_features()));
}

DensePathsTaken FusedDenseImpl::paths_taken() const { return read_paths(paths_); }

FusedDenseGeluDenseImpl::FusedDenseGeluDenseImpl(const FusedDenseGeluDenseOptions& options_) : options(options_) {
  TORCH_CHECK(options.in_features() > 0 && options.hidden_features() > 0 && options.out_features() > 0,
              "FusedDenseGeluDense: in_features, hidden_features and out_features must be > 0, got ",
              options.in_features(), ", ", options.hidden_features(), " and ", options.out_features());
  reset();
}

void FusedDenseGeluDenseImpl::reset() {
  dense1 = register_module("dense1", FusedDense(FusedDenseOptions(options.in_features(), options.hidden_features())
                                                    .bias(options.bias())
                                                    .path(options.path())));
  dense2 = register_module("dense2", FusedDense(FusedDenseOptions(options.hidden_features(), options.out_features())
                                                    .bias(options.bias())
                                                    .path(options.path())));
  paths_ = new_paths_record();
}

void FusedDenseGeluDenseImpl::pretty_print(std::ostream& stream) const {
  stream << "amp::FusedDenseGeluDense(in_features=" << options.in_features()
         << ", hidden_features=" << options.hidden_features() << ", out_features=" << options.out_features()
         << ", bias=" << std::boolalpha << options.bias() << ", path=" << dense_path_name(options.path()) << ")";
}

at::Tensor FusedDenseGeluDenseImpl::forward(const at::Tensor& input) {
  check_features("FusedDenseGeluDense", input, options.in_features());
  const c10::DeviceType device_type = input.device().type();
  const at::Tensor x = autocast_input(input, device_type).reshape({-1, options.in_features()}).contiguous();
  const at::Tensor w1 = autocast_input(dense1->weight, device_type);
  const at::Tensor b1 = autocast_input(dense1->bias, device_type);
  const at::Tensor w2 = autocast_input(dense2->weight, device_type);
  const at::Tensor b2 = autocast_input(dense2->bias, device_type);
  check_dtypes("FusedDenseGeluDense", x, w1, "dense1.weight");
  check_dtypes("FusedDenseGeluDense", x, w2, "dense2.weight");
  const kernels::PathKey key = {kDenseGeluDenseTag,     x.size(0),     options.in_features(), options.hidden_features(),
                                options.out_features(), dtype_code(x), x.device().index(),    b1.defined() ? 1 : 0};
  const bool allow_lt = allow_cublaslt(options.path(), x.device(), key, [&](GemmPath path) {
    const torch::NoGradGuard no_grad;
    const bool lt = path == GemmPath::kCublasLt;
    const GeluForward f = gelu_block_forward(x, w1, b1, w2, b2, lt);
    // The output stands in for the incoming gradient: same shape and dtype, and the timing does not depend on
    // the values.
    gelu_block_backward(f.second.out, x, w1, w2, f.first.pre_activation, f.first.out, b1.defined(), true, true, true,
                        lt);
  });
  const at::Tensor y =
      DenseGeluDenseFunction::apply(x, w1, bias_argument(b1, x), w2, bias_argument(b2, x), allow_lt, paths_);
  return y.view(output_sizes(input, options.out_features()));
}

DensePathsTaken FusedDenseGeluDenseImpl::paths_taken() const { return read_paths(paths_); }

}  // namespace amp
