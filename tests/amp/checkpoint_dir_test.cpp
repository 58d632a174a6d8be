// amp::CheckpointDir (issue 23, item 2): checkpoints named by step in one folder, the newest few kept, and on start
// the newest one that loads, a damaged newer one skipped with a warning naming it.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <amp/io/atomic_file.h>
#include <amp/io/checkpoint_dir.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/ddp_test_util.h"
#include "test_util.h"

namespace {

using test_util::read_file;

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::vector<int64_t> steps_of(const std::vector<amp::CheckpointDir::Entry>& entries) {
  std::vector<int64_t> steps;
  for (const auto& e : entries) steps.push_back(e.step);
  return steps;
}

/// A checkpoint of one tensor, written atomically, whose value tells which step wrote it.
void save_tensor(const std::string& path, int64_t step) {
  torch::serialize::OutputArchive archive;
  archive.write("value", torch::full({64}, static_cast<double>(step)));
  amp::save_archive_atomically(archive, path);
}

int64_t load_tensor(const std::string& path) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  torch::Tensor value;
  archive.read("value", value);
  return static_cast<int64_t>(value[0].item<double>());
}

TEST(CheckpointDirTest, NamesByStepListsNewestFirstAndIgnoresOtherFiles) {
  ddp_test::ScratchDir scratch;
  const amp::CheckpointDir dir(scratch.path(), 3);
  EXPECT_EQ(dir.path_for(42), scratch.path() + "/step-000000000042.pt");
  for (const int64_t step : {5, 300, 40}) save_tensor(dir.path_for(step), step);
  // Not checkpoints of this folder: a killed writer's temporary file, other names, a folder with a checkpoint's name.
  write_file(scratch.file(".step-000000000500.pt.tmp.abc123"), "partial");
  write_file(scratch.file("step-7.pt"), "short name");
  write_file(scratch.file("notes.txt"), "x");
  ASSERT_EQ(::mkdir(scratch.file("step-000000000900.pt").c_str(), 0755), 0);
  EXPECT_EQ(steps_of(dir.list()), (std::vector<int64_t>{300, 40, 5}));
  ::rmdir(scratch.file("step-000000000900.pt").c_str());
  // A folder that does not exist yet holds no checkpoints, and loading from it is a fresh start.
  const amp::CheckpointDir missing(scratch.file("not-yet"), 2);
  EXPECT_TRUE(missing.list().empty());
  EXPECT_FALSE(missing.load_newest([](const std::string&) { FAIL() << "nothing to load"; }).has_value());
}

TEST(CheckpointDirTest, SaveCreatesTheFolderAndKeepsTheNewestKeepLast) {
  ddp_test::ScratchDir scratch;
  const std::string folder = scratch.file("run");
  const amp::CheckpointDir dir(folder, 2);
  std::string written;
  for (const int64_t step : {10, 20, 30}) {
    written = dir.save(step, [&](const std::string& path) {
      save_tensor(path, step);
      write_file(path + ".zero-1-0-of-2", "shard");  // as a sharded ZeRO checkpoint's index and shard
    });
  }
  EXPECT_EQ(written, dir.path_for(30));
  EXPECT_EQ(steps_of(dir.list()), (std::vector<int64_t>{30, 20}));
  // Step 10's shard went with it; the kept ones keep theirs.
  EXPECT_NE(::access((dir.path_for(10) + ".zero-1-0-of-2").c_str(), F_OK), 0);
  EXPECT_EQ(::access((dir.path_for(20) + ".zero-1-0-of-2").c_str(), F_OK), 0);
  ::unlink((dir.path_for(20) + ".zero-1-0-of-2").c_str());
  ::unlink((dir.path_for(30) + ".zero-1-0-of-2").c_str());
  // A write that fails removes nothing, and its exception goes on.
  EXPECT_THROW(dir.save(40, [](const std::string&) { throw std::runtime_error("disk full"); }), std::runtime_error);
  EXPECT_EQ(steps_of(dir.list()), (std::vector<int64_t>{30, 20}));
  for (const auto& entry : dir.list()) ::unlink(entry.path.c_str());
  ::rmdir(folder.c_str());
}

TEST(CheckpointDirTest, BadArgumentsAreOneLine) {
  ddp_test::ScratchDir scratch;
  write_file(scratch.file("a-file"), "x");
  const auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no std::invalid_argument");
  };
  EXPECT_EQ(message([&] { amp::CheckpointDir(scratch.file("a-file")); }),
            "amp::CheckpointDir: '" + scratch.file("a-file") + "' exists and is not a folder");
  EXPECT_EQ(message([&] { amp::CheckpointDir(scratch.path(), 0); }),
            "amp::CheckpointDir: keep_last must be at least 1, got 0");
  EXPECT_EQ(message([&] { amp::CheckpointDir(""); }), "amp::CheckpointDir: the folder name is empty");
}

