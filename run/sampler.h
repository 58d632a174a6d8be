#pragma once

// The order in which a distributed run visits its data, and where in it the run stands, as state that a checkpoint
// keeps: what torchdata's StatefulDataLoader and DistributedSampler give a Python loop.

#include <cstdint>
#include <optional>

#include <torch/types.h>

namespace run {

/// Which samples each rank trains on, batch by batch, epoch by epoch, resumable mid-epoch.
///
///     run::DistributedSampler sampler(dataset_size, /*batch_size=*/64, group.rank(), group.size());
///     for (int64_t epoch = 1; epoch <= epochs; ++epoch) {
///       sampler.set_epoch(epoch);                 // or set_epoch(epoch, batches_done) to resume inside it
///       while (const auto indices = sampler.next()) {
///         auto images = dataset.images.index_select(0, *indices);
///         ...
///       }
///     }
///
/// Each epoch is one shuffle of the samples drawn from the epoch's number (torch::data::samplers::
/// DistributedRandomSampler with set_epoch: every rank draws the same shuffle), so an epoch's batches do not depend on
/// what ran before: a run resumed at (epoch, batches_done) takes the very batches the unbroken run took.
///
/// Two ways to split the work (Order):
/// - kPerRank: rank r takes its contiguous block of the shuffle (torch's C++ shards: the indices padded with the data
///   set's first samples to a multiple of world_size, shuffled, then cut into world_size blocks) in batches of
///   batch_size; the last batch may be short. A step's samples depend on the number of ranks.
/// - kGlobal: step s takes samples [s * B, (s + 1) * B) of the shuffle of all samples, B = batch_size x world_size
///   (the job's batch), rank r the r-th part of them; a last part-batch of the job is left out. A step's samples are
///   the same on any number of ranks, so a run saved on 4 processes resumes on 2 with the same steps.
class DistributedSampler {
 public:
  /// How an epoch's shuffle is split among ranks and steps: kPerRank (a contiguous block per rank, the default) or
  /// kGlobal (step s takes the job's batch s of the shuffle); see the class comment.
  enum class Order { kPerRank, kGlobal };

  /// `dataset_size` samples, `batch_size` per rank (> 0), this `rank` of `world_size`. Throws std::invalid_argument
  /// naming the value when a size is not positive, rank is not in [0, world_size), there are fewer samples than
  /// ranks, or (kGlobal) the job's batch is more than the samples (an epoch would have no step).
  DistributedSampler(int64_t dataset_size, int64_t batch_size, int rank = 0, int world_size = 1,
                     Order order = Order::kPerRank);

  /// Starts `epoch` (any integer; the examples count from 1) at batch `batches_done` of it (0: its start; a resumed
  /// run passes what its checkpoint recorded). Throws std::invalid_argument when batches_done is negative or more
  /// than the epoch's batches.
  void set_epoch(int64_t epoch, int64_t batches_done = 0);

  /// This rank's next batch of the epoch: int64 sample indices, in order; nullopt once the epoch's batches are done.
  std::optional<torch::Tensor> next();

  /// The epoch set last by set_epoch (0 before the first call).
  int64_t epoch() const { return epoch_; }
  /// Batches of this epoch that next() has handed out (a checkpoint records it; set_epoch takes it back).
  int64_t batches_done() const { return batches_done_; }
  /// This rank's batches per epoch (the same on every rank).
  int64_t batches_per_epoch() const { return batches_per_epoch(dataset_size_, batch_size_, world_size_, order_); }
  /// Samples the job takes per step: batch_size x world_size (a kPerRank epoch's last step may take fewer).
  int64_t job_batch_size() const { return batch_size_ * world_size_; }

  /// Each rank's batches per epoch for these sizes, as the sampler takes them.
  static int64_t batches_per_epoch(int64_t dataset_size, int64_t batch_size, int64_t world_size, Order order);

 private:
  int64_t dataset_size_;
  int64_t batch_size_;
  int rank_;
  int world_size_;
  Order order_;
  int64_t epoch_ = 0;
  int64_t batches_done_ = 0;
  torch::Tensor indices_;  ///< this rank's samples of the epoch, batch after batch
};

}  // namespace run
