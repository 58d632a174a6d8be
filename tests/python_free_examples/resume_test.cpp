// A resumed run equals an unbroken one (docs/examples.md, "Resuming"): each example, run as a user would, trains
// 2 epochs straight; then the same run broken at an epoch boundary (--epochs 1, then --resume --epochs 2) and in the
// middle of epochs (--save-every / --stop-after-steps, resumed twice) must end with a checkpoint whose model is
// bit for bit the straight run's. And a resume that would not continue the run (another --seed, --batch-size,
// number of processes or training samples) is a one-line error naming the flag.
#include <algorithm>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <ostream>
#include <regex>
#include <string>
#include <vector>

#include <amp/amp.h>
#include <amp/io/checkpoint_dir.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/process_group.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/example_flags.h"
#include "common/small_cnn.h"
#include "python_free_examples/example_process.h"
#include "test_util.h"

namespace {

using example_test::ProcessResult;

/// How the test runs one example and reads its checkpoints.
struct ResumingExample {
  std::string name;                   // CamelCase: the test's parameter name
  std::vector<std::string> launcher;  // argv before the example's flags: the program, or the launcher and it
  std::vector<std::string> flags;     // the example's own flags
  int64_t batches_per_epoch = 0;      // with the quick settings below, per process
  bool distributed = false;           // needs Gloo
  bool amp = false;                   // writes amp::save_checkpoint files (O2, bf16 on the CPU)
  bool fused_sgd = false;             // amp's inner optimizer is amp::FusedSGD (else torch::optim::SGD)
  std::string limit_train = "128";    // --limit-train: the training samples
};

void PrintTo(const ResumingExample& example, std::ostream* os) { *os << example.name; }

// 128 samples in batches of 16: 8 batches per epoch on one process, 4 per rank on two.
const std::vector<std::string> kQuick = {"--synthetic", "--limit-train", "128", "--batch-size", "16", "--device",
                                         "cpu",         "--seed",        "3"};

std::vector<ResumingExample> resuming_examples() {
  std::vector<ResumingExample> examples = {
      {"TrainFashionMnist", {LTA_EXAMPLE_TRAIN_FASHION_MNIST}, {}, 8},
      {"DdpSpawnTwoRanks", {LTA_EXAMPLE_DDP_SPAWN}, {"--nproc", "2"}, 4, true},
      // 4 ranks: each element's allreduce adds in an order that depends on the bucket layout (Gloo's ring), so the
      // resumed run must keep the rebuilt layout of the run it continues (RunState::ddp_gradient_order).
      {"DdpSpawnFourRanks", {LTA_EXAMPLE_DDP_SPAWN}, {"--nproc", "4"}, 4, true, false, false, "256"},
      {"DataParallelAmpO2", {LTA_EXAMPLE_DATA_PARALLEL}, {"--opt-level", "O2"}, 8, false, true},
  };
#ifdef LTA_DDP_LAUNCH
  const auto with = [](const char* program, const char* nproc) {
    return std::vector<std::string>{LTA_DDP_LAUNCH, "--nproc-per-node", nproc, "--master-port", "0", program};
  };
  // (ddp_launch trains in the same worker as ddp_spawn: common/ddp_worker.cpp.)
  examples.push_back({"AmpDdpO2TwoRanks", with(LTA_EXAMPLE_AMP_DDP, "2"), {"--opt-level", "O2"}, 4, true, true, true});
  examples.push_back(
      {"AmpDdpO2FourRanks", with(LTA_EXAMPLE_AMP_DDP, "4"), {"--opt-level", "O2"}, 4, true, true, true, "256"});
  // ZeRO: every rank takes part in each save (rank 0 writes the consolidated file) and takes its shard on --resume.
  examples.push_back({"AmpDdpO2ZeroStage2TwoRanks",
                      with(LTA_EXAMPLE_AMP_DDP, "2"),
                      {"--opt-level", "O2", "--zero", "2"},
                      4,
                      true,
                      true,
                      true});
  examples.push_back({"AmpDdpO2ZeroStage1FourRanks",
                      with(LTA_EXAMPLE_AMP_DDP, "4"),
                      {"--opt-level", "O2", "--zero", "1"},
                      4,
                      true,
                      true,
                      true,
                      "256"});
#endif
  return examples;
}

ProcessResult run(const ResumingExample& example, const std::vector<std::string>& more) {
  std::vector<std::string> argv = example.launcher;
  argv.insert(argv.end(), kQuick.begin(), kQuick.end());
  *std::next(std::find(argv.end() - static_cast<std::ptrdiff_t>(kQuick.size()), argv.end(), "--limit-train")) =
      example.limit_train;
  argv.insert(argv.end(), example.flags.begin(), example.flags.end());
  argv.insert(argv.end(), more.begin(), more.end());
  return example_test::run_process(argv);
}

int count_of(const std::string& text, const std::string& fragment) {
  int n = 0;
  for (size_t at = text.find(fragment); at != std::string::npos; at = text.find(fragment, at + 1)) ++n;
  return n;
}

std::vector<int64_t> steps_of(const std::vector<amp::CheckpointDir::Entry>& entries) {
  std::vector<int64_t> steps;
  for (const auto& e : entries) steps.push_back(e.step);
  return steps;
}

/// What a checkpoint holds that the test compares: the model's values (parameters and buffers, fp32: the masters
/// under O2) and the run state.
struct Loaded {
  std::vector<std::pair<std::string, torch::Tensor>> values;
  std::optional<run::RunState> run;
};

Loaded load(const ResumingExample& example, const std::string& path) {
  Loaded loaded;
  torch::manual_seed(99);  // another initialization than the examples': the load must overwrite everything
  examples::SmallCnn net;
  if (example.amp) {
    std::unique_ptr<torch::optim::Optimizer> sgd;
    if (example.fused_sgd) {
      sgd = std::make_unique<amp::FusedSGD>(net->parameters(),
                                            amp::FusedSgdOptions(0.05).momentum(examples::kSgdMomentum));
    } else {
      sgd = std::make_unique<torch::optim::SGD>(net->parameters(),
                                                torch::optim::SGDOptions(0.05).momentum(examples::kSgdMomentum));
    }
    auto [model, optimizer] =
        amp::initialize(net, *sgd, amp::Options().opt_level(amp::OptLevel::O2).half_dtype(torch::kBFloat16));
    loaded.run = examples::load_amp_checkpoint(path, model, optimizer);
    const auto masters = sgd->param_groups()[0].params();  // the fp32 masters, in the module's parameter order
    const auto named = net->named_parameters();
    EXPECT_EQ(masters.size(), named.size());
    for (size_t i = 0; i < masters.size(); ++i) {
      EXPECT_EQ(masters[i].scalar_type(), torch::kFloat) << named[i].key() << " is not an fp32 master";
      loaded.values.emplace_back(named[i].key(), masters[i].detach().clone());
    }
  } else {
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(examples::kSgdMomentum));
    loaded.run = examples::load_checkpoint(path, *net, sgd);
    for (const auto& p : net->named_parameters()) loaded.values.emplace_back(p.key(), p.value().detach().clone());
  }
  for (const auto& b : net->named_buffers()) loaded.values.emplace_back(b.key(), b.value().clone());
  return loaded;
}

