// ZeroShard's step and its publish: the all-gather of every rank's updated slices into the model parameters,
// pipelined per bucket (Note [pipelined publish]) and, under ZeroPublish::kAtNextForward, completed at the next
// forward (Note [deferred publish]).

#include <amp/zero/zero_shard.h>

#include <exception>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <amp/optim/fused_optimizer.h>
#include <amp/state/param_slots.h>
#include <kernels/multi_tensor/scaled_copy.h>

namespace amp::detail {

// Note [pipelined publish]
// One all-gather per bucket, all started at once (Gloo runs them on its own threads, NCCL on its stream), and each
// bucket's values copied into the model as soon as its gather is done, while the later buckets are still on the
// wire. The copies are the same element copies as one gather of everything: the model ends bit-identical.
// start_publish launches them; finish_publish waits and copies, bucket by bucket in order, freeing each bucket's
// receive buffer before the next one is waited for. Under ZeroPublish::kInStep step() calls both; under
// kAtNextForward only the first (Note [deferred publish]).
//
// Note [deferred publish]
// Under ZeroPublish::kAtNextForward step() returns with the all-gathers in flight: they read the send buffers, and
// every rank's chunks arrive in pending_gathered_, not yet in the model. What the caller does before the next
// forward (zero_grad, loading the next batch, logging) overlaps the transfer. finish_publish then waits and copies
// exactly as the in-step publish does, so the parameters end bit-identical. It runs
// - at amp::Model::forward / call (State::wait_for_parameters, through GradientOwner::wait_for_parameters), where
// DeepSpeed's overlap_comm and FSDP's forward prefetch
//   also wait (here for every bucket at once, before the forward's first layer);
// - in Optimizer::wait_for_parameters(), for a forward that does not go through amp::Model;
// - before anything else of amp's reads or writes the model parameters or the send buffers: the next step(), the
//   model's save/load, every checkpoint save/load (publish(), which a sharded load calls, completes a pending one
//   first), and the shard's destruction;
// and nowhere else: zero_grad, clip_grad_norm_, held_bytes, full_masters and the optimizer's state touch neither
// (they read the masters and gradients), and zero_grad usually sits in the window the transfer overlaps.
// A forward through the raw module while the publish is pending runs on the previous step's parameters. That cannot
// be seen here, but its consequence can: a scale_loss scope (State::begin_loss) or a reduced bucket
// (State::consume_bucket) arriving while the publish is still pending means the forward did not go through
// amp::Model, and check_published throws rather than let a step on those gradients through.

ZeroShard::~ZeroShard() {
  if (!publish_pending()) return;
  try {
    finish_publish();
  } catch (const std::exception& e) {  // a destructor must not throw; the broken group fails its next collective
    TORCH_WARN(
        "amp: ZeRO: the last step()'s parameter all-gather failed while the optimizer was destroyed; the "
        "model keeps the previous step's parameters: ",
        e.what());
  }
}

void ZeroShard::step(FusedOptimizer& fused, const at::Tensor& found_inf) {
  finish_publish();  // a step with no forward since the last one: its all-gather still reads the send buffers
  std::vector<at::Tensor> outs;
  outs.reserve(step_order_.size());
  for (size_t i : step_order_) outs.push_back(pieces_[i].out);
  fused.fused_step(outs, found_inf);
  start_publish();
  if (publish_mode_ == ZeroPublish::kInStep) finish_publish();
}

void ZeroShard::check_capturable(const c10::Device& device) const {
  // Note [deferred publish]: the all-gathers would be waited for outside the graph, at the next forward.
  TORCH_CHECK(publish_mode_ == ZeroPublish::kInStep,
              "amp::Optimizer::step() under ZeroPublish::kAtNextForward cannot be captured in a CUDA graph on ", device,
              ": the parameter all-gather it starts completes at the next forward, outside the capture. Attach with "
              "ZeroPublish::kInStep to capture the step");
}

void ZeroShard::publish() {
  finish_publish();
  start_publish();
  finish_publish();
}

void ZeroShard::start_publish() {
  TORCH_CHECK(!publish_pending(), "ZeRO: start_publish() while a publish is pending (finish it first)");
  const int64_t world = pg_.size();
  // Built aside and kept only once every bucket is under way: a launch that throws leaves nothing pending that
  // finish_publish could copy from an unwritten buffer.
  std::vector<at::Tensor> gathered(publish_.size());
  std::vector<c10::intrusive_ptr<c10d::Work>> works(publish_.size());
  for (size_t b = 0; b < publish_.size(); ++b) {
    const PublishRange& r = publish_[b];
    at::Tensor mine = send_[r.dtype].narrow(0, r.send_begin, r.chunk);
    gathered[b] = at::empty({r.chunk * world}, mine.options());
    if (world == 1) {
      gathered[b].copy_(mine);
    } else {
      works[b] = pg_.allgather_into_async(gathered[b], mine);
    }
  }
  pending_gathered_ = std::move(gathered);
  pending_works_ = std::move(works);
}

void ZeroShard::finish_publish() {
  if (!publish_pending()) return;
  // Taken out first: a failed wait leaves none pending, and its error surfaces once, as the in-step publish's does.
  std::vector<at::Tensor> gathered = std::move(pending_gathered_);
  std::vector<c10::intrusive_ptr<c10d::Work>> works = std::move(pending_works_);
  pending_gathered_.clear();
  pending_works_.clear();
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < publish_.size(); ++b) {
    const PublishRange& r = publish_[b];
    if (works[b]) pg_.wait(works[b], "ZeRO parameter all-gather");
    std::vector<at::Tensor> src, dst;
    for (size_t i = r.pieces_begin; i < r.pieces_end; ++i) {
      const Piece& p = pieces_[i];
      src.push_back(gathered[b].narrow(0, p.rank * r.chunk + p.send_offset - r.send_begin, p.numel));
      dst.push_back(
          slots_[static_cast<size_t>(p.slot)].model.detach().reshape({-1}).narrow(0, p.param_offset, p.numel));
    }
    if (!src.empty()) kernels::scaled_copy_(src, dst, 1.0);
    // Deferred, the copy may run on another stream than the one step() allocated the buffer on: the allocator must
    // not hand it out again before the copy has read it.
    if (gathered[b].is_cuda()) {
      gathered[b].record_stream(
          c10::impl::VirtualGuardImpl(gathered[b].device().type()).getStream(gathered[b].device()));
    }
    gathered[b] = at::Tensor();  // the bucket's receive buffer is free before the next one is waited for
  }
}

void ZeroShard::fail_pending(const char* what) const {
  TORCH_CHECK(false, "amp: ", what,
              " while the last step()'s parameter all-gather was still pending (ZeroPublish::kAtNextForward): the "
              "forward pass did not go through amp::Model (model.forward / model.call), so it ran on the previous "
              "step's parameters. Run it through model.forward or model.call, or call "
              "optimizer.wait_for_parameters() before it");
}

}  // namespace amp::detail
