#include "small_cnn.h"

#include <ddp/sync_batch_norm.h>

namespace examples {

namespace {
constexpr int64_t kChannels1 = 32;
constexpr int64_t kChannels2 = 64;
constexpr int64_t kHidden = 128;
constexpr int64_t kClasses = 10;
constexpr int64_t kPooledSide = 7;  // 28 -> 14 -> 7 after two 2x2 pools
constexpr int kImageDims = 2;

torch::nn::AnyModule batch_norm(int64_t channels, bool sync) {
  if (sync) {
    return torch::nn::AnyModule(ddp::SyncBatchNorm(ddp::SyncBatchNormOptions(channels).dimensionality(kImageDims)));
  }
  return torch::nn::AnyModule(torch::nn::BatchNorm2d(channels));
}
}  // namespace

SmallCnnImpl::SmallCnnImpl(const SmallCnnOptions& options) : options(options) { reset(); }

void SmallCnnImpl::reset() {
  conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, kChannels1, 3).padding(1)));
  bn1 = batch_norm(kChannels1, options.sync_batch_norm());
  register_module("bn1", bn1.ptr());
  conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(kChannels1, kChannels2, 3).padding(1)));
  bn2 = batch_norm(kChannels2, options.sync_batch_norm());
  register_module("bn2", bn2.ptr());
  fc1 = amp::Float8Linear(kChannels2 * kPooledSide * kPooledSide, kHidden);
  if (options.sharded_fc1()) {
    fc1_unit = register_module("fc1", ddp::ShardedUnit(fc1));
  } else {
    register_module("fc1", fc1);
  }
  fc2 = register_module("fc2", amp::Float8Linear(kHidden, kClasses));
}

torch::Tensor SmallCnnImpl::forward(torch::Tensor x) {
  x = torch::max_pool2d(torch::relu(bn1.forward(conv1(x))), 2);
  x = torch::max_pool2d(torch::relu(bn2.forward(conv2(x))), 2);
  x = torch::relu(options.sharded_fc1() ? fc1_unit(x.flatten(1)) : fc1(x.flatten(1)));
  return fc2(x);
}

}  // namespace examples
