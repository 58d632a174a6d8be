// Question: data parallel training with mixed precision, our way (python_free_examples/amp_ddp under ddp-launch:
// amp O1 + ddp::DistributedDataParallel + amp::FusedSGD, each bucket unscaled as its allreduce completes) against
// PyTorch's (benchmarks/peers/torch_ddp_peer.py under torchrun: torch.autocast + GradScaler +
// torch.nn.parallel.DistributedDataParallel + torch.optim.SGD; Gloo on the CPU, NCCL on GPUs): how many samples/s
// does each train on the same model, initial weights, data shards and batch size?
//
// This program writes the peer's bundle (amp_ddp's initial weights, its splits, and every rank's order per epoch
// from the same DistributedRandomSampler amp_ddp uses), then starts whole runs of the two in turn, alternating which
// goes first, and reports the median samples/s of each (from the last epoch's progress line, so the first
// epoch's warmup is left out) and their ratio. Every peer rank proves with digests that it trains on our weights
// and batches; the two final losses are compared.
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <amp/io/atomic_file.h>
#include <fmt/format.h>
#include <run/sampler.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "common/command_line.h"
#include "common/example_flags.h"
#include "common/peer_bundle.h"
#include "common/small_cnn.h"
#include "common/timing.h"
#include "common/torch_amp_peer.h"

namespace {

/// How far the peer's last-epoch mean loss may be from ours (relative) before the run is flagged: same model,
/// weights, batches and autocast dtype; only the order of floating-point sums differs. Both sides run on the same
/// machine with the same environment and threads, so the same ATen kernels (Note [bounds on every CPU kernel path],
/// tests/test_util.h): a kernel path changes both alike, and the remaining difference (bucketed vs torch's allreduce
/// order, our fused SGD) is rounding carried along one epoch, far below 2%; other weights or batches are not.
constexpr double kLossTolerance = 0.02;

struct Flags {
  examples::CommonFlags common;
  int nproc = 2;
  int runs = 3;
  int threads = 1;  // OMP_NUM_THREADS of every process (ours and the peer's)
  std::string opt_level = "O1";
  std::string dtype = "bf16";
  std::string ddp_launch = LTA_DDP_LAUNCH;
  std::string amp_ddp = LTA_AMP_DDP;
  std::string python;    // empty: default_python
  std::string torchrun;  // empty: next to the python
  std::string peer_script = LTA_DDP_PEER_SCRIPT;
  std::string out_dir = LTA_RESULTS_DIR;
};

/// What one whole run printed that we compare.
struct RunOutcome {
  std::string error;  // non-empty: the run failed, and why
  double samples_per_s = 0.0;
  double mean_loss = 0.0, accuracy_percent = 0.0;
};

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

/// Runs `command` (stdout and stderr together into `log_path`) and returns its exit status.
int run_logged(const std::string& command, const std::string& log_path, std::string* output) {
  const int status = std::system((command + " >" + shell_quote(log_path) + " 2>&1").c_str());
  std::ifstream in(log_path);
  output->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/// The last epoch's figures from amp_ddp's (or the peer's, which mirrors it) output.
RunOutcome parse_outcome(const std::string& output, int exit_code, const std::string& log_path) {
  RunOutcome r;
  const std::regex speed(R"(\| ([0-9.]+) samples/s)");
  const std::regex result(R"(epoch [0-9]+/[0-9]+: mean loss ([0-9.eE+-]+|nan|inf) \| test accuracy ([0-9.]+)%)");
  std::optional<double> sps;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), speed); it != std::sregex_iterator(); ++it) {
    sps = std::stod((*it)[1]);
  }
  std::smatch last;
  bool found = false;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), result); it != std::sregex_iterator(); ++it) {
    last = *it;
    found = true;
  }
  if (exit_code != 0 || !sps || !found) {
    r.error =
        fmt::format("exit status {}{} (output in {})", exit_code, sps && found ? "" : ", no result line", log_path);
    return r;
  }
  r.samples_per_s = *sps;
  r.mean_loss = std::stod(last[1]);
  r.accuracy_percent = std::stod(last[2]);
  return r;
}

