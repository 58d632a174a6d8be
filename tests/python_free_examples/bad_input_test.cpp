// Every example, run as a user would, with each bad input it can meet: a bad flag value, missing or damaged data,
// a damaged --resume file, a device that is not there. Each must end with a non-zero exit and one printable
// line on stderr that names the flag or file, no LibTorch backtrace, and nothing changed on disk.
#include <algorithm>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <ddp/launch/worker_group.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#ifdef LIBTORCH_AMP_HAVE_ZLIB
#include <zlib.h>
#endif

#include "python_free_examples/example_process.h"

namespace {

using example_test::ProcessResult;
using example_test::Scratch;
using Flags = std::vector<std::pair<std::string, std::string>>;  // flag, value ("" for a flag without one)

/// One example program and the flags that select its path (e.g. data_parallel with amp).
struct Example {
  std::string name;  // CamelCase: the test's parameter name
  std::string program;
  Flags flags;
  bool launched = false;  // expects the launcher's environment (RANK, WORLD_SIZE, ...)
};

std::vector<Example> all_examples() {
  return {
      {"TrainFashionMnist", LTA_EXAMPLE_TRAIN_FASHION_MNIST, {}},
      {"DataParallel", LTA_EXAMPLE_DATA_PARALLEL, {}},
      {"DataParallelAmp", LTA_EXAMPLE_DATA_PARALLEL, {{"--opt-level", "O2"}}},
      {"DdpLaunch", LTA_EXAMPLE_DDP_LAUNCH, {}, /*launched=*/true},
      {"DdpSpawn", LTA_EXAMPLE_DDP_SPAWN, {{"--nproc", "1"}}},
      {"AmpDdp", LTA_EXAMPLE_AMP_DDP, {}, /*launched=*/true},
  };
}

/// The quick settings every run starts from: one step on synthetic data on the CPU, and --save over an existing file.
Flags quick_flags(const std::string& save) {
  return {{"--synthetic", ""},    {"--epochs", "1"},   {"--limit-train", "64"},
          {"--batch-size", "64"}, {"--device", "cpu"}, {"--save", save}};
}

/// argv for `example` with the quick settings, the example's own flags, then `overrides` (a flag named there, or
/// in `drop`, is left out of the earlier sets: CLI11 refuses a flag given twice).
std::vector<std::string> command(const Example& example, const std::string& save, const Flags& overrides,
                                 const std::vector<std::string>& drop = {}) {
  std::vector<std::string> argv = {example.program};
  const auto overridden = [&](const std::string& flag) {
    return std::count(drop.begin(), drop.end(), flag) > 0 ||
           std::any_of(overrides.begin(), overrides.end(), [&](const auto& o) { return o.first == flag; });
  };
  const auto append = [&](const Flags& flags, bool skip_overridden) {
    for (const auto& [flag, value] : flags) {
      if (skip_overridden && overridden(flag)) continue;
      argv.push_back(flag);
      if (!value.empty()) argv.push_back(value);
    }
  };
  append(quick_flags(save), true);
  append(example.flags, true);
  append(overrides, false);
  return argv;
}

/// The launcher's environment for a single rank (what ddp-launch --nproc-per-node 1 would export).
std::vector<std::string> launch_env(const Example& example) {
  if (!example.launched) return {};
  return {"RANK=0",
          "WORLD_SIZE=1",
          "LOCAL_RANK=0",
          "LOCAL_WORLD_SIZE=1",
          "MASTER_ADDR=127.0.0.1",
          "MASTER_PORT=" + std::to_string(ddp::detail::find_free_port())};
}

/// One bad input: flags to add (and quick flags to drop), fragments its error line must contain, and the examples
/// it applies to (empty: all).
struct BadInput {
  std::string what;
  Flags flags;
  std::vector<std::string> fragments;
  std::vector<std::string> drop = {};
  std::vector<std::string> only = {};
};

std::string idx_header(const std::vector<uint32_t>& dims) {
  std::string bytes = {0, 0, 0x08, static_cast<char>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) bytes.push_back(static_cast<char>((d >> shift) & 0xff));
  }
  return bytes;
}

std::string random_bytes(size_t n, uint32_t seed) {
  std::string bytes(n, '\0');
  for (auto& b : bytes) {
    seed = seed * 1664525u + 1013904223u;
    b = static_cast<char>(seed >> 24);
  }
  return bytes;
}

