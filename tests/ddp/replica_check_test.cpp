#include <ddp/replica_check.h>

#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"

namespace {

using ddp_test::contains_all;
using ddp_test::error_of;

torch::nn::Sequential make_model() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(6, 5), torch::nn::BatchNorm1d(5), torch::nn::Linear(5, 2));
}

TEST(ReplicaDigestTest, EveryBitOfEveryParameterAndBufferCounts) {
  auto model = make_model();
  const uint64_t digest = ddp::replica_digest(*model, /*include_buffers=*/true);
  EXPECT_EQ(ddp::replica_digest(*make_model(), true), digest);  // the same values give the same digest
  torch::NoGradGuard no_grad;
  // One bit of one parameter.
  auto weight = model->parameters()[0];  // the first Linear's 5x6 weight
  auto bits = weight.view(torch::kInt32);
  bits[0][0].bitwise_xor_(1);
  EXPECT_NE(ddp::replica_digest(*model, true), digest);
  bits[0][0].bitwise_xor_(1);
  EXPECT_EQ(ddp::replica_digest(*model, true), digest);
  // A buffer (BatchNorm's batch count) counts only when buffers are asked for.
  const uint64_t parameters_only = ddp::replica_digest(*model);
  auto buffers = model->buffers();
  buffers.back().add_(1);
  EXPECT_NE(ddp::replica_digest(*model, true), digest);
  EXPECT_EQ(ddp::replica_digest(*model), parameters_only);
  buffers.back().sub_(1);
  // The same bytes in another dtype are another model.
  auto as_double = make_model();
  as_double->to(torch::kDouble);
  EXPECT_NE(ddp::replica_digest(*as_double, true), digest);
  EXPECT_EQ(ddp::digest_hex(0x1234), "0x0000000000001234");
}

TEST(CheckReplicasTest, IdenticalReplicasAgreeOnEveryRank) {
  LTA_REQUIRE_GLOO();
  ddp_test::run_ranks(
      [](int, const ddp::ProcessGroup& pg) {
        auto model = make_model();
        TORCH_CHECK(ddp::check_replicas(*model, pg) == ddp::replica_digest(*model), "wrong digest returned");
      },
      4);
}

TEST(CheckReplicasTest, ADivergedRankIsNamedOnEveryRankAndBuffersCountWhenAsked) {
  LTA_REQUIRE_GLOO();
  const std::string message = error_of([] {
    ddp_test::run_ranks(
        [](int rank, const ddp::ProcessGroup& pg) {
          auto model = make_model();
          if (rank == 2) {
            torch::NoGradGuard no_grad;
            model->parameters()[0].view(-1)[3].add_(1e-6);  // one element, a few ulps
          }
          const std::string error = error_of([&] { ddp::check_replicas(*model, pg); });
          TORCH_CHECK(error.find("ddp::check_replicas: the replicas differ: rank(s) 2 (0x") != std::string::npos &&
                          error.find(" of 4 hold parameters other than rank 0's (0x") != std::string::npos,
                      "rank ", rank, " got: ", error);
          // Equal parameters, rank 3's BatchNorm batch count off: only a check of the buffers sees it.
          auto fresh = make_model();
          if (rank == 3) fresh->buffers().back().add_(1);
          ddp::check_replicas(*fresh, pg);
          const std::string buffers_error = error_of([&] { ddp::check_replicas(*fresh, pg, true); });
          TORCH_CHECK(
              buffers_error.find("rank(s) 3 (0x") != std::string::npos &&
                  buffers_error.find(" of 4 hold parameters or buffers other than rank 0's") != std::string::npos,
              "rank ", rank, " got: ", buffers_error);
          if (rank == 1) throw std::runtime_error("rank 1 saw the difference");  // proves the ranks got here
        },
        4);
  });
  EXPECT_TRUE(contains_all(message, {"rank 1 saw the difference"})) << message;
  EXPECT_EQ(message.find("got:"), std::string::npos) << message;  // no rank missed the difference or misnamed it
}

}  // namespace
