#include <run/sampler.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>
#include <torch/data/samplers/distributed.h>

namespace run {

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t batch_size, int rank, int world_size, Order order)
    : dataset_size_(dataset_size), batch_size_(batch_size), rank_(rank), world_size_(world_size), order_(order) {
  if (dataset_size <= 0) {
    throw std::invalid_argument(fmt::format("DistributedSampler: dataset size must be positive, got {}", dataset_size));
  }
  if (batch_size <= 0) {
    throw std::invalid_argument(fmt::format("DistributedSampler: batch size must be positive, got {}", batch_size));
  }
  if (world_size <= 0 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument(
        fmt::format("DistributedSampler: rank {} is not one of world size {}'s ranks", rank, world_size));
  }
  if (dataset_size < world_size) {  // torch's padding repeats samples, at most the whole set once
    throw std::invalid_argument(
        fmt::format("DistributedSampler: {} samples cannot be shared among {} ranks", dataset_size, world_size));
  }
  if (order == Order::kGlobal && batch_size * world_size > dataset_size) {
    throw std::invalid_argument(
        fmt::format("DistributedSampler: a job batch of {} ({} per rank x {}) is more than the {} samples",
                    batch_size * world_size, batch_size, world_size, dataset_size));
  }
}

int64_t DistributedSampler::batches_per_epoch(int64_t dataset_size, int64_t batch_size, int64_t world_size,
                                              Order order) {
  if (order == Order::kGlobal) return dataset_size / (batch_size * world_size);
  const int64_t local = (dataset_size + world_size - 1) / world_size;  // torch's sampler pads every shard alike
  return (local + batch_size - 1) / batch_size;
}

void DistributedSampler::set_epoch(int64_t epoch, int64_t batches_done) {
  const int64_t batches = batches_per_epoch();
  if (batches_done < 0 || batches_done > batches) {
    throw std::invalid_argument(fmt::format("DistributedSampler: batch {} of epoch {} asked for, but an epoch has {}",
                                            batches_done, epoch, batches));
  }
  const bool global = order_ == Order::kGlobal;
  const auto n = static_cast<size_t>(dataset_size_);
  // Global order: the one-replica shuffle of every sample, each step's job batch cut into the ranks' parts.
  torch::data::samplers::DistributedRandomSampler sampler(n, global ? 1 : static_cast<size_t>(world_size_),
                                                          global ? 0 : static_cast<size_t>(rank_));
  sampler.set_epoch(static_cast<size_t>(epoch));
  sampler.reset();
  const std::vector<size_t> shard = sampler.next(n).value_or(std::vector<size_t>{});
  std::vector<int64_t> shard64(shard.begin(), shard.end());
  indices_ = torch::tensor(shard64, torch::kInt64);
  if (global) {
    indices_ = indices_.slice(0, 0, batches * job_batch_size())
                   .view({batches, world_size_, batch_size_})
                   .select(1, rank_)
                   .reshape({-1});  // this rank's parts, step after step
  }
  epoch_ = epoch;
  batches_done_ = batches_done;
}

std::optional<torch::Tensor> DistributedSampler::next() {
  if (!indices_.defined() || batches_done_ >= batches_per_epoch()) return std::nullopt;
  const int64_t local = indices_.numel();
  const int64_t begin = batches_done_ * batch_size_;
  ++batches_done_;
  return indices_.slice(0, begin, std::min(local, begin + batch_size_));
}

}  // namespace run
