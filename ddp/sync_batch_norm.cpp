#include <ddp/sync_batch_norm.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <ddp/recompute.h>
#include <kernels/batch_norm.h>

// Note [SyncBatchNorm collectives]
// Training forward, group of size W > 1: every rank computes, per channel, its count n_r (N * prod(spatial)), mean
// m_r and biased variance v_r in fp32 (fp64 for fp64 input) by two passes (mean first, then the mean of squared
// deviations). Why not sum / sum of squares: var = E[x^2] - E[x]^2 cancels catastrophically when |mean| >> std
// (activations after ReLU, or fp16/bf16 inputs whose values were rounded to a coarse grid around a large mean);
// the two-pass form never subtracts two large numbers, and fp16/bf16 values convert to fp32 exactly, so the only
// rounding is fp32 accumulation. On the CPU both passes, the backward's two sums and the two elementwise passes
// (y, dx) are kernels/batch_norm.h's CPU twins (at::vec per instruction set, no temporary copies; sums as
// Note [batch-norm twin sums]). The ranks then allgather ONE flat tensor [n_r, input dims, input channels,
// device kind, m_r (C), v_r (C)] and combine with Chan et al.'s parallel formula, weighted by counts:
//   n = sum n_r,  m = sum n_r m_r / n,  v = sum n_r (v_r + (m_r - m)^2) / n,
// which is exact for any split (a rank with n_r = 0 sends zeros and contributes nothing) and again free of the
// large-number cancellation. Counts travel in fp32: exact up to 2^24 values per channel and rank, beyond that off
// by a relative 6e-8, far below the statistics' own rounding. The header lets every rank validate every rank's
// input and throw the same error, instead of the bad rank throwing before the collective and the others hanging.
// Backward: ONE allreduce (SUM) of [sum dy (C), sum dy * (x - m) (C)] over the group; then
//   dx = (dy - sum_dy / n - (x - m) * invstd^2 * sum_dy_xmu / n) * invstd * weight,
// and weight / bias get this rank's local sums (DDP averages those over ranks, as for any parameter).
// On CUDA the same protocol runs on ATen's kernels: batch_norm_stats (one-pass Welford) for m_r and v_r,
// batch_norm_elemt for y, batch_norm_backward_reduce for the two sums and batch_norm_backward_elemt for dx; the
// combination across ranks stays ours (the header, the validation, Chan's formula). batch_norm_backward_elemt
// takes n as int32 per-rank counts that it sums in int64 (detail::batch_norm_counts): one int32 total would
// throw once the group holds more than 2^31 - 1 values per channel.

