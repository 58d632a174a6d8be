// --save over an existing checkpoint, with the example stopped in the middle of writing it: the old checkpoint
// must survive whole and still load. The write is stopped by a file-size limit (the writing call gets SIGXFSZ, as
// with `ulimit -f` or a full disk) before its first byte, half way and one byte short of the end.
#include <sys/resource.h>

#include <csignal>
#include <string>
#include <vector>

#include <ddp/launch/worker_group.h>
#include <ddp/process_group.h>
#include <gtest/gtest.h>

#include "python_free_examples/example_process.h"

namespace {

using example_test::ProcessResult;

struct SavingExample {
  std::string name;  // CamelCase: the test's parameter name
  std::vector<std::string> argv;
  bool distributed = false;  // needs Gloo
  bool launched = false;     // expects the launcher's environment
};

std::vector<SavingExample> saving_examples() {
  return {
      {"TrainFashionMnist", {LTA_EXAMPLE_TRAIN_FASHION_MNIST}},
      {"DataParallel", {LTA_EXAMPLE_DATA_PARALLEL}},
      {"DataParallelAmp", {LTA_EXAMPLE_DATA_PARALLEL, "--opt-level", "O2"}},  // amp::save_checkpoint
      {"DdpLaunch", {LTA_EXAMPLE_DDP_LAUNCH}, true, true},
      {"DdpSpawn", {LTA_EXAMPLE_DDP_SPAWN, "--nproc", "1"}, true},
      {"AmpDdp", {LTA_EXAMPLE_AMP_DDP}, true, true},
  };
}

std::vector<std::string> launch_env(const SavingExample& example) {
  if (!example.launched) return {};
  return {"RANK=0",
          "WORLD_SIZE=1",
          "LOCAL_RANK=0",
          "LOCAL_WORLD_SIZE=1",
          "MASTER_ADDR=127.0.0.1",
          "MASTER_PORT=" + std::to_string(ddp::detail::find_free_port())};
}

class AtomicSaveTest : public ::testing::TestWithParam<SavingExample> {};

TEST_P(AtomicSaveTest, AnExampleStoppedWhileSavingLeavesTheOldCheckpointWholeAndLoadable) {
  const SavingExample& example = GetParam();
  if (example.distributed && !ddp::backend_available("gloo")) {
    GTEST_SKIP() << "needs the Gloo backend (apt-get install libgloo-dev)";
  }
  example_test::Scratch scratch;
  const std::string save = scratch.file("model.pt");
  const auto run = [&](const std::vector<std::string>& more, rlim_t limit = RLIM_INFINITY) {
    std::vector<std::string> argv = example.argv;
    for (const char* arg :
         {"--synthetic", "--epochs", "1", "--limit-train", "64", "--batch-size", "64", "--device", "cpu"}) {
      argv.emplace_back(arg);
    }
    argv.insert(argv.end(), more.begin(), more.end());
    return example_test::run_process(argv, launch_env(example), limit);
  };

  const ProcessResult first = run({"--seed", "1", "--save", save});
  ASSERT_EQ(first.exit_code(), 0) << first.describe();
  const std::string old_bytes = example_test::read_file(save);
  ASSERT_GT(old_bytes.size(), 1000u);
  // A different seed: the checkpoint it would write differs from the old one. Its size is not fixed to the byte
  // (torch::optim::SGD saves its per-parameter state in the order of a hash map keyed by tensor addresses, and the
  // zip's 64-byte alignment padding follows that order), so the limits stop the write well inside it: at once,
  // after 4 KiB, and half way.
  const size_t half = old_bytes.size() / 2;
  for (const rlim_t limit : {rlim_t{0}, rlim_t{4096}, rlim_t{half}}) {
    SCOPED_TRACE("file-size limit " + std::to_string(limit) + " bytes");
    const ProcessResult stopped = run({"--seed", "2", "--save", save}, limit);
    EXPECT_NE(stopped.exit_code(), 0) << "the write was not stopped: " << stopped.describe();
    EXPECT_EQ(example_test::read_file(save), old_bytes) << "the old checkpoint was damaged";
  }
  const ProcessResult resumed = run({"--seed", "1", "--resume", save});  // a resume continues its run: same seed
  EXPECT_EQ(resumed.exit_code(), 0) << "the old checkpoint does not load: " << resumed.describe();
}

INSTANTIATE_TEST_SUITE_P(Examples, AtomicSaveTest, ::testing::ValuesIn(saving_examples()),
                         [](const ::testing::TestParamInfo<SavingExample>& info) { return info.param.name; });

}  // namespace
