// Preemption without lost work (issue 41; docs/clusters.md, "Preemption"): an example told to stop mid-epoch, by the
// SIGTERM of Kubernetes to its launcher or by --stop-signal USR1 to a single rank, stops every rank after the same
// step, saves that step (steps lost: 0) and exits 75; started again with the same command it ends with the final
// checkpoint an unbroken run writes, byte for byte. A signal repeated through the save does not damage it; one
// that comes as the workers start leaves no half-written file. The moment is an event: the signal follows the
// metrics line of a step drawn from the test's seed (LTA_TEST_SEED replays one).
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include <amp/io/checkpoint_dir.h>
#include <ddp/process_group.h>
#include <gtest/gtest.h>

#include "common/example_flags.h"
#include "common/small_cnn.h"
#include "python_free_examples/example_process.h"
#include "test_util.h"

#ifdef LTA_DDP_LAUNCH

namespace {

using example_test::ProcessResult;

/// Where the signal goes.
enum class Target {
  kLauncher,       // the program started (ddp-launch, ddp_spawn's parent, or the one process)
  kOneRank,        // one worker of ddp-launch, drawn from the seed
  kLauncherEarly,  // the launcher, as soon as its first worker exists (before the first step)
};

struct PreemptionCase {
  std::string name;
  std::vector<std::string> command;  // up to the example's own flags
  std::vector<std::string> flags;    // the example's, beyond the shared ones
  Target target = Target::kLauncher;
  int signal = SIGTERM;
  bool repeat = false;         // send it again every 20 ms until the job ends (through the save)
  bool amp_checkpoint = true;  // amp's checkpoints are the same bytes; a plain torch archive orders its records anew
};

void PrintTo(const PreemptionCase& c, std::ostream* os) { *os << c.name; }

// 512 samples in batches of 16: 16 steps per epoch on 2 ranks (32 on one), 2 epochs.
int total_steps(const PreemptionCase& c) {
  const bool one_process = c.command.size() == 1 && c.command.front() != LTA_EXAMPLE_DDP_SPAWN;
  return one_process ? 64 : 32;
}

std::vector<std::string> command(const PreemptionCase& c, const std::string& dir, const std::string& metrics) {
  std::vector<std::string> argv = c.command;
  argv.insert(argv.end(),
              {"--synthetic", "--limit-train", "512", "--batch-size", "16", "--device", "cpu", "--seed", "5",
               "--epochs", "2", "--checkpoint-dir", dir, "--quiet", "--metrics", metrics, "--metrics-every", "1"});
  argv.insert(argv.end(), c.flags.begin(), c.flags.end());
  return argv;
}

/// The number of lines in `path` (0 when it does not exist yet).
int lines_in(const std::string& path) {
  const std::string text = test_util::read_file(path);
  return static_cast<int>(std::count(text.begin(), text.end(), '\n'));
}

/// A plain checkpoint (SmallCnn, SGD with momentum, run state): every parameter, buffer and momentum buffer of
/// `actual` bit for bit `expected`'s, and the same position and generator state.
void expect_same_values(const std::string& expected, const std::string& actual, const std::string& what) {
  const auto load = [](const std::string& path, std::vector<torch::Tensor>& values) {
    examples::SmallCnn net;
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(examples::kSgdMomentum));
    const std::optional<run::RunState> state = examples::load_checkpoint(path, *net, sgd);
    for (const auto& p : net->parameters()) values.push_back(p.detach().clone());
    for (const auto& b : net->buffers()) values.push_back(b.clone());
    for (const auto& p : net->parameters()) {
      const auto& buffer = static_cast<torch::optim::SGDParamState&>(*sgd.state().at(p.unsafeGetTensorImpl()));
      values.push_back(buffer.momentum_buffer().clone());
    }
    EXPECT_TRUE(state.has_value()) << path;
    if (state) {
      values.push_back(torch::tensor({state->position.epoch, state->position.batches_done, state->position.steps}));
      values.push_back(state->cpu_generator_state.clone());
    }
  };
  std::vector<torch::Tensor> a, b;
  load(expected, a);
  load(actual, b);
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "value " << i << "; " << what;
}

class PreemptionTest : public ::testing::TestWithParam<PreemptionCase> {
 protected:
  void SetUp() override {
    if (!ddp::backend_available("gloo")) GTEST_SKIP() << "needs the Gloo backend (apt-get install libgloo-dev)";
  }
  example_test::Scratch scratch_;
};