/// Every value of `actual` bit for bit equal to `expected`'s, and the same position at the end.
void expect_same_training(const Loaded& expected, const Loaded& actual, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(expected.values.size(), actual.values.size());
  int differing = 0;
  for (size_t i = 0; i < expected.values.size(); ++i) {
    const auto& [name, value] = expected.values[i];
    const torch::Tensor& other = actual.values[i].second;
    if (!torch::equal(value, other)) {
      ++differing;
      ADD_FAILURE() << name << " differs: max |difference| "
                    << (value.to(torch::kDouble) - other.to(torch::kDouble)).abs().max().item<double>();
    }
  }
  EXPECT_EQ(differing, 0) << "of " << expected.values.size() << " tensors";
  ASSERT_TRUE(expected.run.has_value() && actual.run.has_value()) << "a checkpoint without its run state";
  EXPECT_EQ(actual.run->position.epoch, expected.run->position.epoch);
  EXPECT_EQ(actual.run->position.batches_done, expected.run->position.batches_done);
  EXPECT_EQ(actual.run->position.steps, expected.run->position.steps);
}

class ResumeTest : public ::testing::TestWithParam<ResumingExample> {
 protected:
  void SetUp() override {
    if (GetParam().distributed && !ddp::backend_available("gloo")) {
      GTEST_SKIP() << "needs the Gloo backend (apt-get install libgloo-dev)";
    }
  }
  /// The example's 2 epochs unbroken, as the checkpoint it saves at the end (its output in unbroken_out_).
  Loaded train_unbroken() {
    const std::string straight = scratch_.file("straight.pt");
    const ProcessResult unbroken = run(GetParam(), {"--epochs", "2", "--save", straight});
    unbroken_out_ = unbroken.out;
    if (unbroken.exit_code() != 0) {
      ADD_FAILURE() << "the unbroken run failed: " << unbroken.describe();
      return {};
    }
    return load(GetParam(), straight);
  }
  example_test::Scratch scratch_;
  std::string unbroken_out_;
};

