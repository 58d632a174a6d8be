// amp::detail::State, data parallel training: attach() chooses the gradient owner (Note [gradient owner]).

#include <amp/state/state.h>

#include <memory>

#include <c10/util/Exception.h>

#include <amp/fp8/fp8_state.h>
#include <amp/zero/zero_shard.h>
#include <ddp/distributed_data_parallel.h>

namespace amp::detail {

void State::attach(ddp::DistributedDataParallel& ddp, ZeroStage stage, ZeroPublish publish) {
  TORCH_CHECK(fsdp_ == nullptr,
              "amp: attach() over a fully sharded model: the FullyShardedDataParallel amp::initialize took reduces "
              "the gradients itself; do not wrap it in DistributedDataParallel");
  TORCH_CHECK(ddp.module().get() == module_,
              "amp: attach() got a DistributedDataParallel that wraps a different module than the one "
              "amp::initialize prepared; wrap the initialized module itself");
  TORCH_CHECK(zero_ == nullptr,
              "amp: attach() after attach() with a ZeroStage: the optimizer is sharded along that "
              "DistributedDataParallel's buckets; attach once");
  TORCH_CHECK(publish == ZeroPublish::kInStep || publish == ZeroPublish::kAtNextForward,
              "amp: attach(): unknown ZeroPublish ", static_cast<int>(publish));
  TORCH_CHECK(stage != ZeroStage::kNone || publish == ZeroPublish::kInStep,
              "amp: attach(ddp, ZeroStage::kNone, ZeroPublish::kAtNextForward): without ZeRO the step updates the "
              "model parameters itself and there is no all-gather to defer; pass ZeroStage::kOne or kTwo");
  if (stage != ZeroStage::kNone) {
    const bool untouched = progress_.steps == 0 && !progress_.unscaled && losses_.idle();
    auto shard =
        std::make_unique<ZeroShard>(OwnerContext{slots_, *optimizer_, fused_, policy_, untouched}, ddp, stage, publish);
    zero_ = shard.get();
    sharded_owner_ = shard.get();
    owner_ = std::move(shard);
  }
  if (fp8_ != nullptr) fp8_->set_process_group(&ddp.process_group());
  ddp.set_bucket_consumer([weak = weak_from_this()](const ddp::ReducedBucket& bucket) {
    const std::shared_ptr<State> state = weak.lock();
    return state != nullptr && state->consume_bucket(bucket);
  });
  ddp.set_bucket_consumer_label("unscale");  // what a ddp::Timeline calls the consumer's pass over a bucket
}

}  // namespace amp::detail
