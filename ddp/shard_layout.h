#pragma once

// How ZeRO splits a flat gradient bucket among the ranks (see docs/zero.md): rank q owns the contiguous slice
// [bounds[q], bounds[q + 1]) of the bucket's elements; a parameter may straddle two slices. The boundaries are the
// ideal split numel * q / world rounded up to a multiple of the alignment, so every slice is within one alignment
// unit of numel / world and starts aligned. On the wire (reduce-scatter, all-gather) each slice travels padded to
// `chunk` elements, the longest slice rounded up to the alignment.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ddp {

/// Elements per alignment unit: 16 elements keep every slice start 32-byte aligned for fp16/bf16 and 64-byte
/// aligned for fp32 (the vectorized kernels' widest access).
constexpr int64_t kShardAlignment = 16;

/// The slices of one bucket, as shard_bucket() computes them.
struct BucketShards {
  int64_t numel = 0;            ///< elements in the bucket
  int64_t chunk = 0;            ///< elements per rank on the wire
  std::vector<int64_t> bounds;  ///< world + 1 boundaries, bounds[0] = 0, bounds[world] = numel
  /// The number of ranks (slices).
  int world() const { return static_cast<int>(bounds.size()) - 1; }
  /// The first element of `rank`'s slice, a multiple of the alignment or numel (0 <= rank < world(), unchecked).
  int64_t begin(int rank) const { return bounds[static_cast<size_t>(rank)]; }
  /// The elements in `rank`'s slice, possibly 0 (0 <= rank < world(), unchecked).
  int64_t size(int rank) const { return bounds[static_cast<size_t>(rank) + 1] - bounds[static_cast<size_t>(rank)]; }
};

/// The split of a bucket of `numel` elements among `world` ranks (world >= 1, numel >= 0, alignment >= 1; c10::Error
/// otherwise).
BucketShards shard_bucket(int64_t numel, int world, int64_t alignment = kShardAlignment);

}  // namespace ddp
