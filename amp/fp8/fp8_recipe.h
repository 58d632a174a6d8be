#pragma once

// The FP8 recipe of amp::Float8Linear and amp::Options::fp8 (docs/fp8.md).

#include <cstdint>
#include <string>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

namespace amp {

/// How a tensor's scale is chosen: from an amax history of earlier steps (kDelayed, Transformer Engine's
/// DelayedScaling: one read of the tensor per cast) or from the tensor's own amax (kCurrent: one extra read).
enum class Fp8Scaling : int8_t { kDelayed, kCurrent };
/// kHybrid: E4M3 for inputs and weights, E5M2 for output gradients (TE's default); kE4M3: E4M3 for all three.
enum class Fp8Format : int8_t { kHybrid, kE4M3 };
/// Delayed scaling: the amax a scale comes from, the history's max (default) or its most recent entry.
enum class Fp8AmaxCompute : int8_t { kMax, kMostRecent };

/// An FP8 recipe. The defaults are Transformer Engine's DelayedScaling: HYBRID, amax_history_len 1024, margin 0,
/// amax_compute_algo "max" (scale = fp8_max / (max(history) * 2^margin)).
struct Fp8Recipe {
  /// Throws naming the setting that is out of range.
  void check() const;
  /// "scaling=delayed,format=hybrid,history=1024,margin=0,amax=max": what checkpoints compare.
  std::string to_string() const;
  /// The FP8 dtype of tensor `role` (kFp8Input, kFp8Weight, kFp8GradOutput).
  c10::ScalarType dtype(int role) const;

  /// Delayed (default) or current scaling.
  TORCH_ARG(Fp8Scaling, scaling) = Fp8Scaling::kDelayed;
  /// Which FP8 dtypes the tensors are cast to (default kHybrid).
  TORCH_ARG(Fp8Format, format) = Fp8Format::kHybrid;
  /// Entries of each tensor's amax history (1..1048576; 1 = the previous step's amax).
  TORCH_ARG(int64_t, amax_history_len) = 1024;
  /// Scales are divided by 2^margin (0..63): headroom for amaxes that grow between steps.
  TORCH_ARG(int64_t, margin) = 0;
  /// Delayed scaling: whether a scale comes from the history's max (default) or its most recent amax.
  TORCH_ARG(Fp8AmaxCompute, amax_compute) = Fp8AmaxCompute::kMax;
};

/// The tensors of a layer that are cast to FP8, in the order of its scaling state's rows.
inline constexpr int kFp8Input = 0;            ///< row 0: the layer's input
inline constexpr int kFp8Weight = 1;           ///< row 1: the weight
inline constexpr int kFp8GradOutput = 2;       ///< row 2: the gradient of the layer's output
inline constexpr int kFp8TensorsPerLayer = 3;  ///< rows of scaling state per layer

}  // namespace amp
