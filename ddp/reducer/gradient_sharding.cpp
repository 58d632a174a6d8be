#include <ddp/reducer/gradient_sharding.h>

#include <ATen/Functions.h>

#include <ddp/reducer/bucket_copy.h>

namespace ddp::detail {

ShardedReduction launch_sharded_reduction(const ProcessGroup& pg, const BucketShards& shards,
                                          const at::TensorOptions& bucket_options, const std::vector<at::Tensor>& grads,
                                          double prescale) {
  ShardedReduction r;
  if (pg.backend_name() == "gloo") {
    r.wire = at::empty({shards.numel}, bucket_options);
    copy_into_bucket(r.wire, grads, prescale);
    r.work = pg.allreduce_sum_async(r.wire);
    return r;
  }
  // The flat bucket, then each rank's slice at q * chunk of the padded wire buffer.
  at::Tensor flat = at::empty({shards.numel}, bucket_options);
  copy_into_bucket(flat, grads, prescale);
  r.wire = at::zeros({shards.chunk * pg.size()}, bucket_options);
  r.shard = at::empty({shards.chunk}, bucket_options);
  for (int q = 0; q < pg.size(); ++q) {
    r.wire.narrow(0, q * shards.chunk, shards.size(q)).copy_(flat.narrow(0, shards.begin(q), shards.size(q)));
  }
  r.work = pg.reduce_scatter_sum_async(r.shard, r.wire);
  return r;
}

at::Tensor received_slice(const ProcessGroup& pg, const BucketShards& shards, const ShardedReduction& r) {
  const int rank = pg.rank();
  if (!r.shard.defined()) return r.wire.narrow(0, shards.begin(rank), shards.size(rank));  // Gloo: the whole sum
  return r.shard.narrow(0, 0, shards.size(rank));
}

}  // namespace ddp::detail