namespace ddp {
namespace {

constexpr int64_t kHeaderCount = 0;     // values per channel on this rank (0 when the input is invalid)
constexpr int64_t kHeaderDims = 1;      // input.dim()
constexpr int64_t kHeaderChannels = 2;  // input.size(1), or -1 when the input has fewer than 2 dims
constexpr int64_t kHeaderIsCuda = 3;    // 1 when the input is a CUDA tensor
constexpr int64_t kHeaderSize = 4;

std::string module_name(const SyncBatchNormOptions& options) {
  const auto d = options.dimensionality();
  return c10::str("SyncBatchNorm", d ? c10::str(*d, "d") : std::string(), "(", options.num_features(), ")");
}

std::string expected_shape(const std::optional<int>& dimensionality) {
  if (!dimensionality) return "at least 2 dims (N, C, ...)";
  switch (*dimensionality) {
    case 1:
      return "2 or 3 dims ((N, C) or (N, C, L))";
    case 2:
      return "4 dims (N, C, H, W)";
    default:
      return "5 dims (N, C, D, H, W)";
  }
}

bool dims_ok(int64_t dims, const std::optional<int>& dimensionality) {
  if (!dimensionality) return dims >= 2;
  if (*dimensionality == 1) return dims == 2 || dims == 3;
  return dims == *dimensionality + 2;
}

/// Empty when `dims` / `channels` suit the module; else what is wrong, for an error message.
std::string input_problem(const SyncBatchNormOptions& options, int64_t dims, int64_t channels) {
  if (!dims_ok(dims, options.dimensionality())) {
    return c10::str("a ", dims, "-d input; ", module_name(options), " expects ",
                    expected_shape(options.dimensionality()));
  }
  if (channels != options.num_features()) {
    return c10::str("an input with ", channels, " channels (dim 1); ", module_name(options), " expects ",
                    options.num_features());
  }
  return "";
}

void check_input_locally(const SyncBatchNormOptions& options, const at::Tensor& input) {
  const std::string problem = input_problem(options, input.dim(), input.dim() >= 2 ? input.size(1) : -1);
  TORCH_CHECK(problem.empty(), module_name(options), ": got ", problem, " (input shape ", input.sizes(), ")");
}

/// The dtype statistics are computed in: fp64 for fp64 input, else fp32 (fp16 / bf16 inputs included).
c10::ScalarType accumulate_dtype(const at::Tensor& input) {
  return input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

/// `t` in `dtype` (undefined stays undefined).
at::Tensor as_dtype(const at::Tensor& t, c10::ScalarType dtype) { return t.defined() ? t.to(dtype) : t; }

// The group travels into backward inside the autograd context as capsules (Store and Backend are custom classes).
void save_group(torch::autograd::AutogradContext* ctx, const ProcessGroup& group) {
  ctx->saved_data["store"] = c10::IValue::make_capsule(group.store());
  ctx->saved_data["backend"] = c10::IValue::make_capsule(group.backend());
  ctx->saved_data["backend_name"] = group.backend_name();
  ctx->saved_data["timeout_ms"] = static_cast<int64_t>(group.timeout().count());
  ctx->saved_data["device"] = group.device();
}

ProcessGroup load_group(torch::autograd::AutogradContext* ctx) {
  return ProcessGroup(c10::static_intrusive_pointer_cast<c10d::Store>(ctx->saved_data["store"].toCapsule()),
                      c10::static_intrusive_pointer_cast<c10d::Backend>(ctx->saved_data["backend"].toCapsule()),
                      ctx->saved_data["backend_name"].toStringRef(),
                      std::chrono::milliseconds(ctx->saved_data["timeout_ms"].toInt()),
                      ctx->saved_data["device"].toDevice());
}

/// y = (x - mean) * invstd * weight + bias with globally reduced statistics; backward reduces over the group.
class SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
 public:
  // weight / bias come as optionals: autograd takes an undefined Tensor argument for a variable and fails.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const std::optional<at::Tensor>& weight_arg, const std::optional<at::Tensor>& bias_arg,
                            const at::Tensor& mean, const at::Tensor& invstd, double total_count,
                            const std::vector<int64_t>& rank_counts, const ProcessGroup* group) {
    const at::Tensor weight = weight_arg.value_or(at::Tensor());
    const at::Tensor bias = bias_arg.value_or(at::Tensor());
    const auto acc = mean.scalar_type();
    ctx->save_for_backward({input, weight, mean, invstd});
    ctx->saved_data["total_count"] = total_count;
    ctx->saved_data["rank_counts"] = rank_counts;
    ctx->saved_data["has_bias"] = bias.defined();
    save_group(ctx, *group);
    if (input.is_cuda()) {
      // ATen's kernel (half input with fp32 statistics and parameters is its mixed-type case).
      if (input.numel() == 0) return at::empty_like(input);
      return at::batch_norm_elemt(input, as_dtype(weight, acc), as_dtype(bias, acc), mean, invstd, /*eps=*/0.0);
    }
    at::Tensor scale = invstd;
    if (weight.defined()) scale = scale * weight.to(acc);
    return kernels::batch_norm_normalize_cpu(input, mean, scale, as_dtype(bias, acc));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& mean = saved[2];
    const at::Tensor& invstd = saved[3];
    const auto acc = mean.scalar_type();
    const int64_t channels = mean.size(0);

    const bool want_weight = weight.defined() && ctx->needs_input_grad(1);
    const bool want_bias = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
    const double n = ctx->saved_data["total_count"].toDouble();

    if (input.is_cuda()) {
      // ATen's kernels: the two per-channel sums (and the local weight / bias gradients) in one pass, then the
      // input gradient from the group's sums.
      const at::Tensor weight_acc = as_dtype(weight, acc);
      at::Tensor sum_dy = at::zeros_like(mean);  // an empty batch contributes zeros (as PyTorch's SyncBatchNorm)
      at::Tensor sum_dy_xmu = at::zeros_like(mean);
      at::Tensor grad_weight = want_weight ? at::zeros_like(weight) : at::Tensor();
      at::Tensor grad_bias = want_bias ? at::zeros_like(weight) : at::Tensor();
      if (input.numel() > 0) {
        std::tie(sum_dy, sum_dy_xmu, grad_weight, grad_bias) = at::batch_norm_backward_reduce(
            grad_outputs[0], input, mean, invstd, weight_acc, ctx->needs_input_grad(0), want_weight, want_bias);
        if (grad_weight.defined()) grad_weight = grad_weight.to(weight.scalar_type());
        if (grad_bias.defined()) grad_bias = grad_bias.to(weight.scalar_type());
      }
      at::Tensor grad_input;
      if (ctx->needs_input_grad(0)) {
        const ProcessGroup group = load_group(ctx);  // all ranks or none take part (see below)
        at::Tensor combined = at::cat({sum_dy, sum_dy_xmu});
        group.wait(group.allreduce_sum_async(combined), "SyncBatchNorm backward allreduce");
        // Built from host values and copied without a host sync (pinned, non-blocking).
        const at::Tensor count = detail::batch_norm_counts(ctx->saved_data["rank_counts"].toIntVector())
                                     .pin_memory()
                                     .to(input.device(), /*non_blocking=*/true);
        grad_input = input.numel() == 0 ? at::zeros_like(input)
                                        : at::batch_norm_backward_elemt(grad_outputs[0], input, mean, invstd,
                                                                        weight_acc, combined.narrow(0, 0, channels),
                                                                        combined.narrow(0, channels, channels), count);
      }
      return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }

    const auto [sum_dy_fp64, sum_dy_xmu_fp64] = kernels::batch_norm_grad_sums_cpu(grad_outputs[0], input, mean);
    const at::Tensor sum_dy = sum_dy_fp64.to(acc);
    const at::Tensor sum_dy_xmu = sum_dy_xmu_fp64.to(acc);

    at::Tensor grad_weight;
    at::Tensor grad_bias;
    if (want_weight) grad_weight = (sum_dy_xmu * invstd).to(weight.scalar_type());
    if (want_bias) grad_bias = sum_dy.to(weight.scalar_type());

    at::Tensor grad_input;
    if (ctx->needs_input_grad(0)) {
      // Every rank of the group runs this backward with the same needs_input_grad (same model), so all or none
      // take part in the allreduce.
      const ProcessGroup group = load_group(ctx);
      at::Tensor combined = at::cat({sum_dy, sum_dy_xmu});
      group.wait(group.allreduce_sum_async(combined), "SyncBatchNorm backward allreduce");
      const at::Tensor mean_dy = combined.narrow(0, 0, channels) / n;
      const at::Tensor mean_dy_xmu = combined.narrow(0, channels, channels) / n;
      at::Tensor scale = invstd;
      if (weight.defined()) scale = scale * weight.to(acc);
      grad_input = kernels::batch_norm_input_grad_cpu(grad_outputs[0], input, mean, mean_dy,
                                                      invstd * invstd * mean_dy_xmu, scale);
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

SyncBatchNormOptions::SyncBatchNormOptions(int64_t num_features) : num_features_(num_features) {}

SyncBatchNormImpl::SyncBatchNormImpl(const SyncBatchNormOptions& options_) : options(options_) {
  TORCH_CHECK(options.num_features() > 0, "SyncBatchNorm: num_features must be > 0, got ", options.num_features());
  TORCH_CHECK(options.eps() >= 0, "SyncBatchNorm: eps must be >= 0, got ", options.eps());
  TORCH_CHECK(!options.momentum() || (*options.momentum() >= 0 && *options.momentum() <= 1),
              "SyncBatchNorm: momentum must lie in [0, 1], got ", options.momentum().value_or(0));
  TORCH_CHECK(!options.dimensionality() || (*options.dimensionality() >= 1 && *options.dimensionality() <= 3),
              "SyncBatchNorm: dimensionality must be 1, 2 or 3, got ", options.dimensionality().value_or(0));
  reset();
}

void SyncBatchNormImpl::reset() {
  const int64_t c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", at::empty({c}));
    bias = register_parameter("bias", at::empty({c}));
  } else {
    weight = register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", at::zeros({c}));
    running_var = register_buffer("running_var", at::ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", at::zeros({}, at::kLong));
  } else {
    running_mean = register_buffer("running_mean", at::Tensor());
    running_var = register_buffer("running_var", at::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", at::Tensor());
  }
  reset_parameters();
}

void SyncBatchNormImpl::reset_running_stats() {
  if (!options.track_running_stats()) return;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (!options.affine()) return;
  torch::NoGradGuard no_grad;
  weight.fill_(1);
  bias.zero_();
}

void SyncBatchNormImpl::set_process_group(std::optional<ProcessGroup> process_group) {
  options.process_group(std::move(process_group));
  peers_checked_ = false;
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "ddp::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << std::boolalpha << options.affine()
         << ", track_running_stats=" << options.track_running_stats()
         << ", world_size=" << (options.process_group() ? options.process_group()->size() : 0) << ")";
}

void SyncBatchNormImpl::check_peers_once() {
  if (peers_checked_) return;
  const ProcessGroup& group = *options.process_group();
  // Fixed size on every rank, so that it cannot hang even when the modules differ (the step's payload is 2C + 4).
  const at::Tensor mine =
      at::tensor({options.num_features(), static_cast<int64_t>(options.dimensionality().value_or(0))},
                 at::TensorOptions().dtype(at::kLong).device(group.device()));
  const auto all = group.allgather(mine);
  for (size_t r = 0; r < all.size(); ++r) {
    const at::Tensor theirs = all[r].cpu();
    const int64_t c = theirs[0].item<int64_t>();
    const int64_t d = theirs[1].item<int64_t>();
    TORCH_CHECK(c == options.num_features() && d == options.dimensionality().value_or(0), module_name(options),
                " on rank ", group.rank(), ": rank ", r, "'s SyncBatchNorm at the same position has num_features ", c,
                " and dimensionality ", d, " (0: any), this rank's has ", options.num_features(), " and ",
                options.dimensionality().value_or(0), "; every rank must build the same model");
  }
  peers_checked_ = true;
}

at::Tensor SyncBatchNormImpl::forward(const at::Tensor& input) {
  const bool use_batch_stats = is_training() || !options.track_running_stats();
  // A checkpointed block's forward runs again in backward (ddp/recompute.h): this batch went into the running
  // statistics the first time. The collectives run again, on every rank alike.
  const bool update_running = is_training() && options.track_running_stats() && !in_recompute();
  double factor = options.momentum().value_or(0.0);
  const auto update_count = [&] {
    if (!update_running) return;
    torch::NoGradGuard no_grad;
    num_batches_tracked.add_(1);
    // Cumulative average, as torch::nn::BatchNorm (which reads the count the same way).
    if (!options.momentum()) factor = 1.0 / num_batches_tracked.item<double>();
  };

  const bool sync = is_training() && options.process_group() && options.process_group()->size() > 1;
  TORCH_CHECK(!is_training() || options.process_group(), module_name(options),
              ": a training forward needs a process group: set SyncBatchNormOptions::process_group, pass one to "
              "convert_sync_batch_norm, or call set_sync_batch_norm_process_group (eval mode needs none)");
  if (!sync) {
    // Eval mode, world size 1, or local batch statistics in eval mode without running stats (no collective, as
    // PyTorch): exactly torch::nn::BatchNorm's computation, in the parameters' dtype.
    check_input_locally(options, input);
    update_count();
    const at::Tensor& typed = weight.defined() ? weight : running_mean;
    const auto compute = typed.defined() ? typed.scalar_type() : accumulate_dtype(input);
    // Training with running statistics that must stay as they are: batch statistics, no running ones to update.
    const bool leave_running = is_training() && !update_running;
    const at::Tensor out = at::batch_norm(input.to(compute), weight, bias, leave_running ? at::Tensor() : running_mean,
                                          leave_running ? at::Tensor() : running_var, use_batch_stats, factor,
                                          options.eps(), at::globalContext().userEnabledCuDNN());
    return out.to(input.scalar_type());
  }

  check_peers_once();
  const ProcessGroup& group = *options.process_group();
  const int64_t c = options.num_features();
  const auto acc = accumulate_dtype(input);
  const int64_t in_channels = input.dim() >= 2 ? input.size(1) : -1;
  const std::string my_problem = input_problem(options, input.dim(), in_channels);

  // The payload (see Note [SyncBatchNorm collectives]).
  at::Tensor payload = at::zeros({kHeaderSize + 2 * c}, at::TensorOptions().dtype(acc).device(input.device()));
  const int64_t count = my_problem.empty() ? input.numel() / c : 0;
  {
    torch::NoGradGuard no_grad;
    payload[kHeaderCount].fill_(static_cast<double>(count));
    payload[kHeaderDims].fill_(static_cast<double>(input.dim()));
    payload[kHeaderChannels].fill_(static_cast<double>(in_channels));
    payload[kHeaderIsCuda].fill_(input.is_cuda() ? 1.0 : 0.0);
    if (count > 0 && input.is_cuda()) {
      // ATen's one-pass (Welford) kernel, fp32 statistics for half input. It returns 1 / sqrt(var + eps): the
      // biased variance comes back as invstd^-2 - eps (a relative error of a few fp32 ulps of var + eps).
      const auto [local_mean, local_invstd] = at::batch_norm_stats(input.detach(), options.eps());
      payload.narrow(0, kHeaderSize, c).copy_(local_mean);
      payload.narrow(0, kHeaderSize + c, c).copy_((local_invstd.reciprocal().square() - options.eps()).clamp_min(0));
    } else if (count > 0) {
      const auto [local_mean, local_var] = kernels::batch_norm_stats_cpu(input.detach());
      payload.narrow(0, kHeaderSize, c).copy_(local_mean);
      payload.narrow(0, kHeaderSize + c, c).copy_(local_var);
    }
  }
  const at::Tensor gathered = at::stack(group.allgather(payload));  // (W, 4 + 2C)

  // Validate every rank's input on every rank, so that all ranks throw alike.
  const at::Tensor header = gathered.narrow(1, 0, kHeaderSize).to(at::kCPU, at::kDouble);
  const auto h = header.accessor<double, 2>();
  double total = 0;
  std::vector<int64_t> rank_counts;
  for (int64_t r = 0; r < header.size(0); ++r) {
    const auto dims = static_cast<int64_t>(h[r][kHeaderDims]);
    const auto channels = static_cast<int64_t>(h[r][kHeaderChannels]);
    const std::string problem = input_problem(options, dims, channels);
    TORCH_CHECK(problem.empty(), module_name(options), " on rank ", group.rank(), " of ", group.size(), ": rank ", r,
                " got ", problem, r == group.rank() ? c10::str(" (input shape ", input.sizes(), ")") : std::string());
    TORCH_CHECK(h[r][kHeaderIsCuda] == h[group.rank()][kHeaderIsCuda], module_name(options), " on rank ", group.rank(),
                ": rank ", r, "'s input is on ", h[r][kHeaderIsCuda] != 0 ? "CUDA" : "the CPU", ", this rank's on ",
                input.is_cuda() ? "CUDA" : "the CPU", "; all ranks must use the same kind");
    total += h[r][kHeaderCount];
    rank_counts.push_back(static_cast<int64_t>(h[r][kHeaderCount]));
  }
  TORCH_CHECK(total > 1, module_name(options), " on rank ", group.rank(),
              ": expected more than 1 value per channel over the group's ", group.size(), " ranks when training, got ",
              total, " (input shape on this rank ", input.sizes(), ")");

  at::Tensor mean;
  at::Tensor var;
  {
    torch::NoGradGuard no_grad;
    const at::Tensor counts = gathered.narrow(1, kHeaderCount, 1);  // (W, 1)
    const at::Tensor means = gathered.narrow(1, kHeaderSize, c);
    const at::Tensor vars = gathered.narrow(1, kHeaderSize + c, c);
    mean = (counts * means).sum(0) / total;
    var = (counts * (vars + (means - mean).square())).sum(0) / total;
    update_count();
    if (update_running) {
      running_mean.copy_(running_mean.to(acc) * (1 - factor) + mean * factor);
      running_var.copy_(running_var.to(acc) * (1 - factor) + var * (total / (total - 1)) * factor);
    }
  }
  const at::Tensor invstd = (var + options.eps()).rsqrt();
  const auto optional = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  return SyncBatchNormFunction::apply(input, optional(weight), optional(bias), mean, invstd, total, rank_counts,
                                      &group);
}

namespace {

/// A SyncBatchNorm equivalent to `module` when it is a BatchNorm1d/2d/3d, else nullptr.
std::shared_ptr<SyncBatchNormImpl> sync_batch_norm_like(const torch::nn::Module& module,
                                                        const std::optional<ProcessGroup>& process_group) {
  const torch::nn::BatchNormOptions* bn_options = nullptr;
  int dimensionality = 0;
  const torch::nn::Module* bn = nullptr;
  if (const auto* m = module.as<torch::nn::BatchNorm1d>()) {
    bn_options = &m->options, dimensionality = 1, bn = m;
  } else if (const auto* m2 = module.as<torch::nn::BatchNorm2d>()) {
    bn_options = &m2->options, dimensionality = 2, bn = m2;
  } else if (const auto* m3 = module.as<torch::nn::BatchNorm3d>()) {
    bn_options = &m3->options, dimensionality = 3, bn = m3;
  }
  if (bn == nullptr) return nullptr;
  auto sync = std::make_shared<SyncBatchNormImpl>(SyncBatchNormOptions(bn_options->num_features())
                                                      .eps(bn_options->eps())
                                                      .momentum(bn_options->momentum())
                                                      .affine(bn_options->affine())
                                                      .track_running_stats(bn_options->track_running_stats())
                                                      .dimensionality(dimensionality)
                                                      .process_group(process_group));
  torch::NoGradGuard no_grad;
  const auto copy_into = [](at::Tensor& target, const at::Tensor& source) {
    if (!source.defined()) return;
    const bool requires_grad = source.requires_grad();
    target.set_data(source.detach().clone());
    if (target.is_leaf()) target.requires_grad_(requires_grad);
  };
  const auto params = bn->named_parameters(/*recurse=*/false);
  const auto buffers = bn->named_buffers(/*recurse=*/false);
  const auto source = [&](const torch::OrderedDict<std::string, at::Tensor>& dict, const char* name) {
    const at::Tensor* t = dict.find(name);
    return t != nullptr ? *t : at::Tensor();
  };
  copy_into(sync->weight, source(params, "weight"));
  copy_into(sync->bias, source(params, "bias"));
  copy_into(sync->running_mean, source(buffers, "running_mean"));
  copy_into(sync->running_var, source(buffers, "running_var"));
  copy_into(sync->num_batches_tracked, source(buffers, "num_batches_tracked"));
  sync->train(bn->is_training());
  return sync;
}

/// Points `parent`'s child `name` (and, in a container, the element holding `old_child`) at `new_child`.
void replace_child(torch::nn::Module& parent, const std::string& name,
                   const std::shared_ptr<torch::nn::Module>& old_child,
                   const std::shared_ptr<SyncBatchNormImpl>& new_child) {
  if (auto* sequential = parent.as<torch::nn::Sequential>()) {
    for (auto& element : *sequential) {
      if (element.ptr() == old_child) element = torch::nn::AnyModule(new_child);
    }
  } else if (auto* list = parent.as<torch::nn::ModuleList>()) {
    for (auto& element : *list) {
      if (element == old_child) element = new_child;
    }
  } else if (auto* dict = parent.as<torch::nn::ModuleDict>()) {
    dict->update(std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{{name, new_child}});
    return;  // update() re-registered it
  }
  parent.replace_module(name, std::static_pointer_cast<torch::nn::Module>(new_child));
}

std::shared_ptr<torch::nn::Module> convert(const std::shared_ptr<torch::nn::Module>& module, const std::string& path,
                                           const std::optional<ProcessGroup>& process_group,
                                           std::vector<std::string>& replaced, std::vector<std::string>& still_held) {
  if (auto sync = sync_batch_norm_like(*module, process_group)) {
    replaced.push_back(path.empty() ? "(root)" : path);
    return sync;
  }
  for (const auto& item : module->named_children()) {  // a copy: replacing does not disturb the walk
    const std::string child_path = path.empty() ? item.key() : path + "." + item.key();
    auto converted = convert(item.value(), child_path, process_group, replaced, still_held);
    if (converted != item.value()) {
      replace_child(*module, item.key(), item.value(), std::static_pointer_cast<SyncBatchNormImpl>(converted));
      // Only this walk's copy of the registry should still own the old module; another owner is most likely a
      // member holder that the parent's forward calls (see the header's limitation).
      if (item.value().use_count() > 1) still_held.push_back(child_path);
    }
  }
  return module;
}

}  // namespace

std::shared_ptr<torch::nn::Module> convert_sync_batch_norm(std::shared_ptr<torch::nn::Module> module,
                                                           std::optional<ProcessGroup> process_group,
                                                           const SyncBatchNormLogger& log) {
  TORCH_CHECK(module != nullptr, "convert_sync_batch_norm: the module is null");
  std::vector<std::string> replaced;
  std::vector<std::string> still_held;
  auto root = convert(module, "", process_group, replaced, still_held);
  std::string line;
  if (replaced.empty()) {
    line = "convert_sync_batch_norm: the model has no BatchNorm1d/2d/3d; returned unchanged";
  } else {
    line = c10::str("convert_sync_batch_norm: replaced ", replaced.size(), " BatchNorm module(s) with SyncBatchNorm:");
    for (const auto& name : replaced) line += " " + name;
    if (!still_held.empty()) {
      line += c10::str("; WARNING: ", still_held.size(),
                       " replaced BatchNorm(s) are still referenced elsewhere, most likely by a member holder that a "
                       "forward() calls directly, which would keep running plain BatchNorm:");
      for (const auto& name : still_held) line += " " + name;
    }
  }
  if (log) {
    log(line);
  } else {
    std::cerr << line << std::endl;
  }
  return root;
}

namespace detail {

at::Tensor batch_norm_counts(const std::vector<int64_t>& rank_counts) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  std::vector<int32_t> entries;
  for (const int64_t count : rank_counts) {
    TORCH_CHECK(count >= 0, "SyncBatchNorm: a rank's count of values per channel must be >= 0, got ", count);
    int64_t left = count;
    do {
      const int64_t piece = std::min(left, kInt32Max);
      entries.push_back(static_cast<int32_t>(piece));
      left -= piece;
    } while (left > 0);
  }
  return at::tensor(entries, at::kInt);
}

}  // namespace detail

int64_t set_sync_batch_norm_process_group(torch::nn::Module& module, const std::optional<ProcessGroup>& process_group) {
  int64_t n = 0;
  if (auto* self = module.as<SyncBatchNormImpl>()) {
    self->set_process_group(process_group);
    ++n;
  }
  for (const auto& child : module.modules(/*include_self=*/false)) {
    if (auto* sync = child->as<SyncBatchNormImpl>()) {
      sync->set_process_group(process_group);
      ++n;
    }
  }
  return n;
}

}  // namespace ddp
