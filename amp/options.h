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
/// "O0" to "O3", as parse_opt_level() reads it back.
const char* opt_level_name(OptLevel level);

/// What amp::initialize is asked for: an opt level plus optional overrides of any of its properties, and the
/// loss-scaler settings. Setters are chainable (`Options().opt_level(OptLevel::O2).half_dtype(at::kBFloat16)`);
/// nothing is checked until resolve(), which applies the level's table, then the overrides, and throws on
/// contradictions naming the two settings that disagree.
class Options {
 public:
  /// Apex's opt level (O0-O3): the table of defaults the other settings override. Default O1.
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
  /// Dynamic scaling: the initial scale, in [min_loss_scale, max_loss_scale]. Default 2^16. Like the other
  /// dynamic-scaling settings below, refused by resolve() when the loss scale is static.
  Options& init_scale(double v) {
    init_scale_ = v;
    return *this;
  }
  /// Dynamic scaling: multiplies the scale after growth_interval clean steps; finite and > 1. Default 2.
  Options& growth_factor(double v) {
    growth_factor_ = v;
    return *this;
  }
  /// Dynamic scaling: multiplies the scale when it backs off; in (0, 1). Default 0.5.
  Options& backoff_factor(double v) {
    backoff_factor_ = v;
    return *this;
  }
  /// Dynamic scaling: consecutive clean steps before the scale grows, >= 1. Default 2000.
  Options& growth_interval(int64_t steps) {
    growth_interval_ = steps;
    return *this;
  }
  /// Dynamic scaling: the scale backs off at the n-th overflow since it last grew (and at every later one), n >= 1.
  /// 1 is torch.amp's rule; 2 tolerates one overflow (Megatron, DeepSpeed). Default 1.
  Options& hysteresis(int64_t overflows) {
    hysteresis_ = overflows;
    return *this;
  }
  /// Dynamic scaling: the floor the scale never backs off below; finite and > 0. Default 1.
  Options& min_loss_scale(double v) {
    min_loss_scale_ = v;
    return *this;
  }
  /// Dynamic scaling: the ceiling the scale never grows above, >= min_loss_scale. Default 2^24 (Apex's).
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

  /// The opt level set (default O1).
  OptLevel opt_level() const { return opt_level_; }
  /// The half dtype set (default kHalf).
  c10::ScalarType half_dtype() const { return half_dtype_; }

  struct Resolved;
  /// The options with the opt level's table applied, then the overrides: every property decided. Throws
  /// c10::Error on a contradiction (naming the two settings that disagree) or a value out of range.
  Resolved resolve() const;

  /// Whether both resolve to the same settings (compares to_string(), so max_overflows_at_floor is not
  /// compared). Throws as resolve() when either does not resolve.
  bool operator==(const Options& other) const;
  /// The resolved settings as space-separated `name=value` pairs: the dynamic-scaling ones only with dynamic
  /// scaling (else `loss_scale`), fp8 only when set. Throws as resolve().
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
  static constexpr double kInitScale = 65536.0;     ///< initial scale, 2^16 (torch.amp's)
  static constexpr double kGrowthFactor = 2.0;      ///< growth factor (torch.amp's)
  static constexpr double kBackoffFactor = 0.5;     ///< backoff factor (torch.amp's)
  static constexpr int64_t kGrowthInterval = 2000;  ///< clean steps before the scale grows (torch.amp's)
  static constexpr int64_t kHysteresis = 1;         ///< back off at every overflow (torch.amp's rule)
  static constexpr double kMinScale = 1.0;          ///< floor of the scale
  static constexpr double kMaxScale = 16777216.0;   ///< ceiling of the scale, 2^24 (Apex's)
};

/// Every property decided (see Options::resolve).
struct Options::Resolved {
  OptLevel opt_level;               ///< the level whose table was applied
  c10::ScalarType half_dtype;       ///< kHalf or kBFloat16
  c10::ScalarType cast_model_type;  ///< kFloat: parameters stay fp32
  bool autocast;                    ///< O1: ops run under an autocast scope
  bool keep_batchnorm_fp32;         ///< BatchNorm layers stay fp32 in a cast model
  bool keep_layernorm_fp32;         ///< LayerNorm/GroupNorm layers stay fp32 in a cast model
  bool master_weights;              ///< the optimizer steps fp32 master copies of half parameters
  bool dynamic_loss_scale;          ///< false: static_loss_scale applies (the default with kBFloat16)
  double static_loss_scale;         ///< used when !dynamic_loss_scale
  /// Dynamic scaling: the initial scale.
  double init_scale, growth_factor, backoff_factor;  ///< dynamic scaling: the backoff factor
  /// Dynamic scaling: clean steps before the scale grows.
  int64_t growth_interval, hysteresis;  ///< dynamic scaling: the n-th overflow since the last growth backs off
  /// Dynamic scaling: the floor of the scale.
  double min_loss_scale, max_loss_scale;  ///< dynamic scaling: the ceiling of the scale
  int64_t num_losses;                     ///< independent loss scalers, >= 1
  int64_t max_overflows_at_floor;         ///< consecutive overflows at the floor before an error (0: never)
  std::optional<Fp8Recipe> fp8;           ///< FP8 Float8Linear layers with this recipe
  /// \var amp::Options::Resolved::growth_factor
  /// Dynamic scaling: the growth factor.
};

}  // namespace amp