/// The "epoch E/2: mean loss L" part of each epoch's result line in `out`.
std::vector<std::string> epoch_losses(const std::string& out) {
  std::vector<std::string> found;
  const std::regex line("epoch [0-9]+/2: mean loss [0-9.]+");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), line); it != std::sregex_iterator(); ++it) {
    found.push_back(it->str());
  }
  return found;
}

TEST_P(ResumeTest, AResumedRunEndsBitIdenticalToAnUnbrokenOne) {
  const ResumingExample& example = GetParam();
  const int64_t total_steps = 2 * example.batches_per_epoch;

  const Loaded expected = train_unbroken();
  ASSERT_FALSE(HasFailure());
  if (expected.run) {
    EXPECT_EQ(expected.run->position.epoch, 3);  // all of epochs 1 and 2 done
    EXPECT_EQ(expected.run->position.batches_done, 0);
    EXPECT_EQ(expected.run->position.steps, total_steps);
  } else {
    ADD_FAILURE() << "the checkpoint has no run state";
  }

  // Broken at the epoch boundary: 1 epoch, then resumed to 2.
  const std::string boundary = scratch_.file("boundary.pt");
  const ProcessResult first = run(example, {"--epochs", "1", "--save", boundary});
  ASSERT_EQ(first.exit_code(), 0) << first.describe();
  const ProcessResult second = run(example, {"--epochs", "2", "--resume", boundary, "--save", boundary});
  ASSERT_EQ(second.exit_code(), 0) << second.describe();
  EXPECT_NE(second.out.find("resuming at epoch 2, batch 0"), std::string::npos) << second.out;
  // The first line is the run's header, alike in every example; the resume says where it continues after it.
  const std::string header = second.out.substr(0, second.out.find('\n'));
  const std::regex header_form(
      "^[0-9]+ process(es)?( \\([a-z]+\\))?, .+ \\| .+ \\| .+, lr .+, batch 16 per process, 2 "
      "epoch\\(s\\) \\| " +
      example.limit_train + " training samples, [0-9]+ test samples");
  EXPECT_TRUE(std::regex_search(header, header_form)) << second.out;
  EXPECT_EQ(second.out.find("resuming at"), header.size() + 1) << second.out;
  EXPECT_EQ(count_of(second.out, "epoch 1/2:"), 0) << "epoch 1 was trained again:\n" << second.out;
  expect_same_training(expected, load(example, boundary), "1 epoch, then resumed to 2");

  // Broken inside epochs: 3 steps (saved by --save-every 1 at each of them, the last save being the only one at
  // step 3), 3 more (saved by --save-every 3 at step 6; for 2 ranks that is inside epoch 2), then to the end.
  const std::string mid = scratch_.file("mid.pt");
  const ProcessResult part1 =
      run(example, {"--epochs", "2", "--save", mid, "--save-every", "1", "--stop-after-steps", "3"});
  ASSERT_EQ(part1.exit_code(), 0) << part1.describe();
  EXPECT_EQ(count_of(part1.out, "saved model"), 3) << "--save-every 1 over 3 steps:\n" << part1.out;
  const Loaded at3 = load(example, mid);
  ASSERT_TRUE(at3.run.has_value());
  EXPECT_EQ(at3.run->position.epoch, 1);
  EXPECT_EQ(at3.run->position.batches_done, 3);
  EXPECT_EQ(at3.run->position.steps, 3);
  const ProcessResult part2 =
      run(example, {"--epochs", "2", "--resume", mid, "--save", mid, "--save-every", "3", "--stop-after-steps", "3"});
  ASSERT_EQ(part2.exit_code(), 0) << part2.describe();
  EXPECT_NE(part2.out.find("resuming at epoch 1, batch 3 of it (step 3 of the run)"), std::string::npos) << part2.out;
  const ProcessResult part3 = run(example, {"--epochs", "2", "--resume", mid, "--save", mid});
  ASSERT_EQ(part3.exit_code(), 0) << part3.describe();
  expect_same_training(expected, load(example, mid), "3 steps, 3 more, then to the end of epoch 2");
  // Each epoch's printed mean loss is the unbroken run's, though the epoch was trained by two or three runs: its
  // losses before a checkpoint travel in the run state.
  EXPECT_EQ(epoch_losses(part1.out + part2.out + part3.out), epoch_losses(unbroken_out_))
      << "unbroken:\n"
      << unbroken_out_ << "resumed:\n"
      << part1.out << part2.out << part3.out;
  EXPECT_EQ(epoch_losses(unbroken_out_).size(), 2u) << unbroken_out_;
}

