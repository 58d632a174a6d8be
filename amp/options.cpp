#include <amp/options.h>

#include <cmath>
#include <sstream>

#include <c10/util/Exception.h>

namespace amp {

OptLevel parse_opt_level(const std::string& text) {
  for (OptLevel level : {OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3}) {
    const std::string name = opt_level_name(level);
    if (text == name || (text.size() == 2 && (text[0] == 'o') && text[1] == name[1])) return level;
  }
  TORCH_CHECK(false, "unknown opt level '", text, "': expected O0, O1, O2 or O3");
}

const char* opt_level_name(OptLevel level) {
  switch (level) {
    case OptLevel::O0:
      return "O0";
    case OptLevel::O1:
      return "O1";
    case OptLevel::O2:
      return "O2";
    case OptLevel::O3:
      return "O3";
  }
  return "?";
}

namespace {

bool is_half(c10::ScalarType t) { return t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16; }

}  // namespace

Options::Resolved Options::resolve() const {
  TORCH_CHECK(is_half(half_dtype_), "half_dtype must be Half or BFloat16, got ", half_dtype_);
  Resolved r{};
  r.opt_level = opt_level_;
  r.half_dtype = half_dtype_;
  // The level's table (Apex semantics; REFERENCE.md §2).
  const bool half_model = opt_level_ == OptLevel::O2 || opt_level_ == OptLevel::O3;
  r.cast_model_type = half_model ? half_dtype_ : c10::ScalarType::Float;
  r.autocast = opt_level_ == OptLevel::O1;
  r.keep_batchnorm_fp32 = opt_level_ == OptLevel::O2;
  r.master_weights = opt_level_ == OptLevel::O2;
  r.dynamic_loss_scale = opt_level_ == OptLevel::O1 || opt_level_ == OptLevel::O2;
  // bf16 has fp32's range: no scaling needed, only the overflow check and skip (scale fixed at 1).
  if (half_dtype_ == c10::ScalarType::BFloat16) r.dynamic_loss_scale = false;
  r.static_loss_scale = 1.0;

  // Overrides.
  if (cast_model_type_) {
    TORCH_CHECK(*cast_model_type_ == c10::ScalarType::Float || *cast_model_type_ == half_dtype_, "cast_model_type ",
                *cast_model_type_, " disagrees with half_dtype ", half_dtype_, ": cast to Float or to the half dtype");
    r.cast_model_type = *cast_model_type_;
  }
  const bool model_cast = r.cast_model_type != c10::ScalarType::Float;
  if (keep_batchnorm_fp32_) {
    TORCH_CHECK(model_cast || !*keep_batchnorm_fp32_, "keep_batchnorm_fp32=true disagrees with cast_model_type ",
                r.cast_model_type, ": batch norm can only be kept fp32 when the model is cast to half");
    r.keep_batchnorm_fp32 = *keep_batchnorm_fp32_;
  }
  TORCH_CHECK(model_cast || !keep_layernorm_fp32_, "keep_layernorm_fp32=true disagrees with cast_model_type ",
              r.cast_model_type, ": layer norm can only be kept fp32 when the model is cast to half");
  r.keep_layernorm_fp32 = keep_layernorm_fp32_;
  if (master_weights_) {
    TORCH_CHECK(model_cast || !*master_weights_, "master_weights=true disagrees with cast_model_type ",
                r.cast_model_type, ": fp32 master weights need a model cast to half");
    r.master_weights = *master_weights_;
  }
  if (dynamic_) r.dynamic_loss_scale = *dynamic_;
  if (static_loss_scale_) {
    TORCH_CHECK(std::isfinite(*static_loss_scale_) && *static_loss_scale_ > 0.0,
                "loss_scale must be finite and > 0, got ", *static_loss_scale_);
    r.static_loss_scale = *static_loss_scale_;
  }

  // Loss-scaler settings: defaults, then the values given, refused when they cannot apply.
  using D = LossScaleDefaults;
  r.init_scale = init_scale_.value_or(D::kInitScale);
  r.growth_factor = growth_factor_.value_or(D::kGrowthFactor);
  r.backoff_factor = backoff_factor_.value_or(D::kBackoffFactor);
  r.growth_interval = growth_interval_.value_or(D::kGrowthInterval);
  r.hysteresis = hysteresis_.value_or(D::kHysteresis);
  r.min_loss_scale = min_loss_scale_.value_or(D::kMinScale);
  r.max_loss_scale = max_loss_scale_.value_or(D::kMaxScale);
  if (!r.dynamic_loss_scale) {
    const char* given = init_scale_        ? "init_scale"
                        : growth_factor_   ? "growth_factor"
                        : backoff_factor_  ? "backoff_factor"
                        : growth_interval_ ? "growth_interval"
                        : hysteresis_      ? "hysteresis"
                        : min_loss_scale_  ? "min_loss_scale"
                        : max_loss_scale_  ? "max_loss_scale"
                                           : nullptr;
    TORCH_CHECK(given == nullptr, given, " applies to dynamic loss scaling, but the loss scale is static (",
                r.static_loss_scale, ") for ", opt_level_name(opt_level_), " with ", half_dtype_,
                "; call dynamic_loss_scale() to use it");
  }
  TORCH_CHECK(std::isfinite(r.min_loss_scale) && r.min_loss_scale > 0.0, "min_loss_scale must be finite and > 0, got ",
              r.min_loss_scale);
  TORCH_CHECK(r.max_loss_scale >= r.min_loss_scale, "max_loss_scale ", r.max_loss_scale,
              " disagrees with min_loss_scale ", r.min_loss_scale, ": the ceiling must be >= the floor");
  TORCH_CHECK(r.init_scale >= r.min_loss_scale && r.init_scale <= r.max_loss_scale, "init_scale ", r.init_scale,
              " is outside [min_loss_scale, max_loss_scale] = [", r.min_loss_scale, ", ", r.max_loss_scale, "]");
  TORCH_CHECK(r.growth_factor > 1.0 && std::isfinite(r.growth_factor), "growth_factor must be finite and > 1, got ",
              r.growth_factor);
  TORCH_CHECK(r.backoff_factor > 0.0 && r.backoff_factor < 1.0, "backoff_factor must be in (0, 1), got ",
              r.backoff_factor);
  TORCH_CHECK(r.growth_interval >= 1, "growth_interval must be >= 1 steps, got ", r.growth_interval);
  TORCH_CHECK(r.hysteresis >= 1, "hysteresis must be >= 1, got ", r.hysteresis);
  TORCH_CHECK(num_losses_ >= 1, "num_losses must be >= 1, got ", num_losses_);
  TORCH_CHECK(max_overflows_at_floor_ >= 0, "max_overflows_at_floor must be >= 0, got ", max_overflows_at_floor_);
  r.num_losses = num_losses_;
  r.max_overflows_at_floor = max_overflows_at_floor_;
  if (fp8_) {
    fp8_->check();
    TORCH_CHECK(opt_level_ == OptLevel::O1 || opt_level_ == OptLevel::O2, "fp8() needs opt level O1 or O2, got ",
                opt_level_name(opt_level_), ": FP8 GEMMs sit on top of a bf16/fp16 model with fp32 master weights");
    r.fp8 = fp8_;
  }
  return r;
}

std::string Options::to_string() const {
  const Resolved r = resolve();
  std::ostringstream out;
  out << "opt_level=" << opt_level_name(r.opt_level) << " half_dtype=" << r.half_dtype
      << " cast_model_type=" << r.cast_model_type << " autocast=" << r.autocast
      << " keep_batchnorm_fp32=" << r.keep_batchnorm_fp32 << " keep_layernorm_fp32=" << r.keep_layernorm_fp32
      << " master_weights=" << r.master_weights << " dynamic_loss_scale=" << r.dynamic_loss_scale;
  if (r.dynamic_loss_scale) {
    out << " init_scale=" << r.init_scale << " growth_factor=" << r.growth_factor
        << " backoff_factor=" << r.backoff_factor << " growth_interval=" << r.growth_interval
        << " hysteresis=" << r.hysteresis << " min_loss_scale=" << r.min_loss_scale
        << " max_loss_scale=" << r.max_loss_scale;
  } else {
    out << " loss_scale=" << r.static_loss_scale;
  }
  out << " num_losses=" << r.num_losses;
  if (r.fp8) out << " fp8=" << r.fp8->to_string();  // absent without FP8: older checkpoints still compare equal
  return out.str();
}

bool Options::operator==(const Options& other) const { return to_string() == other.to_string(); }

}  // namespace amp
