// Checkpoints of amp over full sharding (docs/fsdp.md, "Checkpoints"): amp::save_checkpoint writes one consolidated
// file (the model's full fp32 values and the optimizer's state in the unsharded layout); it resumes full sharding bit
// for bit, resumes DDP + amp bit for bit (full sharding trains like it), and loads at another world size and into one
// process. amp::save_checkpoint_sharded writes a file per rank (no gather): it resumes full sharding bit for bit and
// loads at another world size and into a ZeRO run. Gloo on CPU, forked ranks.

#include <dirent.h>
#include <unistd.h>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/fsdp/fully_sharded.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "amp/fully_sharded_amp_test_util.h"
#include "ddp/ddp_test_util.h"
#include "ddp/fully_sharded_test_util.h"
#include "test_util.h"

namespace {

using fsdp_test::Net;
using namespace fsdp_amp_test;

/// The masters and the FusedAdamW state of `path` loaded into one process, unsharded, under amp.
std::vector<torch::Tensor> loaded_in_one_process(const std::string& path, const AmpSetup& setup) {
  Net net = fsdp_test::make_net(21, 0, /*sharded=*/false);
  amp::FusedAdamW inner(net->parameters(), amp::FusedAdamOptions(1e-2).weight_decay(1e-2));
  auto [model, optimizer] = amp::initialize(net, inner, setup.options());
  amp::load_checkpoint(path, model, optimizer);
  std::vector<torch::Tensor> out;
  for (const auto& slot : optimizer.state().slots()) out.push_back(slot.master.detach().clone());
  for (const auto& t : inner.state_tensors()) out.push_back(t.detach().clone());
  return out;
}

/// Trains `setup.steps` steps straight; and 5 steps that end in `save`, then 5 more (to step 10) from a fresh model
/// (other initial values) that `load`s first: the resumed run ends bit for bit where the straight one does, through
/// the skipped step 7. Returns the resumed part's setup.
AmpSetup check_resumes(const ddp::ProcessGroup& pg, int rank, const AmpSetup& setup,
                       const std::function<void(ShardedModel&, amp::Optimizer&)>& save, const Hook& load,
                       const std::string& what, AmpRun* tail_out = nullptr) {
  const AmpRun straight = train_fsdp(pg, rank, setup);
  AmpSetup first = setup;
  first.steps = 5;
  train_fsdp(pg, rank, first, save);
  AmpSetup rest = setup;
  rest.first_step = 5;
  const AmpRun resumed = train_fsdp(pg, rank, rest, nullptr, load, /*seed=*/99);
  AmpRun tail = straight;
  tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 5);
  tail.skipped.erase(tail.skipped.begin(), tail.skipped.begin() + 5);
  TORCH_CHECK(tail.skipped[2] == 1, "rank ", rank, ": the straight run did not skip step 7");
  check_same(resumed, tail, "rank " + std::to_string(rank) + ": " + what);
  if (tail_out != nullptr) *tail_out = tail;
  return rest;
}

/// At `world` ranks, a fresh full sharding model (initial values from `seed`) loads `from` (any kind of checkpoint)
/// and saves it consolidated to `to`, with no step between.
void load_and_save(int world, const AmpSetup& setup, const std::string& from, const std::string& to, uint64_t seed) {
  ddp_test::run_ranks(
      [&](int rank, const ddp::ProcessGroup& pg) {
        AmpSetup none = setup;
        none.steps = 0;
        train_fsdp(
            pg, rank, none,
            [&](ShardedModel& model, amp::Optimizer& optimizer) { amp::save_checkpoint(to, model, optimizer); },
            [&](amp::Optimizer& optimizer) { amp::detail::load_checkpoint(from, optimizer.state()); }, seed);
      },
      world);
}

