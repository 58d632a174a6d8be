#include <amp/state/model_cast.h>

#include <ddp/sync_batch_norm.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

// amp's model cast treats ddp::SyncBatchNorm as BatchNorm: kept fp32 under keep_batchnorm_fp32 (O2), cast with it off.
TEST(SyncBatchNormCastTest, KeepBatchnormFp32KeepsSyncBatchNormFp32AndHalfInputComesBackHalf) {
  for (const bool keep : {true, false}) {
    torch::nn::Sequential model(torch::nn::Linear(4, 3), ddp::SyncBatchNorm(3));
    amp::cast_model_(*model, torch::kBFloat16, /*keep_batchnorm_fp32=*/keep, /*keep_layernorm_fp32=*/false);
    auto* sync = model[1]->as<ddp::SyncBatchNorm>();
    ASSERT_NE(sync, nullptr);
    EXPECT_TRUE(amp::is_batch_norm(*sync));
    const auto expected = keep ? torch::kFloat : torch::kBFloat16;
    EXPECT_EQ(sync->weight.scalar_type(), expected);
    EXPECT_EQ(sync->bias.scalar_type(), expected);
    EXPECT_EQ(sync->running_mean.scalar_type(), expected);
    EXPECT_EQ(sync->running_var.scalar_type(), expected);
    EXPECT_EQ(sync->num_batches_tracked.scalar_type(), torch::kLong);
    EXPECT_EQ(model[0]->as<torch::nn::Linear>()->weight.scalar_type(), torch::kBFloat16);

    // Eval mode needs no process group; a bf16 activation is normalized with the fp32 statistics and comes back bf16.
    model->eval();
    const auto out = model->forward(torch::randn({5, 4}).to(torch::kBFloat16));
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  }
}

}  // namespace
