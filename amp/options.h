#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <c10/core/ScalarType.h>

#include <amp/fp8/fp8_recipe.h>

namespace amp {

/// Apex's optimization levels (see docs/opt_levels.md and ../shared/REFERENCE.md §2):
///   O0: fp32 training, static loss scale 1.      O1: autocast per op, fp32 weights, dynamic scale.
///   O2: half model with fp32 norm layers, fp32 master weights, dynamic scale.   O3: pure half, static scale 1.
enum class OptLevel { O0, O1, O2, O3 };

/// Parses "O0".."O3" (also "o2"); throws naming the text otherwise.
OptLevel parse_opt_level(const std::string& text);
const char* opt_level_name(OptLevel level);

/// What amp::initialize is asked for: an opt level plus optional overrides of any of its properties, and the
/// loss-scaler settings. Setters are chainable (`Options().opt_level(OptLevel::O2).half_dtype(at::kBFloat16)`);
/// nothing is checked until resolve(), which applies the level's table, then the overrides, and throws on
/// contradictions naming the two settings that disagree.
class Options {
 public:
  Options& opt_level(OptLevel level) {
    opt_level_ = level;
    return *this;
  }
  /// kHalf (default) or kBFloat16: the low-precision dtype of casts and autocast.
  Options& half_dtype(c10::ScalarType dtype) {
    half_dtype_ = dtype;
    return *this;
  }
  /// Override: the dtype model parameters are cast to (kFloat = keep fp32; kHalf/kBFloat16 = half_dtype).
  Options& cast_model_type(c10::ScalarType dtype) {
    cast_model_type_ = dtype;
    return *this;
  }
  /// Override: keep BatchNorm layers fp32 when the model is cast.
  Options& keep_batchnorm_fp32(bool keep) {
    keep_batchnorm_fp32_ = keep;
    return *this;
  }
  /// Keep LayerNorm/GroupNorm layers fp32 when the model is cast (default false, as Apex).
  Options& keep_layernorm_fp32(bool keep) {
    keep_layernorm_fp32_ = keep;
    return *this;
  }
  /// Override: keep fp32 master copies of half parameters for the optimizer.
  Options& master_weights(bool enabled) {
    master_weights_ = enabled;
    return *this;
  }
  /// Override: a static loss scale (> 0, finite).
  Options& loss_scale(double static_scale) {
    static_loss_scale_ = static_scale;
    dynamic_ = false;
    return *this;
  }
  /// Override: dynamic loss scaling.
  Options& dynamic_loss_scale() {
    static_loss_scale_.reset();
    dynamic_ = true;
    return *this;
  }
  /// Dynamic scaling: initial scale (default 2^16), growth (2), backoff (0.5), growth interval (2000 steps),
  /// hysteresis (1 = torch.amp; 2 = tolerate one overflow), floor (default 1), ceiling (default 2^24, as Apex).
  Options& init_scale(double v) {
    init_scale_ = v;
    return *this;
  }
  Options& growth_factor(double v) {
    growth_factor_ = v;
    return *this;
  }
  Options& backoff_factor(double v) {
    backoff_factor_ = v;
    return *this;
  }
  Options& growth_interval(int64_t steps) {
    growth_interval_ = steps;
    return *this;
  }
  Options& hysteresis(int64_t overflows) {
    hysteresis_ = overflows;
    return *this;
  }
  Options& min_loss_scale(double v) {
    min_loss_scale_ = v;
    return *this;
  }
  Options& max_loss_scale(double v) {
    max_loss_scale_ = v;
    return *this;
  }
  /// Independent loss scalers, one per loss (`scale_loss(loss, optimizer, loss_id)`).
  Options& num_losses(int64_t n) {
    num_losses_ = n;
    return *this;
  }
  /// Consecutive overflowing steps with the scale at its floor before the scaler gives up with an error that
  /// names the parameter whose gradient went non-finite (0 = never give up).
  Options& max_overflows_at_floor(int64_t steps) {
    max_overflows_at_floor_ = steps;
    return *this;
  }

  /// FP8 training on top of O1 or O2 (docs/fp8.md): every amp::Float8Linear whose dimensions the FP8 GEMMs take
  /// runs its GEMMs in FP8 with `recipe`; amp keeps the scaling state of all of them, updates it once per step on
  /// the device, reduces the amaxes across ranks under DDP, skips the step on a non-finite amax, and saves it in
  /// amp checkpoints. Layers left out are logged with the reason.
  Options& fp8(const Fp8Recipe& recipe) {
    fp8_ = recipe;
    return *this;
  }

  OptLevel opt_level() const { return opt_level_; }
  c10::ScalarType half_dtype() const { return half_dtype_; }

  /// The options with the opt level's table applied and every property decided. Throws on contradictions.
  struct Resolved;
  Resolved resolve() const;

  bool operator==(const Options& other) const;
  std::string to_string() const;

 private:
  OptLevel opt_level_ = OptLevel::O1;
  c10::ScalarType half_dtype_ = c10::ScalarType::Half;
  std::optional<c10::ScalarType> cast_model_type_;
  std::optional<bool> keep_batchnorm_fp32_;
  bool keep_layernorm_fp32_ = false;
  std::optional<bool> master_weights_;
  std::optional<double> static_loss_scale_;
  std::optional<bool> dynamic_;
  // Dynamic-scaling settings stay unset until given, so resolve() can refuse them with a static scale
  // rather than accept and ignore them.
  std::optional<double> init_scale_;
  std::optional<double> growth_factor_;
  std::optional<double> backoff_factor_;
  std::optional<int64_t> growth_interval_;
  std::optional<int64_t> hysteresis_;
  std::optional<double> min_loss_scale_;
  std::optional<double> max_loss_scale_;
  int64_t num_losses_ = 1;
  int64_t max_overflows_at_floor_ = 100;
  std::optional<Fp8Recipe> fp8_;
};

/// Defaults of the dynamic loss scaler: torch.amp's init/growth/backoff/interval, hysteresis 1, and a floor
/// of 1 and a ceiling of 2^24 (Apex's) so the scale can neither collapse (apex #834) nor run away.
struct LossScaleDefaults {
  static constexpr double kInitScale = 65536.0;
  static constexpr double kGrowthFactor = 2.0;
  static constexpr double kBackoffFactor = 0.5;
  static constexpr int64_t kGrowthInterval = 2000;
  static constexpr int64_t kHysteresis = 1;
  static constexpr double kMinScale = 1.0;
  static constexpr double kMaxScale = 16777216.0;
};

/// Every property decided (see Options::resolve).
struct Options::Resolved {
  OptLevel opt_level;
  c10::ScalarType half_dtype;
  c10::ScalarType cast_model_type;  // kFloat: parameters stay fp32
  bool autocast;                    // O1: ops run under an autocast scope
  bool keep_batchnorm_fp32;
  bool keep_layernorm_fp32;
  bool master_weights;
  bool dynamic_loss_scale;
  double static_loss_scale;  // used when !dynamic_loss_scale
  double init_scale, growth_factor, backoff_factor;
  int64_t growth_interval, hysteresis;
  double min_loss_scale, max_loss_scale;
  int64_t num_losses;
  int64_t max_overflows_at_floor;
  std::optional<Fp8Recipe> fp8;  // FP8 Float8Linear layers with this recipe
};

}  // namespace amp
