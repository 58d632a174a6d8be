// ZeRO checkpoints (docs/zero.md): consolidated ones resume bit-identically at the same world size and load at other
// world sizes and into plain DDP + amp; sharded ones resume at any world size and replace their set atomically; a
// corrupt, damaged or incomplete one fails on every rank and changes nothing.

// Gloo on CPU, forked ranks.

#include <dirent.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "amp/zero_test_util.h"
#include "ddp/ddp_test_util.h"

namespace {

using zero_test::bit_identical;
using zero_test::make_optimizer;
using zero_test::Opt;
using zero_test::ZNet;

/// A DDP + amp O2 run (FusedAdam, two groups) whose data depends only on (rank, step), for checkpoint round trips.
struct Trainer {
  ZNet net;
  std::unique_ptr<torch::optim::Optimizer> inner;
  std::unique_ptr<amp::Initialized<ZNet>> amp_;
  std::unique_ptr<ddp::DistributedDataParallel> ddp_net;
  int rank;

  Trainer(const ddp::ProcessGroup& pg, amp::ZeroStage stage, uint64_t seed = 1) : rank(pg.rank()) {
    torch::manual_seed(seed);
    net = ZNet();
    inner = make_optimizer(Opt::kAdamW, net);
    amp_ = std::make_unique<amp::Initialized<ZNet>>(
        amp::initialize(net, *inner, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16)));
    ddp_net = std::make_unique<ddp::DistributedDataParallel>(net, pg,
                                                             ddp::DistributedDataParallelOptions()
                                                                 .first_bucket_mb(1e-4)
                                                                 .bucket_cap_mb(3e-4)
                                                                 .find_unused_parameters(true)
                                                                 .rebuild_buckets(false));
    amp_->optimizer.attach(*ddp_net, stage);
  }
  amp::Optimizer& optimizer() { return amp_->optimizer; }

  std::vector<float> train(int from, int to) {
    std::vector<float> losses;
    for (int s = from; s < to; ++s) {
      auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 * rank + s);
      const torch::Tensor x = torch::randn({6, 7}, generator), y = torch::randn({6, 5}, generator);
      optimizer().zero_grad();
      auto out = amp_->model.call([&](const torch::Tensor& in) { return ddp_net->forward(in); }, x);
      torch::Tensor loss = (out - y).pow(2).mean();
      {
        auto scaled = amp::scale_loss(loss, optimizer());
        scaled.backward();
      }
      optimizer().step();
      losses.push_back(loss.item<float>());
    }
    return losses;
  }

  /// The full fp32 masters in slot order (gathered under ZeRO: collective).
  std::vector<torch::Tensor> masters() { return zero_test::full_masters(optimizer()); }
};

TEST(ZeroCheckpointTest, AConsolidatedCheckpointResumesBitIdenticallyAtTheSameWorldSize) {
  LTA_REQUIRE_GLOO();
  ddp_test::ScratchDir dir;
  const std::string path = dir.file("zero.ckpt");
  for (const int stage : {1, 2}) {
    ddp_test::run_ranks(
        [&](int rank, const ddp::ProcessGroup& pg) {
          Trainer straight(pg, static_cast<amp::ZeroStage>(stage));
          straight.train(0, 6);
          amp::save_checkpoint(path, straight.amp_->model, straight.optimizer());  // every rank; rank 0 writes
          const std::vector<float> expected = straight.train(6, 12);
          Trainer resumed(pg, static_cast<amp::ZeroStage>(stage), /*seed=*/7);  // other initial weights
          amp::load_checkpoint(path, resumed.amp_->model, resumed.optimizer());
          const std::vector<float> got = resumed.train(6, 12);
          TORCH_CHECK(got == expected, "rank ", rank, ", stage ", stage, ": the resumed run's losses differ");
          TORCH_CHECK(bit_identical(resumed.masters(), straight.masters()), "rank ", rank, ", stage ", stage,
                      ": the resumed run's masters differ");
        },
        2);
  }
}