// Train 10 steps straight; and 5, save, then from a fresh model (other initial values) load and train 5 more: full
// sharding, and DDP + amp from the same file, end bit for bit where the straight run ends (a skipped step among the
// resumed ones). The file loads at 4 ranks and into one process, which hold what the 2 ranks held.
TEST(FullyShardedAmpCheckpointTest, ResumesBitForBitIntoFullShardingAndDdpAmpAtAnyWorldSize) {
  LTA_REQUIRE_GLOO();
  ddp_test::ScratchDir dir;
  const std::string path = dir.file("fsdp.pt");
  const std::string again = dir.file("fsdp_at_4.pt");
  AmpSetup setup;
  setup.steps = 10;
  ddp_test::run_ranks(
      [&](int rank, const ddp::ProcessGroup& pg) {
        const auto load = [&](amp::Optimizer& optimizer) { amp::detail::load_checkpoint(path, optimizer.state()); };
        AmpRun tail;
        const AmpSetup rest = check_resumes(
            pg, rank, setup,
            [&](ShardedModel& model, amp::Optimizer& optimizer) { amp::save_checkpoint(path, model, optimizer); }, load,
            "full sharding resumed", &tail);
        const AmpRun ddp = train_ddp(pg, rank, rest, load);
        check_same(ddp, tail, "rank " + std::to_string(rank) + ": DDP + amp resumed from full sharding's file");
      },
      2);
  // At 4 ranks: load and save again; the second file holds what the first does.
  load_and_save(4, setup, path, again, /*seed=*/5);
  const std::vector<torch::Tensor> at_2 = loaded_in_one_process(path, setup);
  const std::vector<torch::Tensor> at_4 = loaded_in_one_process(again, setup);
  ASSERT_EQ(at_2.size(), at_4.size());
  ASSERT_GT(at_2.size(), 16u) << "no optimizer state was loaded";
  for (size_t i = 0; i < at_2.size(); ++i) EXPECT_TRUE(torch::equal(at_2[i], at_4[i])) << "tensor " << i;
}

/// The files in `folder` whose names contain `part`.
std::vector<std::string> files_with(const std::string& folder, const std::string& part) {
  std::vector<std::string> out;
  DIR* dir = ::opendir(folder.c_str());
  if (dir == nullptr) return out;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.find(part) != std::string::npos) out.push_back(name);
  }
  ::closedir(dir);
  return out;
}

// Train 10 steps straight; and 5, save a sharded checkpoint (each rank writes its own file), then from a fresh model
// load and train 5 more: bit for bit where the straight run ends. The files (2 ranks') load at 4 ranks and into a
// ZeRO stage 2 run of DDP + amp at 3 ranks, whose own sharded files load back into full sharding at 2 ranks: each
// holds exactly what the consolidated file saved at the same step holds.
TEST(FullyShardedAmpCheckpointTest, ShardedFilesResumeBitForBitAndLoadAtAnyWorldSizeAndIntoZero) {
  LTA_REQUIRE_GLOO();
  ddp_test::ScratchDir dir;
  const std::string sharded = dir.file("sharded.pt");
  const std::string consolidated = dir.file("consolidated.pt");
  const std::string from_4 = dir.file("from_4_ranks.pt");
  const std::string from_zero = dir.file("from_zero.pt");
  const std::string zero_sharded = dir.file("zero_sharded.pt");
  const std::string from_zero_sharded = dir.file("from_zero_sharded.pt");
  AmpSetup setup;
  setup.steps = 10;
  ddp_test::run_ranks(
      [&](int rank, const ddp::ProcessGroup& pg) {
        check_resumes(
            pg, rank, setup,
            [&](ShardedModel& model, amp::Optimizer& optimizer) {
              amp::save_checkpoint_sharded(sharded, model, optimizer);
              amp::save_checkpoint(consolidated, model, optimizer);
            },
            [&](amp::Optimizer& optimizer) { amp::detail::load_checkpoint(sharded, optimizer.state()); },
            "full sharding resumed from sharded files");
      },
      2);
  EXPECT_EQ(files_with(dir.path(), "-of-2").size(), 2u) << "one file per rank";
  load_and_save(4, setup, sharded, from_4, /*seed=*/5);
  ddp_test::run_ranks(
      [&](int, const ddp::ProcessGroup& pg) {
        Net net = fsdp_test::make_net(17, 0, /*sharded=*/false);
        amp::FusedAdamW inner(net->parameters(), amp::FusedAdamOptions(1e-2).weight_decay(1e-2));
        auto [model, optimizer] = amp::initialize(net, inner, setup.options());
        ddp::DistributedDataParallel ddp(net, pg);
        optimizer.attach(ddp, amp::ZeroStage::kTwo);
        amp::load_checkpoint(sharded, model, optimizer);
        amp::save_checkpoint(from_zero, model, optimizer);
        amp::save_checkpoint_sharded(zero_sharded, model, optimizer);
      },
      3);
  // And ZeRO's sharded files (3 ranks') into full sharding at 2 ranks.
  load_and_save(2, setup, zero_sharded, from_zero_sharded, /*seed=*/8);
  const std::vector<torch::Tensor> expected = loaded_in_one_process(consolidated, setup);
  ASSERT_GT(expected.size(), 16u) << "no optimizer state was loaded";
  for (const std::string& file : {from_4, from_zero, from_zero_sharded}) {
    const std::vector<torch::Tensor> got = loaded_in_one_process(file, setup);
    ASSERT_EQ(got.size(), expected.size()) << file;
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], expected[i])) << file << ": tensor " << i;
  }
}