#ifdef LIBTORCH_AMP_HAVE_ZLIB
std::string gzip(const std::string& bytes, const std::string& scratch_file) {
  gzFile f = gzopen(scratch_file.c_str(), "wb");
  EXPECT_NE(f, nullptr);
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
  std::string out = example_test::read_file(scratch_file);
  ::unlink(scratch_file.c_str());
  return out;
}
#endif

::testing::AssertionResult is_one_printable_line(const std::string& text) {
  if (text.empty() || text.back() != '\n') return ::testing::AssertionFailure() << "no line ending in newline";
  if (std::count(text.begin(), text.end(), '\n') != 1) return ::testing::AssertionFailure() << "more than one line";
  if (text.find("frame #") != std::string::npos) return ::testing::AssertionFailure() << "a C++ backtrace";
  for (size_t i = 0; i + 1 < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte < 0x20 || byte >= 0x7f) {
      return ::testing::AssertionFailure() << "a non-printable byte " << static_cast<int>(byte) << " at " << i;
    }
  }
  return ::testing::AssertionSuccess();
}

/// The longest --resume error line that still reads at a glance, with the scratch folder's path counted as "DIR"
/// (its length is TMPDIR's choice). A damaged file used to give 400-950 characters: LibTorch's paragraph of advice
/// about miniz and the path twice.
constexpr size_t kMaxErrorLineChars = 200;

/// `text` with every `from` replaced by `to`.
std::string replaced(std::string text, const std::string& from, const std::string& to) {
  for (size_t at = text.find(from); !from.empty() && at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
  }
  return text;
}

size_t count_of(const std::string& text, const std::string& fragment) {
  size_t count = 0;
  for (size_t at = text.find(fragment); at != std::string::npos; at = text.find(fragment, at + 1)) ++count;
  return count;
}

class BadInputTest : public ::testing::TestWithParam<Example> {};