/// amp_ddp's flags for the job `flags` describes.
std::string job_args(const Flags& flags) {
  const auto& c = flags.common;
  // amp_ddp's "auto" puts rank R on cuda:R ("cuda" alone would put every rank on the current device).
  const std::string device = c.device == "cuda" ? "auto" : c.device;
  std::string args = fmt::format("--epochs {} --batch-size {} --lr {} --seed {} --limit-train {} --device {}", c.epochs,
                                 c.batch_size, c.lr, c.seed, c.limit_train, device);
  if (c.synthetic) args += " --synthetic";
  return args + " --data " + shell_quote(c.data_dir);
}

/// Writes the bundle and returns, per rank, the digest of the batches it trains on (all epochs, in order), and
/// the initial weights' digest.
std::pair<std::vector<std::string>, std::string> write_bundle(const Flags& flags, const std::string& path) {
  const auto& c = flags.common;
  // As amp_ddp: the seed, then the data, then the model, so the model's initialization draws the same numbers.
  torch::manual_seed(c.seed);
  const examples::Data data = examples::load_data(c);
  examples::SmallCnn net;
  bench::NamedTensors bundle = {{"train_images", data.train.images},
                                {"train_labels", data.train.labels},
                                {"test_images", data.test.images},
                                {"test_labels", data.test.labels}};
  const bench::NamedTensors weights = bench::module_state(*net);
  for (const auto& [name, tensor] : weights) bundle.emplace_back("weights/" + name, tensor);
  std::vector<std::string> batch_digests;
  for (int rank = 0; rank < flags.nproc; ++rank) {
    std::vector<at::Tensor> batches;
    // The examples' sampler: this rank's shard of each epoch, in batches.
    run::DistributedSampler sampler(data.train.images.size(0), c.batch_size, rank, flags.nproc);
    for (int epoch = 1; epoch <= c.epochs; ++epoch) {
      sampler.set_epoch(epoch);
      std::vector<at::Tensor> order;
      while (const auto idx = sampler.next()) {
        order.push_back(*idx);
        batches.push_back(data.train.images.index_select(0, *idx));
        batches.push_back(data.train.labels.index_select(0, *idx));
      }
      bundle.emplace_back(fmt::format("order/e{}/r{}", epoch, rank), torch::cat(order));
    }
    batch_digests.push_back(bench::byte_digest(batches));
  }
  bench::save_peer_bundle(path, bundle);
  return {batch_digests, bench::byte_digest(weights)};
}

/// Checks every peer rank's "peer rank R: weights=... batches=..." line against ours; returns why not, or "".
std::string check_peer_digests(const std::string& output, const std::vector<std::string>& batch_digests,
                               const std::string& weights_digest) {
  const std::regex line(R"(peer rank ([0-9]+): weights=([0-9a-f]+) batches=([0-9a-f]+))");
  std::vector<bool> seen(batch_digests.size(), false);
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line); it != std::sregex_iterator(); ++it) {
    const auto rank = static_cast<size_t>(std::stoul((*it)[1]));
    if (rank >= seen.size()) return fmt::format("the peer reports rank {} of {}", rank, seen.size());
    if ((*it)[2] != weights_digest) {
      return fmt::format("peer rank {} starts from other weights (digest {}, ours {})", rank, (*it)[2].str(),
                         weights_digest);
    }
    if ((*it)[3] != batch_digests[rank]) {
      return fmt::format("peer rank {} trains on other batches (digest {}, ours {})", rank, (*it)[3].str(),
                         batch_digests[rank]);
    }
    seen[rank] = true;
  }
  for (size_t rank = 0; rank < seen.size(); ++rank) {
    if (!seen[rank]) return fmt::format("peer rank {} printed no digests", rank);
  }
  return "";
}