/// Two units of 20 parameters (Linear(4, 4)): at 4 ranks each shard is 32 elements, so ranks 2 and 3 hold only
/// padding, of every unit.
struct TinyUnitsImpl : torch::nn::Module {
  TinyUnitsImpl() {
    for (int u = 0; u < 2; ++u) units->push_back(ddp::ShardedUnit(torch::nn::Linear(4, 4)));
    register_module("units", units);
  }
  torch::Tensor forward(const torch::Tensor& x) { return units->forward(x); }
  torch::nn::Sequential units;
};
TORCH_MODULE(TinyUnits);

// A rank that holds no part of any parameter (its shards are all padding) takes whether the optimizer has state, and
// its step count, from the files: a sharded save and load at 4 ranks holds what the run held (a consolidated save
// before and after agree), where before such a rank loaded no state and the next save failed.
TEST(FullyShardedAmpCheckpointTest, ARankHoldingOnlyPaddingLoadsTheStateAndStepCountFromTheFiles) {
  LTA_REQUIRE_GLOO();
  ddp_test::ScratchDir dir;
  const std::string sharded = dir.file("tiny_sharded.pt");
  const std::string before = dir.file("tiny_before.pt");
  const std::string after = dir.file("tiny_after.pt");
  ddp_test::run_ranks(
      [&](int rank, const ddp::ProcessGroup& pg) {
        const auto options = amp::Options().opt_level(amp::OptLevel::O1).half_dtype(torch::kBFloat16);
        {
          torch::manual_seed(1);
          TinyUnits net;
          ddp::FullyShardedDataParallel fsdp(net, pg);
          amp::FusedAdamW inner(fsdp.parameters(), amp::FusedAdamOptions(1e-2));
          auto [model, optimizer] = amp::initialize(fsdp, inner, options);
          for (int step = 0; step < 2; ++step) {
            optimizer.zero_grad();
            {
              auto scaled = amp::scale_loss(model.forward(torch::ones({2, 4}) * (rank + 1)).pow(2).mean(), optimizer);
              scaled.backward();
            }
            optimizer.step();
          }
          amp::save_checkpoint_sharded(sharded, model, optimizer);
          amp::save_checkpoint(before, model, optimizer);
        }
        torch::manual_seed(2);
        TinyUnits net;
        ddp::FullyShardedDataParallel fsdp(net, pg);
        amp::FusedAdamW inner(fsdp.parameters(), amp::FusedAdamOptions(1e-2));
        auto [model, optimizer] = amp::initialize(fsdp, inner, options);
        amp::load_checkpoint(sharded, model, optimizer);
        amp::save_checkpoint(after, model, optimizer);
      },
      4);
  // (A checkpoint's bytes follow from its contents: the same values, state and scalers write the same file.)
  const auto bytes = [](const std::string& file) {
    std::ifstream in(file, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  ASSERT_FALSE(bytes(before).empty());
  EXPECT_TRUE(bytes(before) == bytes(after)) << "the consolidated checkpoint differs after the sharded save and load";
}

// What cannot be saved is refused in one line on every rank, and no file is left: a plain torch::optim optimizer (its
// state cannot be split into parameters), consolidated or sharded.
TEST(FullyShardedAmpCheckpointTest, WhatCannotBeSavedIsRefusedInOneLine) {
  LTA_REQUIRE_GLOO();
  ddp_test::ScratchDir dir;
  const std::string path = dir.file("fsdp.pt");
  ddp_test::run_ranks(
      [&](int rank, const ddp::ProcessGroup& pg) {
        AmpSetup setup;
        setup.opt = Opt::kSgd;
        setup.steps = 1;
        std::string sgd_error, sharded_error;
        train_fsdp(pg, rank, setup, [&](ShardedModel& model, amp::Optimizer& optimizer) {
          try {
            amp::save_checkpoint(path, model, optimizer);
          } catch (const c10::Error& e) {
            sgd_error = e.what_without_backtrace();
          }
          try {
            amp::save_checkpoint_sharded(path, model, optimizer);
          } catch (const c10::Error& e) {
            sharded_error = e.what_without_backtrace();
          }
        });
        for (const std::string& error : {sgd_error, sharded_error}) {
          TORCH_CHECK(error.find("needs one of amp's fused optimizers") != std::string::npos &&
                          error.find('\n') == std::string::npos,
                      "rank ", rank, ": a torch::optim optimizer: '", error, "'");
        }
      },
      2);
  EXPECT_NE(::access(path.c_str(), F_OK), 0) << "a refused save left a file";
  EXPECT_TRUE(files_with(dir.path(), ".zero-").empty()) << "a refused sharded save left a rank's file";
}

}  // namespace