TEST(ZeroCheckpointTest, AConsolidatedCheckpointLoadsAtOtherWorldSizesAndIntoPlainDdpAmp) {
  LTA_REQUIRE_GLOO();
  ddp_test::ScratchDir dir;
  const std::string path = dir.file("zero4.ckpt");
  // Trained and saved with stage 2 on 4 ranks; the file records what every rank's masters were.
  ddp_test::run_ranks(
      [&](int, const ddp::ProcessGroup& pg) {
        Trainer t(pg, amp::ZeroStage::kTwo);
        t.train(0, 5);
        amp::save_checkpoint(path, t.amp_->model, t.optimizer());
      },
      4);
  // Resumed on 2 ranks with stage 1 and with plain DDP + amp, and on 1 rank with stage 2: the loaded state equals
  // the plain run's, and so does the continuation, bit for bit.
  for (const int world : {2, 1}) {
    ddp_test::run_ranks(
        [&](int rank, const ddp::ProcessGroup& pg) {
          Trainer plain(pg, amp::ZeroStage::kNone, 11);
          amp::load_checkpoint(path, plain.amp_->model, plain.optimizer());
          Trainer sharded(pg, world == 2 ? amp::ZeroStage::kOne : amp::ZeroStage::kTwo, 12);
          amp::load_checkpoint(path, sharded.amp_->model, sharded.optimizer());
          TORCH_CHECK(bit_identical(sharded.masters(), plain.masters()), "rank ", rank, " of ", world,
                      ": loaded masters differ");
          const auto a = plain.train(5, 10), b = sharded.train(5, 10);
          TORCH_CHECK(a == b, "rank ", rank, " of ", world, ": the continuations' losses differ");
          TORCH_CHECK(bit_identical(sharded.masters(), plain.masters()), "rank ", rank, " of ", world,
                      ": the continuations' masters differ");
          // ... and back: what the sharded run saves loads into a plain run as the same state.
          const std::string again = path + ".w" + std::to_string(world);
          amp::save_checkpoint(again, sharded.amp_->model, sharded.optimizer());
          Trainer back(pg, amp::ZeroStage::kNone, 13);
          amp::load_checkpoint(again, back.amp_->model, back.optimizer());
          TORCH_CHECK(bit_identical(back.masters(), sharded.masters()), "rank ", rank, ": saved-again masters differ");
          TORCH_CHECK(back.train(10, 12) == plain.train(10, 12), "rank ", rank, ": the round trip changed the run");
        },
        world);
  }
}

/// The whole file at `path`.
std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

/// The names of the files in `dir` that contain `fragment`.
std::vector<std::string> files_containing(const std::string& dir, const std::string& fragment) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (std::string(e->d_name).find(fragment) != std::string::npos) names.emplace_back(e->d_name);
    }
    ::closedir(d);
  }
  return names;
}

TEST(ZeroCheckpointTest, ACorruptCheckpointFailsOnEveryRankAndChangesNothing) {
  LTA_REQUIRE_GLOO();
  ddp_test::ScratchDir dir;
  const std::string path = dir.file("good.ckpt"), bad = dir.file("bad.ckpt");
  ddp_test::run_ranks(
      [&](int rank, const ddp::ProcessGroup& pg) {
        Trainer t(pg, amp::ZeroStage::kTwo);
        t.train(0, 3);
        amp::save_checkpoint(path, t.amp_->model, t.optimizer());
        pg.barrier();
        if (rank == 0) {  // one flipped bit in the middle of the file
          std::string bytes = file_bytes(path);
          bytes[bytes.size() / 2] ^= 0x10;
          std::ofstream(bad, std::ios::binary) << bytes;
        }
        pg.barrier();
        Trainer other(pg, amp::ZeroStage::kTwo, 5);
        other.train(0, 1);
        const auto before = other.masters();
        const std::string message =
            ddp_test::error_of([&] { amp::load_checkpoint(bad, other.amp_->model, other.optimizer()); });
        TORCH_CHECK(message.find(bad) != std::string::npos, "rank ", rank,
                    ": the error does not name the file: ", message);
        TORCH_CHECK(bit_identical(other.masters(), before), "rank ", rank, ": a refused load changed the masters");
        // A checkpoint of another model shape fails the same way on every rank.
        const std::string missing = ddp_test::error_of(
            [&] { amp::load_checkpoint(dir.file("absent.ckpt"), other.amp_->model, other.optimizer()); });
        TORCH_CHECK(!missing.empty(), "rank ", rank, ": loading a missing file did not fail");
        other.train(1, 2);  // the ranks are still in step: the collectives pair up
      },
      2);
}