TEST_P(BadInputTest, IsOneLineNamingItNonZeroExitAndNothingWritten) {
  const Example& example = GetParam();
  Scratch scratch;

  // A checkpoint to damage: what train_fashion_mnist --save writes (the same zip archive format as amp's).
  const std::string good = scratch.file("good.pt");
  const ProcessResult made =
      example_test::run_process({LTA_EXAMPLE_TRAIN_FASHION_MNIST, "--synthetic", "--epochs", "1", "--limit-train", "64",
                                 "--batch-size", "64", "--device", "cpu", "--save", good});
  ASSERT_EQ(made.exit_code(), 0) << made.describe();
  const std::string checkpoint = example_test::read_file(good);
  ::unlink(good.c_str());
  const std::string truncated = scratch.file("truncated.pt");
  example_test::write_file(truncated, checkpoint.substr(0, checkpoint.size() / 2));
  const std::string random = scratch.file("random.pt");
  example_test::write_file(random, random_bytes(4096, 7));

  // Fashion-MNIST folders: empty, a raw file shorter than its header says, a .gz cut short, a .gz with junk.
  const std::string no_data = scratch.folder("no_data");
  const std::string short_raw = scratch.folder("short_raw");
  const std::string idx = idx_header({100, 28, 28}) + random_bytes(100 * 28 * 28, 3);
  example_test::write_file(short_raw + "/train-images-idx3-ubyte", idx.substr(0, idx.size() - 1000));
  // What the reader says of a file that is not a whole zip archive (amp's loader adds the size after the first
  // part), miniz's reason in the parentheses.
  const std::string damaged_archive = "damaged or truncated zip archive (";
  std::vector<BadInput> rows = {
      {"--lr nan", {{"--lr", "nan"}}, {"--lr must be a positive finite number, got nan"}},
      {"--lr -1", {{"--lr", "-1"}}, {"--lr must be a positive finite number, got -1"}},
      {"--batch-size 0", {{"--batch-size", "0"}}, {"--batch-size must be a positive integer, got 0"}},
      {"--batch-size abc", {{"--batch-size", "abc"}}, {"--batch-size", "abc"}},
      {"--epochs 0", {{"--epochs", "0"}}, {"--epochs must be a positive integer, got 0"}},
      {"--limit-train -5", {{"--limit-train", "-5"}}, {"--limit-train must be 0 (all) or positive, got -5"}},
      {"unknown flag", {{"--no-such-flag", ""}}, {"--no-such-flag"}},
      {"--save-every 0", {{"--save-every", "0"}}, {"--save-every must be a positive integer, got 0"}},
      {"--save-every -2", {{"--save-every", "-2"}}, {"--save-every must be a positive integer, got -2"}},
      {"--save-every without --save",
       {{"--save-every", "5"}},
       {"--save-every needs --save or --checkpoint-dir (where it writes)"},
       {"--save"}},
      {"--stop-after-steps 0", {{"--stop-after-steps", "0"}}, {"--stop-after-steps must be a positive integer, got 0"}},
      {"missing data", {{"--data", no_data}}, {no_data + "/train-images-idx3-ubyte[.gz] not found"}, {"--synthetic"}},
      {"truncated data",
       {{"--data", short_raw}},
       {short_raw + "/train-images-idx3-ubyte holds 77400 data bytes but its header promises 78400"},
       {"--synthetic"}},
      {"random --resume",
       {{"--resume", random}},
       {"--resume '" + random + "': cannot read it as a checkpoint", damaged_archive}},
      {"truncated --resume",
       {{"--resume", truncated}},
       {"--resume '" + truncated + "': cannot read it as a checkpoint", damaged_archive}},
      {"missing --resume",
       {{"--resume", scratch.file("missing.pt")}},
       {"--resume '" + scratch.file("missing.pt") + "': no such file"}},
      {"--device tpu", {{"--device", "tpu"}}, {"--device 'tpu' is not a device"}},
      {"--save into a missing folder",
       {{"--save", scratch.file("no_folder/model.pt")}},
       {"--save '" + scratch.file("no_folder/model.pt") + "': the folder '" + scratch.file("no_folder") +
        "' does not exist"}},
      {"--metrics into a missing folder",
       {{"--metrics", scratch.file("no_folder/metrics.jsonl")}},
       {"--metrics '" + scratch.file("no_folder/metrics.jsonl") + "': the folder '" + scratch.file("no_folder") +
        "' does not exist"}},
      {"--report is a folder", {{"--report", scratch.path()}}, {"--report '" + scratch.path() + "': it is a folder"}},
      {"--metrics-every 0",
       {{"--metrics", scratch.file("metrics.jsonl")}, {"--metrics-every", "0"}},
       {"--metrics-every must be a positive number of steps, got 0"}},
      {"--timeline-steps 3:2",
       {{"--timeline", scratch.file("trace.json")}, {"--timeline-steps", "3:2"}},
       {"--timeline-steps '3:2': give the steps of the run as A or A:B with 1 <= A <= B"}},
      {"--timeline-steps without --report or --timeline",
       {{"--timeline-steps", "1"}},
       {"--timeline-steps needs --report or --timeline"}},
      {"--timeline-steps too long",
       {{"--report", scratch.file("report.html")}, {"--timeline-steps", "1:100"}},
       {"--timeline-steps '1:100': at most 50 steps"}},
      {"--metrics and --report on one file",
       {{"--metrics", scratch.file("run.out")}, {"--report", scratch.file("run.out")}},
       {"--metrics and --report name the same file '" + scratch.file("run.out") + "'"}},
      {"--metrics-every without --metrics",
       {{"--metrics-every", "5"}},
       {"--metrics-every needs --metrics or --report"}},
      // The quick run takes one step: a window beyond it is refused before training, and no file is written.
      {"--timeline-steps outside the run",
       {{"--report", scratch.file("report.html")}, {"--timeline-steps", "5:9"}},
       {"--timeline-steps '5:9': this run takes steps 1..1 only"}},
      {"--cpu-replicas 0",
       {{"--cpu-replicas", "0"}},
       {"--cpu-replicas must be a positive integer, got 0"},
       {},
       {"DataParallel", "DataParallelAmp"}},
      {"--output-device -1",
       {{"--output-device", "-1"}},
       {"--output-device", "got -1"},
       {},
       {"DataParallel", "DataParallelAmp"}},
      {"--nproc 0", {{"--nproc", "0"}}, {"--nproc must be a positive integer, got 0"}, {}, {"DdpSpawn"}},
      {"--port 70000",
       {{"--port", "70000"}},
       {"--port must be 0 (a free one) or in 1..65535, got 70000"},
       {},
       {"DdpSpawn"}},
      {"--opt-level O9", {{"--opt-level", "O9"}}, {"--opt-level", "O9"}, {}, {"DataParallelAmp", "AmpDdp"}},
      {"--zero 3", {{"--zero", "3"}}, {"--zero", "3"}, {}, {"AmpDdp"}},
  };
  if (!torch::cuda::is_available()) {
    // data_parallel --device cuda used to train on CPU replicas, exit 0 and overwrite --save.
    rows.push_back({"--device cuda without a GPU", {{"--device", "cuda"}}, {"--device cuda: no CUDA GPU is visible"}});
    rows.push_back(
        {"--device cuda:1 without a GPU", {{"--device", "cuda:1"}}, {"--device cuda:1: no CUDA GPU is visible"}});
  }
#ifdef LIBTORCH_AMP_HAVE_ZLIB
  const std::string short_gz = scratch.folder("short_gz");
  const std::string gz = gzip(idx, scratch.file("tmp.gz"));
  example_test::write_file(short_gz + "/train-images-idx3-ubyte.gz", gz.substr(0, gz.size() / 2));
  const std::string junk_gz = scratch.folder("junk_gz");
  example_test::write_file(junk_gz + "/train-images-idx3-ubyte.gz", gz.substr(0, 10) + random_bytes(5000, 11));
  rows.push_back({"truncated .gz",
                  {{"--data", short_gz}},
                  {"cannot decompress Fashion-MNIST file " + short_gz + "/train-images-idx3-ubyte.gz"},
                  {"--synthetic"}});
  rows.push_back({"corrupt .gz",
                  {{"--data", junk_gz}},
                  {"cannot decompress Fashion-MNIST file " + junk_gz + "/train-images-idx3-ubyte.gz"},
                  {"--synthetic"}});
#endif

  const std::string save = scratch.file("existing.pt");
  const std::string old_bytes = "a previous checkpoint that must survive";
  example_test::write_file(save, old_bytes);
  const std::vector<std::string> entries_before = example_test::folder_entries(scratch.path());
  for (const BadInput& row : rows) {
    if (!row.only.empty() && std::count(row.only.begin(), row.only.end(), example.name) == 0) continue;
    SCOPED_TRACE(example.name + " with " + row.what);
    const ProcessResult r = example_test::run_process(command(example, save, row.flags, row.drop), launch_env(example));
    EXPECT_TRUE(r.exited() && r.exit_code() != 0) << r.describe();
    EXPECT_TRUE(is_one_printable_line(r.err)) << r.describe();
    for (const auto& fragment : row.fragments) {
      EXPECT_NE(r.err.find(fragment), std::string::npos) << "'" << fragment << "' not in stderr\n" << r.describe();
    }
    for (const auto& [flag, value] : row.flags) {
      if (flag != "--resume") continue;
      EXPECT_EQ(count_of(r.err, value), 1u) << "the file is named once\n" << r.describe();
      const std::string line = replaced(r.err.substr(0, r.err.find('\n')), scratch.path(), "DIR");
      EXPECT_LE(line.size(), kMaxErrorLineChars) << r.describe();
    }
    EXPECT_EQ(example_test::read_file(save), old_bytes) << "--save was changed";
    EXPECT_EQ(example_test::folder_entries(scratch.path()), entries_before) << "files were added or removed";
  }
}