double median_of(const std::vector<RunOutcome>& runs) {
  std::vector<double> v;
  for (const auto& r : runs) {
    if (r.error.empty()) v.push_back(r.samples_per_s);
  }
  return bench::median(v);
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  flags.common.epochs = 2;          // the last epoch is timed; the first is warmup
  flags.common.limit_train = 8192;  // 32 steps per rank per epoch at batch 128: seconds per run on a 2-core CPU
  flags.common.device = "cpu";
  CLI::App app{"amp_ddp under ddp-launch against PyTorch DDP + torch.amp under torchrun, same data and weights"};
  app.add_option("--data", flags.common.data_dir, "Folder with the Fashion-MNIST IDX files");
  app.add_flag("--synthetic", flags.common.synthetic, "Generated data instead of Fashion-MNIST");
  app.add_option("--epochs", flags.common.epochs, "Epochs per run (the last one is timed)")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", flags.common.batch_size, "Batch size per process")->check(CLI::PositiveNumber);
  app.add_option("--lr", flags.common.lr, "Learning rate")->check(CLI::PositiveNumber);
  app.add_option("--seed", flags.common.seed, "Seed of the weights and the data order");
  app.add_option("--limit-train", flags.common.limit_train, "Training samples (0: all)")->check(CLI::NonNegativeNumber);
  app.add_option("--device", flags.common.device, "cpu (Gloo) or cuda (NCCL, one GPU per process)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--nproc", flags.nproc, "Processes per run")->check(CLI::PositiveNumber);
  app.add_option("--runs", flags.runs, "Whole runs of each, alternating")->check(CLI::PositiveNumber);
  app.add_option("--threads", flags.threads, "OMP_NUM_THREADS of every process")->check(CLI::PositiveNumber);
  app.add_option("--dtype", flags.dtype, "Autocast dtype")->check(CLI::IsMember({"bf16", "fp16"}));
  app.add_option("--ddp-launch", flags.ddp_launch, "Our launcher");
  app.add_option("--amp-ddp", flags.amp_ddp, "python_free_examples/amp_ddp");
  app.add_option("--python", flags.python, "Python with torch (default: .venv, else python3)");
  app.add_option("--torchrun", flags.torchrun, "torchrun (default: next to --python)");
  app.add_option("--peer-script", flags.peer_script, "The DDP peer script");
  app.add_option("--out", flags.out_dir, "Folder for ddp_vs_torch_ddp.csv, the bundle and the logs");
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;

  try {
    const std::string python = flags.python.empty() ? bench::default_python(LTA_SOURCE_DIR) : flags.python;
    std::string torchrun = flags.torchrun;
    if (torchrun.empty()) {
      const auto dir = std::filesystem::path(python).parent_path();
      torchrun = dir.empty() ? "torchrun" : (dir / "torchrun").string();
    }
    std::filesystem::create_directories(flags.out_dir);
    const std::string bundle_path = flags.out_dir + "/torch_ddp_peer.pt";
    const auto [batch_digests, weights_digest] = write_bundle(flags, bundle_path);

    const std::string env = fmt::format("OMP_NUM_THREADS={} ", flags.threads);
    const std::string ours_command =
        env + fmt::format("{} --nproc-per-node {} --master-port 0 {} {} --opt-level {} --dtype {} --optimizer sgd",
                          shell_quote(flags.ddp_launch), flags.nproc, shell_quote(flags.amp_ddp), job_args(flags),
                          flags.opt_level, flags.dtype);
    const std::string peer_command =
        env + fmt::format(
                  "{} --standalone --nproc-per-node {} {} --bundle {} --epochs {} --batch-size {} --lr {} "
                  "--dtype {} --device {}",
                  shell_quote(torchrun), flags.nproc, shell_quote(flags.peer_script), shell_quote(bundle_path),
                  flags.common.epochs, flags.common.batch_size, flags.common.lr, flags.dtype, flags.common.device);
    fmt::print("ours: {}\npeer: {}\n{} alternating runs each, {} processes, {} thread(s) each\n\n", ours_command,
               peer_command, flags.runs, flags.nproc, flags.threads);

    std::vector<RunOutcome> ours, peer;
    std::string peer_problem;
    for (int run = 0; run < flags.runs; ++run) {
      // ABBA: who goes first alternates, so a drift in the machine's load does not favour either.
      for (int turn = 0; turn < 2; ++turn) {
        const bool ours_now = (turn == 0) == (run % 2 == 0);
        const std::string log =
            fmt::format("{}/ddp_vs_torch_ddp_{}_{}.log", flags.out_dir, ours_now ? "ours" : "peer", run);
        std::string output;
        const int code = run_logged(ours_now ? ours_command : peer_command, log, &output);
        RunOutcome r = parse_outcome(output, code, log);
        if (!ours_now && r.error.empty()) {
          const std::string problem = check_peer_digests(output, batch_digests, weights_digest);
          if (!problem.empty()) r.error = problem;
        }
        fmt::print("run {} {:<5} {}\n", run + 1, ours_now ? "ours" : "peer",
                   r.error.empty() ? fmt::format("{:8.0f} samples/s  last-epoch mean loss {:.4f}  accuracy {:.2f}%",
                                                 r.samples_per_s, r.mean_loss, r.accuracy_percent)
                                   : "FAILED: " + r.error);
        std::fflush(stdout);
        (ours_now ? ours : peer).push_back(r);
      }
    }
    std::filesystem::remove(bundle_path);

    const auto failed = [](const std::vector<RunOutcome>& v) {
      return std::any_of(v.begin(), v.end(), [](const RunOutcome& r) { return !r.error.empty(); });
    };
    if (failed(ours) || failed(peer)) {
      std::fprintf(stderr, "bench_ddp_vs_torch_ddp: a run failed (lines 'FAILED' above)\n");
      return 1;
    }
    const double ours_sps = median_of(ours), peer_sps = median_of(peer);
    const double loss_apart = std::abs(peer.back().mean_loss - ours.back().mean_loss) / std::abs(ours.back().mean_loss);
    fmt::print("\n{:<44} {:>10} {:>10} {:>8}\n{:<44} {:>10.0f} {:>10.0f} {:>7.2f}x\n", "samples/s (median of runs)",
               "ours", "torch DDP", "ours/torch",
               fmt::format("{} x {} {} {}, batch {}/process", flags.nproc, flags.common.device, flags.opt_level,
                           flags.dtype, flags.common.batch_size),
               ours_sps, peer_sps, ours_sps / peer_sps);
    fmt::print("last-epoch mean loss: ours {:.4f}, torch DDP {:.4f} ({:.2f}% apart); accuracy {:.2f}% vs {:.2f}%\n",
               ours.back().mean_loss, peer.back().mean_loss, 100.0 * loss_apart, ours.back().accuracy_percent,
               peer.back().accuracy_percent);
    std::ostringstream csv;
    csv << "side,run,samples_per_s,mean_loss,accuracy_percent\n";
    for (size_t i = 0; i < ours.size(); ++i) {
      csv << "ours," << i + 1 << ',' << ours[i].samples_per_s << ',' << ours[i].mean_loss << ','
          << ours[i].accuracy_percent << '\n';
      csv << "torch_ddp," << i + 1 << ',' << peer[i].samples_per_s << ',' << peer[i].mean_loss << ','
          << peer[i].accuracy_percent << '\n';
    }
    amp::write_file_atomically(flags.out_dir + "/ddp_vs_torch_ddp.csv", csv.str());
    fmt::print("per run: {}/ddp_vs_torch_ddp.csv\n", flags.out_dir);
    if (loss_apart > kLossTolerance) {
      std::fprintf(stderr,
                   "bench_ddp_vs_torch_ddp: the peer's loss is %.2f%% away from ours (more than %.0f%%) on the same "
                   "weights and batches: NOT LIKE FOR LIKE\n",
                   100.0 * loss_apart, 100.0 * kLossTolerance);
      return 1;
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "bench_ddp_vs_torch_ddp: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_ddp_vs_torch_ddp: %s\n", e.what());
    return 1;
  }
  return 0;
}
