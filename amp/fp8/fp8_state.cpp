#include <amp/fp8/fp8_state.h>

#include <limits>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/linear.h>

#include <amp/nn/float8_linear.h>
#include <ddp/process_group.h>
#include <kernels/gemm/fp8.h>

namespace amp::detail {
namespace {

constexpr const char* kHistoryKey = "fp8_amax_history";
constexpr const char* kScaleKey = "fp8_scale";
constexpr const char* kScaleInvKey = "fp8_scale_inv";

}  // namespace

Fp8State::Fp8State(torch::nn::Module& module, const Fp8Recipe& recipe, const c10::Device& device) : recipe_(recipe) {
  recipe_.check();
  std::vector<std::pair<std::string, Float8LinearImpl*>> eligible;
  int64_t float8_layers = 0;
  for (const auto& item : module.named_modules()) {
    const std::string name = item.key().empty() ? "<the model itself>" : item.key();
    if (auto* layer = dynamic_cast<Float8LinearImpl*>(item.value().get())) {
      ++float8_layers;
      const std::string why = layer->fp8_ineligibility(device);
      if (why.empty()) {
        eligible.emplace_back(name, layer);
      } else {
        report_.push_back("amp: fp8: '" + name + "' stays in " + "its amp precision: " + why);
      }
    } else if (dynamic_cast<torch::nn::LinearImpl*>(item.value().get()) != nullptr) {
      report_.push_back("amp: fp8: '" + name +
                        "' is a torch::nn::Linear and stays in its amp precision: declare it as amp::Float8Linear "
                        "(same parameters, initialization and checkpoints) to run it in FP8");
    }
  }
  const auto n = static_cast<int64_t>(eligible.size()) * kFp8TensorsPerLayer;
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  history_ = at::zeros({n, recipe_.amax_history_len()}, f32);
  scale_ = at::ones({n}, f32);
  scale_inv_ = at::ones({n}, f32);
  fp8_max_ = fp8_max_per_row(recipe_, static_cast<int64_t>(eligible.size()), device);
  for (size_t i = 0; i < eligible.size(); ++i) {
    const auto first = static_cast<int64_t>(i) * kFp8TensorsPerLayer;
    Fp8Meta meta;
    meta.recipe = recipe_;
    meta.history = history_.narrow(0, first, kFp8TensorsPerLayer);
    meta.scale = scale_.narrow(0, first, kFp8TensorsPerLayer);
    meta.scale_inv = scale_inv_.narrow(0, first, kFp8TensorsPerLayer);
    eligible[i].second->enable_fp8(std::move(meta));
  }
  std::ostringstream summary;
  summary << "amp: fp8: " << eligible.size() << " of " << float8_layers << " Float8Linear layers run in FP8 ("
          << recipe_.to_string() << ")";
  if (eligible.empty()) summary << "; nothing runs in FP8: declare the model's Linear layers as amp::Float8Linear";
  report_.push_back(summary.str());
}

void Fp8State::reduce_and_check(const at::Tensor& found_inf, bool reduce_flag) {
  const int64_t n = history_.size(0);
  const bool collective = group_ != nullptr && group_->size() > 1;
  reduced_ = true;
  if (n == 0 && !(reduce_flag && collective)) return;
  at::Tensor amax = history_.select(1, 0);
  // Non-finite amaxes become +inf before the reduction: a max over NaN depends on the operand order (Gloo's and
  // NCCL's), +inf wins everywhere.
  at::Tensor reduced = at::where(at::isfinite(amax), amax, std::numeric_limits<float>::infinity());
  if (collective) {
    // ZeRO's overflow flag (each rank checked its own shard) rides along: MAX of 0/1 flags is their OR.
    at::Tensor buffer = reduce_flag ? at::cat({reduced, found_inf.reshape({1}).to(reduced.dtype())}) : reduced;
    buffer = buffer.to(group_->device()).contiguous();
    group_->allreduce_max_(
        buffer, reduce_flag ? "amp: the FP8 amax and ZeRO overflow flag reduction" : "amp: the FP8 amax reduction");
    buffer = buffer.to(amax.device());
    reduced = buffer.narrow(0, 0, n);
    if (reduce_flag) found_inf.copy_(buffer.narrow(0, n, 1));
  }
  if (n == 0) return;
  amax.copy_(reduced);
  const at::Tensor bad = at::isinf(reduced).any().to(at::kFloat);
  found_inf.copy_(at::maximum(found_inf, bad));
}

void Fp8State::update(const at::Tensor& found_inf) {
  reduced_ = false;
  if (history_.size(0) == 0) return;
  kernels::fp8_update_scales_(history_, scale_, scale_inv_, fp8_max_, found_inf, recipe_.margin(),
                              recipe_.amax_compute() == Fp8AmaxCompute::kMax);
}

void Fp8State::save(torch::serialize::OutputArchive& archive) const {
  archive.write(kHistoryKey, history_.cpu());
  archive.write(kScaleKey, scale_.cpu());
  archive.write(kScaleInvKey, scale_inv_.cpu());
}

void Fp8State::validate(torch::serialize::InputArchive& archive) const {
  for (const auto& [key, mine] : {std::pair<const char*, const at::Tensor*>(kHistoryKey, &history_),
                                  std::pair<const char*, const at::Tensor*>(kScaleKey, &scale_),
                                  std::pair<const char*, const at::Tensor*>(kScaleInvKey, &scale_inv_)}) {
    at::Tensor value;
    TORCH_CHECK(archive.try_read(key, value), "amp checkpoint has no '", key,
                "': it was saved without FP8 (Options::fp8) or by an older version");
    TORCH_CHECK(value.sizes() == mine->sizes() && value.scalar_type() == at::kFloat, "amp checkpoint has '", key,
                "' of shape ", value.sizes(), " (", value.scalar_type(), ") but this model's FP8 state is ",
                mine->sizes(), " (Float): the model has a different number of FP8 layers");
  }
}

void Fp8State::load(torch::serialize::InputArchive& archive) {
  validate(archive);
  at::Tensor history, scale, scale_inv;
  archive.try_read(kHistoryKey, history);
  archive.try_read(kScaleKey, scale);
  archive.try_read(kScaleInvKey, scale_inv);
  history_.copy_(history);
  scale_.copy_(scale);
  scale_inv_.copy_(scale_inv);
}

}  // namespace amp::detail