TEST_P(PreemptionTest, StopsEveryRankAfterTheSameStepSavesItAndTheSameCommandEndsAsTheUnbrokenRun) {
  const PreemptionCase& c = GetParam();
  const amp::CheckpointDir unbroken_dir(scratch_.file("unbroken"));
  const ProcessResult unbroken =
      example_test::run_process(command(c, unbroken_dir.folder(), scratch_.file("unbroken.jsonl")));
  ASSERT_EQ(unbroken.exit_code(), 0) << unbroken.describe();
  const int total = total_steps(c);
  const std::string expected = test_util::read_file(unbroken_dir.path_for(total));
  ASSERT_FALSE(expected.empty()) << unbroken.describe();

  const uint64_t seed = test_util::fresh_seed();
  const int after_line = 2 + static_cast<int>(seed % 6);  // a step's metrics line 2-7: steps are left
  const int victim = static_cast<int>((seed / 6) % 2);
  ::testing::Test::RecordProperty("signal_after_metrics_line", after_line);
  const amp::CheckpointDir dir(scratch_.file("stopped"));
  const std::string metrics = scratch_.file("stopped.jsonl");
  const std::vector<std::string> argv = command(c, dir.folder(), metrics);
  int sent = 0;
  const ProcessResult stopped = example_test::run_process(argv, {}, RLIM_INFINITY, 120, [&](pid_t launcher) {
    if (sent > 0 && !c.repeat) return;
    if (sent == 0) {
      if (c.target == Target::kLauncherEarly) {
        if (test_util::worker_with_rank(launcher, 0) <= 0) return;
      } else if (lines_in(metrics) < after_line) {
        return;
      }
    }
    const pid_t to = c.target == Target::kOneRank ? test_util::worker_with_rank(launcher, victim) : launcher;
    if (to > 0 && ::kill(to, c.signal) == 0) ++sent;
  });
  const std::string what = c.name + ": signal " + std::to_string(c.signal) + " after metrics line " +
                           std::to_string(after_line) + " (seed " + std::to_string(seed) + "), sent " +
                           std::to_string(sent) + " time(s)\n" + stopped.describe();
  ASSERT_GT(sent, 0) << what;
  // No half-written file, whenever it came: every file in the folder is a checkpoint that verifies.
  for (const std::string& name : test_util::folder_entries(dir.folder())) {
    ASSERT_EQ(name.rfind("step-", 0), 0u) << "a stray file " << name << "; " << what;
    EXPECT_NO_THROW(amp::check_archive_readable(dir.folder() + "/" + name)) << name << "; " << what;
  }
  if (c.target == Target::kLauncherEarly && stopped.exit_code() == 128 + c.signal) {
    // It came before the workers watched for it: they ended as any program does, having written nothing.
    EXPECT_TRUE(test_util::folder_entries(dir.folder()).empty()) << what;
  } else {
    ASSERT_EQ(stopped.exit_code(), 75) << what;
    // Steps lost: 0. The ranks stopped after step N, and step N is the checkpoint.
    const std::string mark = "every rank stopped after step ";
    const size_t at = stopped.out.find(mark);
    ASSERT_NE(at, std::string::npos) << what;
    const int step = std::stoi(stopped.out.substr(at + mark.size()));
    EXPECT_LT(step, total) << what;
    EXPECT_FALSE(test_util::read_file(dir.path_for(step)).empty()) << "no checkpoint of step " << step << "; " << what;
    EXPECT_NE(stopped.out.find("and saved it; exit code 75 (resumable): the same command continues the run"),
              std::string::npos)
        << what;
  }

  const ProcessResult resumed = example_test::run_process(argv);
  ASSERT_EQ(resumed.exit_code(), 0) << what << "\n--- resumed: " << resumed.describe();
  if (c.amp_checkpoint) {
    EXPECT_TRUE(test_util::read_file(dir.path_for(total)) == expected)
        << "the final checkpoint differs from the unbroken run's; " << what << "\n--- resumed: " << resumed.describe();
  } else {
    expect_same_values(unbroken_dir.path_for(total), dir.path_for(total), what);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Examples, PreemptionTest,
    ::testing::Values(
        // Kubernetes' SIGTERM to the launcher; ZeRO-2: every rank saves its shard.
        PreemptionCase{"AmpDdpO2ZeroStage2SigtermToTheLauncher",
                       {LTA_DDP_LAUNCH, "--nproc-per-node", "2", "--master-port", "0", LTA_EXAMPLE_AMP_DDP},
                       {"--opt-level", "O2", "--zero", "2"}},
        // Slurm's --signal=USR1 reaching one rank only: the others learn of it through the store.
        PreemptionCase{"AmpDdpUsr1ToOneRank",
                       {LTA_DDP_LAUNCH, "--nproc-per-node", "2", "--master-port", "0", LTA_EXAMPLE_AMP_DDP},
                       {"--opt-level", "O1", "--stop-signal", "USR1"},
                       Target::kOneRank,
                       SIGUSR1},
        // The signal again and again, through the save.
        PreemptionCase{"DdpLaunchSigtermRepeatedThroughTheSave",
                       {LTA_DDP_LAUNCH, "--nproc-per-node", "2", "--master-port", "0", LTA_EXAMPLE_DDP_LAUNCH},
                       {},
                       Target::kLauncher,
                       SIGTERM,
                       true,
                       false},
        PreemptionCase{"AmpDdpSigtermBeforeTheFirstStep",
                       {LTA_DDP_LAUNCH, "--nproc-per-node", "2", "--master-port", "0", LTA_EXAMPLE_AMP_DDP},
                       {},
                       Target::kLauncherEarly},
        PreemptionCase{"DdpSpawnSigtermToTheParent",
                       {LTA_EXAMPLE_DDP_SPAWN, "--nproc", "2"},
                       {},
                       Target::kLauncher,
                       SIGTERM,
                       false,
                       false},
        PreemptionCase{"TrainFashionMnistSigint",
                       {LTA_EXAMPLE_TRAIN_FASHION_MNIST},
                       {"--stop-signal", "INT"},
                       Target::kLauncher,
                       SIGINT,
                       false,
                       false}),
    [](const ::testing::TestParamInfo<PreemptionCase>& info) { return info.param.name; });

}  // namespace

#endif  // LTA_DDP_LAUNCH
