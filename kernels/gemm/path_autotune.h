#pragma once

// Per-shape choice between the cuBLASLt epilogue path and plain ATen ops, measured once per shape.

#include <array>
#include <cstdint>
#include <functional>
#include <optional>

#include <c10/core/Device.h>

#include <kernels/gemm/gemm_epilogue.h>

namespace kernels {

/// Identifies one unit of work whose path is chosen as a whole (e.g. a layer's forward + backward): the caller
/// packs a kind tag, the sizes, the dtype and the device index. Unused slots are 0.
using PathKey = std::array<int64_t, 8>;

/// A measured choice: the faster path and the median milliseconds of each (0 when not measured).
struct PathChoice {
  GemmPath path = GemmPath::kAten;  ///< the path to use (the lower median; kCublasLt on a tie)
  double cublaslt_ms = 0.0;         ///< median time of the cuBLASLt runs, in ms
  double aten_ms = 0.0;             ///< median time of the ATen runs, in ms
};

/// The faster path for `key`, measured on first use and cached (mutex-guarded map) for the process.
/// run(path): does the work once on `device`'s current stream with every GEMM on `path` (allow_cublaslt ==
/// (path == kCublasLt)); its results are discarded, so call it with autograd off.
/// CUDA, nothing cached: runs each path once to warm up, then `kRounds` interleaved timed runs each (CUDA events on
/// the current stream; this first call per shape syncs the host, later calls never do), and caches the path with
/// the lower median. While the current stream is capturing a CUDA graph: kCublasLt, not cached (nothing can be
/// timed). CPU: kAten, nothing run (cuBLASLt is CUDA-only).
PathChoice autotuned_path(const PathKey& key, const c10::Device& device, const std::function<void(GemmPath)>& run);

/// The cached choice for `key`, if it was measured.
std::optional<PathChoice> cached_path(const PathKey& key);

/// How many keys have been measured since the process started (the tests check that a shape is measured once).
int64_t autotune_measurement_count();

/// Forgets every cached choice (e.g. after changing the cuBLASLt workspace).
void clear_autotuned_paths();

}  // namespace kernels