#ifdef LTA_DDP_LAUNCH
// Under a launcher an error every rank hits alike is said once (issue 39): each rank hands it to the launcher
// (TORCHELASTIC_ERROR_FILE), which prints one line naming the ranks; before, each rank printed it and the launcher
// again (three copies with 2 ranks).
TEST(BadInputUnderLauncherTest, AnErrorEveryRankHitsIsOneLineNamingTheRanks) {
  example_test::Scratch scratch;
  const std::string resume = scratch.file("damaged.pt");
  example_test::write_file(resume, "not a checkpoint");
  for (const char* program : {LTA_EXAMPLE_AMP_DDP, LTA_EXAMPLE_DDP_LAUNCH}) {
    const ProcessResult r = example_test::run_process({LTA_DDP_LAUNCH, "--nproc-per-node", "2", "--master-port", "0",
                                                       program, "--synthetic", "--device", "cpu", "--resume", resume});
    SCOPED_TRACE(program);
    EXPECT_EQ(r.exit_code(), 1) << r.describe();
    EXPECT_EQ(count_of(r.err, "cannot read it as a checkpoint"), 1u) << r.describe();
    EXPECT_TRUE(std::regex_search(r.err, std::regex("^ddp-launch: ranks 0-1 \\(local ranks 0-1, pids [0-9]+, [0-9]+\\) "
                                                    "exited with code 1: --resume '[^']+': cannot read it as a "
                                                    "checkpoint")))
        << r.describe();
  }
}
#endif

INSTANTIATE_TEST_SUITE_P(Examples, BadInputTest, ::testing::ValuesIn(all_examples()),
                         [](const ::testing::TestParamInfo<Example>& info) { return info.param.name; });

}  // namespace