INSTANTIATE_TEST_SUITE_P(Examples, ResumeTest, ::testing::ValuesIn(resuming_examples()),
                         [](const ::testing::TestParamInfo<ResumingExample>& info) { return info.param.name; });

// --checkpoint-dir (issue 23, item 2): a run stopped after 5 steps (saves at steps 2 and 4 and at the stop, the
// newest 2 kept) and started again with the same command line continues by itself from the newest checkpoint that
// reads. The newest (step 5) is cut in half before the restart, as a full disk or a bad copy can leave it: the
// restart skips it with a warning naming it, continues from step 4, and still ends bit for bit the unbroken run.
class CheckpointDirRestartTest : public ResumeTest {};

TEST_P(CheckpointDirRestartTest, ContinuesFromTheNewestReadableAndEndsBitIdentical) {
  const ResumingExample& example = GetParam();
  const int64_t total_steps = 2 * example.batches_per_epoch;
  const Loaded expected = train_unbroken();
  ASSERT_FALSE(HasFailure());

  const std::string dir = scratch_.file("checkpoints");  // not there yet: the first save makes it
  const amp::CheckpointDir checkpoints(dir);
  const std::vector<std::string> command = {"--epochs",     "2", "--checkpoint-dir", dir,
                                            "--save-every", "2", "--keep-last",      "2"};
  std::vector<std::string> stopped = command;
  stopped.insert(stopped.end(), {"--stop-after-steps", "5"});
  const ProcessResult first = run(example, stopped);
  ASSERT_EQ(first.exit_code(), 0) << first.describe();
  ASSERT_EQ(steps_of(checkpoints.list()), (std::vector<int64_t>{5, 4})) << first.out;  // step 2's was pruned

  const std::string newest = checkpoints.path_for(5);
  const std::string bytes = test_util::read_file(newest);
  std::ofstream(newest, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() / 2);
  const ProcessResult again = run(example, command);
  ASSERT_EQ(again.exit_code(), 0) << again.describe();
  EXPECT_EQ(count_of(again.err, "warning: --checkpoint-dir: skipping " + newest + ": "), 1) << again.describe();
  EXPECT_NE(again.out.find("--checkpoint-dir: continuing from " + checkpoints.path_for(4)), std::string::npos)
      << again.out;
  EXPECT_NE(again.out.find("(step 4 of the run)"), std::string::npos) << again.out;
  ASSERT_FALSE(checkpoints.list().empty());
  EXPECT_EQ(checkpoints.list().front().step, total_steps);
  expect_same_training(expected, load(example, checkpoints.path_for(total_steps)),
                       "5 steps, the newest save damaged, restarted with the same command line");
}

std::vector<ResumingExample> restarting_examples() {
  std::vector<ResumingExample> some;
  for (const auto& example : resuming_examples()) {
    // One process, and (with the launcher) two ranks with amp and with ZeRO's collective save.
    if (example.name == "TrainFashionMnist" || example.name == "AmpDdpO2TwoRanks" ||
        example.name == "AmpDdpO2ZeroStage2TwoRanks") {
      some.push_back(example);
    }
  }
  return some;
}

INSTANTIATE_TEST_SUITE_P(Examples, CheckpointDirRestartTest, ::testing::ValuesIn(restarting_examples()),
                         [](const ::testing::TestParamInfo<ResumingExample>& info) { return info.param.name; });

