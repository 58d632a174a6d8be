#include <ddp/shard_layout.h>

#include <algorithm>

#include <c10/util/Exception.h>

namespace ddp {

BucketShards shard_bucket(int64_t numel, int world, int64_t alignment) {
  TORCH_CHECK(world >= 1, "shard_bucket: world size must be >= 1, got ", world);
  TORCH_CHECK(numel >= 0, "shard_bucket: numel must be >= 0, got ", numel);
  TORCH_CHECK(alignment >= 1, "shard_bucket: alignment must be >= 1, got ", alignment);
  BucketShards s;
  s.numel = numel;
  s.bounds.resize(static_cast<size_t>(world) + 1);
  for (int q = 0; q <= world; ++q) {
    // floor(numel * q / world) without overflow for any realistic bucket, rounded up to the alignment
    const int64_t ideal = numel / world * q + numel % world * q / world;
    s.bounds[static_cast<size_t>(q)] = std::min(numel, (ideal + alignment - 1) / alignment * alignment);
  }
  int64_t longest = 0;
  for (int q = 0; q < world; ++q) longest = std::max(longest, s.size(q));
  s.chunk = (longest + alignment - 1) / alignment * alignment;
  return s;
}

}  // namespace ddp