TEST(ZeroCheckpointTest, ShardedCheckpointsResumeAtAnyWorldSizeAndReplaceTheirSetAtomically) {
  LTA_REQUIRE_GLOO();
  ddp_test::ScratchDir dir;
  const std::string sharded = dir.file("sharded.ckpt"), consolidated = dir.file("consolidated.ckpt");
  // 4 ranks, stage 2: the same state saved both ways; the sharded save runs twice (the second replaces the first
  // set); the continuation from the sharded file equals the straight run.
  ddp_test::run_ranks(
      [&](int rank, const ddp::ProcessGroup& pg) {
        Trainer t(pg, amp::ZeroStage::kTwo);
        t.train(0, 3);
        amp::save_checkpoint_sharded(sharded, t.amp_->model, t.optimizer());
        t.train(3, 5);
        amp::save_checkpoint_sharded(sharded, t.amp_->model, t.optimizer(), {{"position", "5"}});
        amp::save_checkpoint(consolidated, t.amp_->model, t.optimizer());
        const auto expected = t.train(5, 8);
        Trainer resumed(pg, amp::ZeroStage::kTwo, 9);
        amp::CheckpointExtras extras;
        amp::load_checkpoint(sharded, resumed.amp_->model, resumed.optimizer(), extras);
        TORCH_CHECK(extras.at("position") == "5", "rank ", rank, ": extras not restored");
        TORCH_CHECK(resumed.train(5, 8) == expected, "rank ", rank, ": the resumed run's losses differ");
        TORCH_CHECK(bit_identical(resumed.masters(), t.masters()), "rank ", rank, ": the resumed masters differ");
      },
      4);
  // Only the second set's 4 files remain beside the index.
  EXPECT_EQ(files_containing(dir.path(), ".zero-").size(), 4u);
  // Re-sharded at 2 and 1 ranks: the same state as the consolidated file gives.
  for (const int world : {2, 1}) {
    ddp_test::run_ranks(
        [&](int rank, const ddp::ProcessGroup& pg) {
          Trainer from_sharded(pg, world == 2 ? amp::ZeroStage::kOne : amp::ZeroStage::kTwo, 21);
          amp::load_checkpoint(sharded, from_sharded.amp_->model, from_sharded.optimizer());
          Trainer from_consolidated(pg, amp::ZeroStage::kOne, 22);
          amp::load_checkpoint(consolidated, from_consolidated.amp_->model, from_consolidated.optimizer());
          TORCH_CHECK(bit_identical(from_sharded.masters(), from_consolidated.masters()), "rank ", rank, " of ", world,
                      ": masters differ");
          TORCH_CHECK(from_sharded.train(5, 8) == from_consolidated.train(5, 8), "rank ", rank, " of ", world,
                      ": continuations differ");
        },
        world);
  }
}

TEST(ZeroCheckpointTest, ADamagedOrIncompleteShardedCheckpointFailsOnEveryRankAndChangesNothing) {
  LTA_REQUIRE_GLOO();
  ddp_test::ScratchDir dir;
  const std::string path = dir.file("s.ckpt");
  ddp_test::run_ranks(
      [&](int rank, const ddp::ProcessGroup& pg) {
        Trainer t(pg, amp::ZeroStage::kOne);
        t.train(0, 2);
        amp::save_checkpoint_sharded(path, t.amp_->model, t.optimizer());
        pg.barrier();
        const std::vector<std::string> rank1_files = files_containing(dir.path(), "-1-of-2");
        TORCH_CHECK(rank1_files.size() == 1, "rank ", rank, ": expected one shard file of rank 1, found ",
                    rank1_files.size());
        const std::string shard1 = dir.file(rank1_files[0]);
        const std::string bytes = file_bytes(shard1);
        pg.barrier();
        Trainer other(pg, amp::ZeroStage::kOne, 4);
        other.train(0, 1);
        const auto before = other.masters();
        if (rank == 0) {  // one flipped bit in rank 1's shard
          std::string flipped = bytes;
          flipped[flipped.size() / 2] ^= 0x04;
          std::ofstream(shard1, std::ios::binary) << flipped;
        }
        pg.barrier();
        std::string message =
            ddp_test::error_of([&] { amp::load_checkpoint(path, other.amp_->model, other.optimizer()); });
        TORCH_CHECK(ddp_test::contains_all(message, {shard1}), "rank ", rank, ": ", message);
        TORCH_CHECK(bit_identical(other.masters(), before), "rank ", rank, ": a refused load changed the masters");
        pg.barrier();
        if (rank == 0) std::remove(shard1.c_str());  // a missing shard
        pg.barrier();
        message = ddp_test::error_of([&] { amp::load_checkpoint(path, other.amp_->model, other.optimizer()); });
        TORCH_CHECK(ddp_test::contains_all(message, {"cannot read this shard"}), "rank ", rank, ": ", message);
        TORCH_CHECK(bit_identical(other.masters(), before), "rank ", rank, ": a refused load changed the masters");
        // A sharded checkpoint into a run without ZeRO: refused, with the way out.
        Trainer plain(pg, amp::ZeroStage::kNone, 4);
        message = ddp_test::error_of([&] { amp::load_checkpoint(path, plain.amp_->model, plain.optimizer()); });
        TORCH_CHECK(ddp_test::contains_all(message, {"sharded checkpoint", "ZeroStage", "amp::save_checkpoint"}),
                    message);
        other.train(1, 2);  // the ranks are still in step
      },
      2);
}

}  // namespace