::testing::AssertionResult is_one_line(const std::string& text) {
  if (std::count(text.begin(), text.end(), '\n') != 1 || text.back() != '\n') {
    return ::testing::AssertionFailure() << "not one line: " << text;
  }
  if (text.find("frame #") != std::string::npos) return ::testing::AssertionFailure() << "a backtrace: " << text;
  return ::testing::AssertionSuccess();
}

// A resume continues the run it was saved from; what would make it another run is refused, naming the flag, and
// the checkpoint is left as it was.
TEST(ResumeMismatchTest, AnotherSeedBatchSizeSampleCountOrProcessCountIsAOneLineError) {
  example_test::Scratch scratch;
  const std::string path = scratch.file("one.pt");
  const ResumingExample single = resuming_examples()[0];
  const ProcessResult made = run(single, {"--epochs", "1", "--save", path, "--stop-after-steps", "2"});
  ASSERT_EQ(made.exit_code(), 0) << made.describe();
  const std::string bytes = example_test::read_file(path);

  struct Case {
    std::vector<std::string> argv;  // replaces the quick flag of the same name
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {{"--seed", "4"}, "the checkpoint was made with --seed 3, this run has --seed 4"},
      {{"--batch-size", "8"}, "the checkpoint was made with --batch-size 16, this run has --batch-size 8"},
      {{"--limit-train", "64"}, "the checkpoint was made on 128 training samples, this run has 64"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.argv[0]);
    std::vector<std::string> argv = {LTA_EXAMPLE_TRAIN_FASHION_MNIST};
    for (size_t i = 0; i < kQuick.size(); ++i) {
      if (kQuick[i] == c.argv[0]) {
        ++i;  // and its value
      } else {
        argv.push_back(kQuick[i]);
      }
    }
    argv.insert(argv.end(), c.argv.begin(), c.argv.end());
    for (const char* arg : {"--epochs", "2", "--resume", path.c_str(), "--save", path.c_str()}) argv.emplace_back(arg);
    const ProcessResult resumed = example_test::run_process(argv);
    EXPECT_EQ(resumed.exit_code(), 1) << resumed.describe();
    EXPECT_TRUE(is_one_line(resumed.err));
    EXPECT_NE(resumed.err.find("--resume '" + path + "': " + c.fragment), std::string::npos) << resumed.err;
    EXPECT_EQ(example_test::read_file(path), bytes) << "the checkpoint changed";
  }

  if (!ddp::backend_available("gloo")) GTEST_SKIP() << "the process-count case needs the Gloo backend";
  const ProcessResult two = run(resuming_examples()[1], {"--epochs", "2", "--resume", path, "--save", path});
  EXPECT_NE(two.exit_code(), 0) << two.describe();
  EXPECT_NE(two.err.find("the checkpoint was made by 1 process(es), this run has 2"), std::string::npos) << two.err;
  EXPECT_EQ(example_test::read_file(path), bytes) << "the checkpoint changed";
}

// A checkpoint written before checkpoints held the run state (model and optimizer only) still loads, as the start
// of epoch 1.
TEST(ResumeMismatchTest, ACheckpointWithoutARunStateStartsAtEpochOne) {
  example_test::Scratch scratch;
  const std::string path = scratch.file("old.pt");
  {
    torch::manual_seed(5);
    examples::SmallCnn net;
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(examples::kSgdMomentum));
    torch::serialize::OutputArchive archive, model_archive, optimizer_archive;
    net->save(model_archive);
    sgd.save(optimizer_archive);
    archive.write("model", model_archive);
    archive.write("optimizer", optimizer_archive);
    archive.save_to(path);
  }
  const ProcessResult resumed = run(resuming_examples()[0], {"--epochs", "1", "--resume", path, "--save", path});
  ASSERT_EQ(resumed.exit_code(), 0) << resumed.describe();
  EXPECT_NE(resumed.out.find("holds no training position"), std::string::npos) << resumed.out;
  EXPECT_NE(resumed.out.find("epoch 1/1:"), std::string::npos) << resumed.out;
  const Loaded after = load(resuming_examples()[0], path);
  ASSERT_TRUE(after.run.has_value());
  EXPECT_EQ(after.run->position.steps, 8);
}

}  // namespace