TEST(CheckpointDirTest, ADamagedNewestIsSkippedWithAWarningAndThePreviousLoads) {
  ddp_test::ScratchDir scratch;
  const amp::CheckpointDir dir(scratch.path(), 5);
  for (const int64_t step : {100, 200, 300}) dir.save(step, [&](const std::string& p) { save_tensor(p, step); });
  const std::string newest = dir.path_for(300);
  const std::string bytes = read_file(newest);
  write_file(newest, bytes.substr(0, bytes.size() / 2));  // cut in half: what a copy or a full disk can leave
  std::vector<std::string> warnings;
  int64_t loaded = -1;
  const auto entry = dir.load_newest([&](const std::string& path) { loaded = load_tensor(path); },
                                     [&](const std::string& line) { warnings.push_back(line); });
  ASSERT_TRUE(entry.has_value());
  EXPECT_EQ(entry->step, 200);
  EXPECT_EQ(loaded, 200);
  ASSERT_EQ(warnings.size(), 1U);
  EXPECT_EQ(warnings[0].rfind("skipping " + newest + ": ", 0), 0U) << warnings[0];
  EXPECT_EQ(warnings[0].find('\n'), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("damaged or truncated zip archive"), std::string::npos) << warnings[0];

  // check_archive_readable finds it as well, without loading into anything.
  EXPECT_THROW(amp::check_archive_readable(newest), std::runtime_error);
  EXPECT_NO_THROW(amp::check_archive_readable(dir.path_for(200)));
  write_file(dir.path_for(200), "not a zip at all");
  try {
    amp::check_archive_readable(dir.path_for(200));
    ADD_FAILURE() << "random bytes passed";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("cannot read '" + dir.path_for(200) + "' as a checkpoint: ", 0), 0U)
        << e.what();
  }

  // None loads: an error naming the folder (each file was warned about).
  write_file(dir.path_for(100), "");
  warnings.clear();
  try {
    dir.load_newest([&](const std::string& path) { amp::check_archive_readable(path); },
                    [&](const std::string& line) { warnings.push_back(line); });
    ADD_FAILURE() << "no checkpoint loads, yet load_newest returned";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "amp::CheckpointDir: none of the 3 checkpoint(s) in '" + scratch.path() +
                                         "' could be loaded (each was named above)");
  }
  EXPECT_EQ(warnings.size(), 3U);
}

// With amp::load_checkpoint as the loader, a flipped bit in the newest file fails its checksum before anything
// changes: the model ends with the previous checkpoint's weights, as if the newest had never been written.
TEST(CheckpointDirTest, WithAmpLoadCheckpointAFlippedBitFallsBackToThePreviousSave) {
  ddp_test::ScratchDir scratch;
  torch::manual_seed(3);
  torch::nn::Linear net(8, 4);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto [model, optimizer] = amp::initialize(net, sgd, amp::Options().opt_level(amp::OptLevel::O0));
  const amp::CheckpointDir dir(scratch.path(), 3);
  std::vector<torch::Tensor> weights_at;
  for (int64_t step = 1; step <= 2; ++step) {
    optimizer.zero_grad();
    auto loss = model(torch::randn({4, 8})).pow(2).mean();
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
    weights_at.push_back(net->weight.detach().clone());
    dir.save(step, [&](const std::string& path) { amp::save_checkpoint(path, model, optimizer); });
  }
  // Flip a bit inside step 2's stored weight.
  const torch::Tensor w = weights_at[1].contiguous();
  const std::string needle(static_cast<const char*>(w.data_ptr()), w.numel() * w.element_size());
  std::string bytes = read_file(dir.path_for(2));
  const size_t at = bytes.find(needle);
  ASSERT_NE(at, std::string::npos);
  bytes[at + needle.size() / 2] ^= 0x10;
  write_file(dir.path_for(2), bytes);
  // verify_checkpoint finds it with no model to load into; the previous file passes.
  try {
    amp::verify_checkpoint(dir.path_for(2));
    ADD_FAILURE() << "a flipped bit passed verify_checkpoint";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("fails its checksum"), std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_NO_THROW(amp::verify_checkpoint(dir.path_for(1)));
  // Train on, so that a load has something to restore.
  torch::NoGradGuard no_grad;
  net->weight.add_(1.0);

  std::vector<std::string> warnings;
  const auto entry = dir.load_newest([&](const std::string& path) { amp::load_checkpoint(path, model, optimizer); },
                                     [&](const std::string& line) { warnings.push_back(line); });
  ASSERT_TRUE(entry.has_value());
  EXPECT_EQ(entry->step, 1);
  EXPECT_TRUE(torch::equal(net->weight, weights_at[0]));
  ASSERT_EQ(warnings.size(), 1U);
  EXPECT_NE(warnings[0].find("fails its checksum"), std::string::npos) << warnings[0];
}

}  // namespace
