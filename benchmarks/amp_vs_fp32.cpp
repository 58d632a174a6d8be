// Question: what does mixed precision buy a LibTorch training loop, end to end, and what does amp cost or save
// against the loop a user writes by hand today and against PyTorch's own torch.amp?
//
// Trains the same model on the same batches from the same initial weights under FP32, TF32 (CUDA), and amp's
// O1/O2/O3 with fp16 and bf16 (where the device has them), on two models: the Fashion-MNIST CNN and a small
// transformer on synthetic tokens. In the same run, interleaved with ours, it times two peers on the same model,
// weights and batches: the hand-rolled LibTorch loop (at::autocast + at::_amp_foreach_non_finite_check_and_unscale_
// + at::_amp_update_scale_ + torch::optim) and, when a Python with torch is found, torch.autocast +
// torch.amp.GradScaler (benchmarks/peers/torch_amp_peer.py), which gets our weights, data and batch order as bytes
// (common/peer_bundle.h) and proves it with digests. Prints a table last; writes JSON, CSV and a PNG into
// benchmarks/results/.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <torch/headeronly/version.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <amp/amp.h>
#include <amp/io/atomic_file.h>

#ifdef LIBTORCH_AMP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <run/observer.h>
#include "common/amp_report.h"
#include "common/command_line.h"
#include "common/device_scopes.h"
#include "common/peer_bundle.h"
#include "common/timing.h"
#include "common/torch_amp_peer.h"
#include "common/trainers.h"
#include "common/training_tasks.h"
#include "common/workloads.h"

namespace {

using bench::amp_trainer;
using bench::Batch;
using bench::ForwardFn;
using bench::loop_trainer;
using bench::PeakMemory;
using bench::plain_trainer;
using bench::RunResult;
using bench::Tf32Scope;
using bench::Trainer;

/// The loss a run ends with: the mean over its last steps, since one batch's loss is noisy.
constexpr int64_t kFinalLossWindowSteps = 10;
/// How far the torch.amp peer's final loss may be from our O1 run's (relative) before the run is flagged: both
/// train the same model from the same weights on the same batches under the same autocast, so anything beyond
/// rounding-order noise means the comparison is not like for like. Independent of the CPU's kernels: the peer runs
/// on the same machine, with our environment (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) and thread count, so both
/// sides run the same ATen kernels; they differ only where our loop orders fp32 operations differently (scaler,
/// fused optimizer), which moves each step's rounding (Note [bounds on every CPU kernel path], tests/test_util.h).
/// Measured 0.00-0.01% apart (RESULTS.md); 2% is one-sided enough to catch other weights, batches or a missing
/// unscale (a loss off by far more), not tuned to one CPU.
constexpr double kPeerLossTolerance = 0.02;

struct Config {
  std::string name;  // as printed
  std::string kind;  // "fp32", "tf32", "amp", "loop", "torch.amp" (the Python peer)
  c10::ScalarType dtype = at::kFloat;
  amp::OptLevel level = amp::OptLevel::O0;
  bool fp8 = false;  // kind "amp": amp::Options::fp8 (the models' Float8Linear layers run their GEMMs in FP8)
};

std::string dtype_name(c10::ScalarType dtype) {
  if (dtype == at::kBFloat16) return "bf16";
  if (dtype == at::kHalf) return "fp16";
  return "fp32";
}

// ---- Running one configuration ----------------------------------------------------------------------------

template <typename Task>
Trainer make_trainer(const Task& task, const Config& config, const torch::Device& device) {
  if (config.kind == "amp") return amp_trainer(task, config.level, config.dtype, config.fp8);
  if (config.kind == "loop") return loop_trainer(task, config.dtype, device);
  return plain_trainer(task);
}

std::string error_text(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string text = c10_error ? c10_error->what_without_backtrace() : e.what();
  return text.substr(0, text.find('\n'));  // the first line says what; the rest is context
}

/// The Python peer of one model, shared by its contenders (one per dtype), and the digest its weights must have.
struct PeerLink {
  bench::TorchAmpPeer* process = nullptr;
  std::string weights_digest;  // byte_digest of our initial model state
};

/// One configuration of one model while the matrix runs: ours (trainer) or the Python peer's (peer.process).
struct Contender {
  Config config;
  RunResult result;
  PeerLink peer;
  std::optional<Trainer> trainer;
  at::Tensor losses;  // [steps] fp32 on the device
  int64_t next_step = 0;
  std::vector<double> seconds_per_step;  // one sample per timed round
};

// Note [interleaved rounds]
// The machines these numbers come from are shared (a 2-core VM running other builds swings 3x within a
// minute), so configurations are not timed one after the other: every contender is built and warmed up alone
// (which is also where its peak memory is measured: only its own tensors move then), and the timed steps run
// in rounds, each round giving every contender a few steps in turn. Throughput is the median over rounds, so
// noise hits all configurations alike, as in common/timing.h. Each contender still trains its own model on the
// same batch sequence, so losses and accuracies are those of uninterrupted training.

void with_precision(const Contender& c, const torch::Device& device, const std::function<void()>& body) {
  std::optional<Tf32Scope> tf32;
  if (device.is_cuda()) tf32.emplace(c.config.kind == "tf32");
  body();
}

template <typename Task>
void step_contender(const Task& task, Contender& c, int64_t until_step) {
  for (; c.next_step < until_step; ++c.next_step) {
    c.losses[c.next_step].copy_(c.trainer->step(task.batch(c.next_step)));
  }
}

/// The Python peer's contender: created (its weights checked against ours), then its warmup steps.
void warm_up_peer(Contender& c, int64_t warmup) {
  const auto created = c.peer.process->call("create " + c.result.dtype);
  const std::string digest = created.count("weights") ? created.at("weights") : "none";
  if (digest != c.peer.weights_digest) {
    throw std::runtime_error(
        fmt::format("its initial weights are not ours (digest {}, ours {})", digest, c.peer.weights_digest));
  }
  if (warmup > 0) {
    const auto trained = c.peer.process->call(fmt::format("train {} 0 {}", c.result.dtype, warmup));
    if (trained.count("peak_mib")) c.result.peak_mib = bench::number_field(trained, "peak_mib");
  }
  c.next_step = warmup;
}

/// Builds the contender and runs its warmup steps alone, measuring its peak memory.
template <typename Task>
void warm_up(const Task& task, Contender& c, const torch::Device& device, int64_t warmup) {
  if (c.peer.process != nullptr) return warm_up_peer(c, warmup);
  with_precision(c, device, [&] {
    PeakMemory memory(device);
    c.trainer = make_trainer(task, c.config, device);
    c.losses = torch::empty({task.num_steps()}, torch::TensorOptions().dtype(torch::kFloat).device(device));
    c.trainer->module->train();
    step_contender(task, c, warmup);
    c.result.peak_mib = memory.peak_mib();
  });
}

/// The peer's "finish" reply: its losses, final loss, accuracy and scaler readings.
void finish_peer(Contender& c) {
  RunResult& r = c.result;
  const auto fields = c.peer.process->call("finish " + r.dtype);
  r.final_loss = bench::number_field(fields, "final_loss");
  r.accuracy = bench::number_field(fields, "accuracy");
  r.skipped_steps = static_cast<int64_t>(bench::number_field(fields, "skipped"));
  r.final_scale = bench::number_field(fields, "scale");
  std::istringstream losses(fields.count("losses") ? fields.at("losses") : "");
  std::string value;
  while (std::getline(losses, value, ',')) r.losses.push_back(std::stof(value));
}

/// After the last step: losses, accuracy, scaler readings; then frees the contender's model.
template <typename Task>
void finish(const Task& task, Contender& c, const torch::Device& device) {
  RunResult& r = c.result;
  const int64_t steps = task.num_steps();
  const double step_s = bench::median(c.seconds_per_step);
  r.step_ms = 1e3 * step_s;
  r.samples_per_s = static_cast<double>(task.samples_per_step()) / step_s;
  if (c.peer.process != nullptr) return finish_peer(c);
  auto host = c.losses.cpu();
  r.losses.assign(host.data_ptr<float>(), host.data_ptr<float>() + steps);
  r.final_loss = host.slice(0, steps - std::min(kFinalLossWindowSteps, steps)).mean().item<double>();
  with_precision(c, device, [&] {
    torch::NoGradGuard no_grad;
    c.trainer->module->eval();
    r.accuracy = task.accuracy(c.trainer->forward);
    c.trainer->module->train();
  });
  c.trainer->finish(r);
  c.trainer.reset();
  c.losses = at::Tensor();
}

/// Trains every configuration for task.num_steps() steps: warmup alone, then timed in interleaved rounds of
/// `steps_per_round` steps (Note [interleaved rounds]). Configurations of kind "torch.amp" run in the Python
/// peer `peer` (which waits for its turn as ours do). A configuration that throws is reported, not fatal.
template <typename Task>
std::vector<RunResult> run_configs(const Task& task, const std::vector<Config>& configs, const torch::Device& device,
                                   int64_t warmup, int64_t rounds, const PeerLink& peer) {
  const int64_t steps = task.num_steps();
  warmup = std::clamp<int64_t>(warmup, 0, steps - 1);
  const int64_t steps_per_round = (steps - warmup + rounds - 1) / rounds;
  std::vector<Contender> contenders;
  for (const Config& config : configs) {
    Contender c;
    c.config = config;
    c.result.model = task.name();
    c.result.config = config.name;
    c.result.kind = config.kind;
    c.result.dtype = config.kind == "tf32" ? "tf32" : dtype_name(config.dtype);
    if (config.kind == "torch.amp") c.peer = peer;
    contenders.push_back(std::move(c));
  }
  auto guarded = [&](Contender& c, const std::function<void()>& body) {
    if (!c.result.ok()) return;
    try {
      body();
    } catch (const std::exception& e) {
      c.result.error = (c.peer.process != nullptr ? "torch.amp peer: " : "") + error_text(e);
      c.trainer.reset();
    }
  };
  fmt::print("  warmup ({} steps each, alone):", warmup);
  for (auto& c : contenders) {
    fmt::print(" {}", c.config.name);
    std::fflush(stdout);
    guarded(c, [&] { warm_up(task, c, device, warmup); });
  }
  fmt::print("\n  timing: {} steps each, in rounds of {} steps\n", steps - warmup, steps_per_round);
  std::fflush(stdout);
  for (int64_t begin = warmup; begin < steps; begin += steps_per_round) {
    const int64_t end = std::min(steps, begin + steps_per_round);
    for (auto& c : contenders) {
      guarded(c, [&] {
        if (c.peer.process != nullptr) {  // timed by the peer itself, device synchronized around its steps
          const auto reply = c.peer.process->call(fmt::format("train {} {} {}", c.result.dtype, begin, end));
          c.seconds_per_step.push_back(bench::number_field(reply, "seconds") / static_cast<double>(end - begin));
          c.next_step = end;
          return;
        }
        with_precision(c, device, [&] {
          bench::synchronize(device);
          const auto start = std::chrono::steady_clock::now();
          step_contender(task, c, end);
          bench::synchronize(device);
          const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          c.seconds_per_step.push_back(seconds / static_cast<double>(end - begin));
        });
      });
    }
  }
  std::vector<RunResult> results;
  for (auto& c : contenders) {
    guarded(c, [&] { finish(task, c, device); });
    const RunResult& r = c.result;
    if (r.ok()) {
      fmt::print("  {:<16}{:>10.1f} samples/s  final loss {:.4f}  accuracy {:.2f}%\n", r.config, r.samples_per_s,
                 *r.final_loss, 100.0 * r.accuracy.value_or(0.0));
    } else {
      fmt::print("  {:<16}skipped: {}\n", r.config, r.error);
    }
    results.push_back(r);
  }
  return results;
}

// ---- The matrix ---------------------------------------------------------------------------------------------

std::vector<c10::ScalarType> half_dtypes(const torch::Device& device, bool full) {
  if (!device.is_cuda()) {
    // CPU: bf16 is what CPUs accelerate (AVX512-BF16, AMX); fp16 kernels are sparse and slow, so full mode only.
    if (full) return {at::kBFloat16, at::kHalf};
    return {at::kBFloat16};
  }
#ifdef LIBTORCH_AMP_WITH_CUDA
  constexpr int kFirstBf16Major = 8;  // Ampere
  if (at::cuda::getCurrentDeviceProperties()->major >= kFirstBf16Major) return {at::kBFloat16, at::kHalf};
#endif
  return {at::kHalf};
}

std::vector<Config> our_configs(const torch::Device& device, const std::vector<c10::ScalarType>& dtypes) {
  std::vector<Config> configs = {{"FP32", "fp32"}};
  if (device.is_cuda()) configs.push_back({"TF32", "tf32"});
  for (auto dtype : dtypes) {
    for (auto level : {amp::OptLevel::O1, amp::OptLevel::O2, amp::OptLevel::O3}) {
      configs.push_back({fmt::format("{} {}", amp::opt_level_name(level), dtype_name(dtype)), "amp", dtype, level});
    }
  }
  // FP8 GEMMs on top of O2 bf16 (docs/fp8.md): the models' Float8Linear layers (those the FP8 GEMM takes).
  for (auto dtype : dtypes) {
    if (dtype == at::kBFloat16) configs.push_back({"O2 bf16+FP8", "amp", dtype, amp::OptLevel::O2, true});
  }
  return configs;
}

struct Flags {
  bool full = false;
  std::string device = "auto";
  std::vector<std::string> models = {"cnn", "transformer"};
  int64_t steps = 0;    // > 0: cap on the steps of every run
  int64_t warmup = -1;  // < 0: the mode's default
  bool synthetic = false;
  std::string data_dir = examples::kDefaultFashionMnistDir;
  uint64_t seed = 0;
  std::string out_dir = LTA_RESULTS_DIR;
  std::string python;  // empty: default_python
  std::string peer_script = LTA_PEER_SCRIPT;
  bool no_torch_peer = false;
  bool activation_checkpointing = false;  // the transformer's blocks, in every run and in the peer
  std::string report;                     // empty: <out_dir>/amp_vs_fp32.html
  std::string metrics;
  std::optional<int64_t> metrics_every;  // default: run::default_metrics_every of each run's steps
  int64_t rounds = 8;
  int threads = 0;  // > 0: intra-op threads (ours and the peer's)
};

bench::CnnTask::Settings cnn_settings(const Flags& flags, bool cuda) {
  bench::CnnTask::Settings s;
  s.data_dir = flags.data_dir;
  s.synthetic = flags.synthetic;
  s.seed = flags.seed;
  s.max_steps = flags.steps;
  if (!flags.full) {
    s.train_samples = 3072;  // 24 steps of 128: a few seconds per run on a 2-core CPU
    s.test_samples = 2000;
  } else {
    s.epochs = cuda ? 2 : 1;  // all 60k images; accuracy is compared after the same epochs
  }
  return s;
}

bench::TransformerTask::Settings transformer_settings(const Flags& flags, bool cuda) {
  bench::TransformerTask::Settings s;
  s.seed = flags.seed;
  if (flags.full && cuda) {
    // Big enough that matmuls dominate and half-precision tensor cores matter (~3.5 TFLOP per step).
    s.model.vocab_size(8192).seq_len(512).d_model(1024).num_heads(16);
    s.batch_size = 32;
    s.steps = 60;
  } else if (flags.full) {
    s.model.vocab_size(2048).seq_len(128).d_model(256).num_heads(4);
    s.steps = 60;
  } else {
    s.model.vocab_size(1024).seq_len(64).d_model(256).num_heads(4);
    s.steps = 30;
  }
  if (flags.steps > 0) s.steps = flags.steps;
  s.model.activation_checkpointing(flags.activation_checkpointing);
  return s;
}

std::vector<std::string> peer_model_args(const bench::CnnTask&) { return {}; }
std::vector<std::string> peer_model_args(const bench::TransformerTask& task) {
  const auto& m = task.settings().model;
  std::vector<std::string> args = {
      "--vocab",   std::to_string(m.vocab_size()), "--seq",       std::to_string(m.seq_len()),
      "--d-model", std::to_string(m.d_model()),    "--heads",     std::to_string(m.num_heads()),
      "--layers",  std::to_string(m.num_layers()), "--mlp-ratio", std::to_string(m.mlp_ratio())};
  if (m.activation_checkpointing()) args.push_back("--activation-checkpointing");
  return args;
}

/// Our digest of every step's input and target, in the order the peer digests them.
template <typename Task>
std::string batch_digest(const Task& task) {
  std::vector<at::Tensor> tensors;
  for (int64_t step = 0; step < task.num_steps(); ++step) {
    const Batch b = task.batch(step);
    tensors.push_back(b.input);
    tensors.push_back(b.target);
  }
  return bench::byte_digest(tensors);
}

/// Writes the model's bundle (our initial weights as weights/<name>, the task's data and order) and starts its
/// torch.amp peer on it. Returns nullptr after printing why when the peer cannot run (no Python with torch); throws
/// when it runs but does not see exactly our batches.
template <typename Task>
std::unique_ptr<bench::TorchAmpPeer> start_peer(const Task& task, const Flags& flags, const torch::Device& device,
                                                const bench::NamedTensors& weights, const std::string& bundle_path) {
  bench::NamedTensors bundle = task.peer_data();
  for (const auto& [name, tensor] : weights) bundle.emplace_back("weights/" + name, tensor);
  bench::save_peer_bundle(bundle_path, bundle);
  bench::TorchPeerRequest request;
  request.python = flags.python.empty() ? bench::default_python(LTA_SOURCE_DIR) : flags.python;
  request.script = flags.peer_script;
  request.bundle = bundle_path;
  request.model = task.name();
  request.device = device.str();
  request.threads = at::get_num_threads();
  request.batch_size = task.samples_per_step();
  request.lr = task.settings().lr;
  request.model_args = peer_model_args(task);
  request.log_path = flags.out_dir + "/torch_amp_peer_" + task.name() + ".log";
  fmt::print("  torch.amp peer: {} {} ({} threads)\n", request.python, request.script, request.threads);
  std::fflush(stdout);
  std::string skip_reason;
  auto peer = bench::TorchAmpPeer::start(request, &skip_reason);
  if (peer == nullptr) {
    fmt::print("  torch.amp peer not run: {}\n", skip_reason);
    return nullptr;
  }
  const std::string ours = batch_digest(task);
  if (peer->num_steps() != task.num_steps() || peer->batch_digest() != ours) {
    throw std::runtime_error(fmt::format(
        "the torch.amp peer does not train on our batches: {} steps with digest {}, ours {} steps with digest {}",
        peer->num_steps(), peer->batch_digest(), task.num_steps(), ours));
  }
  fmt::print("  torch.amp peer: same {} batches (digest {}), same initial weights (digest {}) as ours\n",
             task.num_steps(), ours, bench::byte_digest(weights));
  return peer;
}

/// The peer trains what our O1 trains, so their final losses must agree: says how close, and returns false
/// (after saying so loudly) when they are further apart than kPeerLossTolerance.
bool check_peer_loss(const std::vector<RunResult>& results, const std::string& model) {
  bool ok = true;
  for (const RunResult& peer : results) {
    if (peer.model != model || peer.kind != "torch.amp" || !peer.ok() || !peer.final_loss) continue;
    for (const RunResult& ours : results) {
      if (ours.model != model || ours.dtype != peer.dtype || !ours.ok() || !ours.final_loss) continue;
      if (ours.config != "O1 " + peer.dtype && ours.kind != "loop") continue;
      const double apart = std::abs(*peer.final_loss - *ours.final_loss) / std::max(std::abs(*ours.final_loss), 1e-12);
      const bool close = apart <= kPeerLossTolerance;
      fmt::print("  {:<16}final loss {:.4f} vs {} {:.4f}: {:.2f}% apart{}\n", peer.config, *peer.final_loss,
                 ours.config, *ours.final_loss, 100.0 * apart,
                 close ? fmt::format(" (within {:.0f}%)", 100.0 * kPeerLossTolerance)
                       : fmt::format(" -- MORE THAN {:.0f}%: NOT LIKE FOR LIKE", 100.0 * kPeerLossTolerance));
      if (ours.kind == "amp" && !close) ok = false;
    }
  }
  return ok;
}

/// Every configuration of one model and its peers, interleaved, appended to `results`. Returns false when the
/// torch.amp peer's final loss is not close to our O1's (check_peer_loss).
template <typename Task>
bool run_model(const Task& task, const Flags& flags, const torch::Device& device, int64_t warmup,
               std::vector<RunResult>& results) {
  fmt::print("\n{}\n", task.description());
  const auto dtypes = half_dtypes(device, flags.full);
  std::vector<Config> configs = our_configs(device, dtypes);
  for (auto dtype : dtypes) configs.push_back({"loop O1 " + dtype_name(dtype), "loop", dtype});
  std::unique_ptr<bench::TorchAmpPeer> peer;
  PeerLink link;
  const std::string bundle_path = flags.out_dir + "/torch_amp_peer_" + task.name() + ".pt";
  if (!flags.no_torch_peer) {
    typename Task::Net initial = task.make_model();  // what every contender starts from (make_model is seeded)
    const bench::NamedTensors weights = bench::module_state(*initial);
    peer = start_peer(task, flags, device, weights, bundle_path);
    link.weights_digest = bench::byte_digest(weights);
  }
  if (peer != nullptr) {
    link.process = peer.get();
    for (auto dtype : dtypes) configs.push_back({"torch.amp " + dtype_name(dtype), "torch.amp", dtype});
  }
  for (auto& r : run_configs(task, configs, device, warmup, flags.rounds, link)) results.push_back(std::move(r));
  peer.reset();
  std::filesystem::remove(bundle_path);  // it can be large (full mode: the whole data set); the log stays
  return check_peer_loss(results, task.name());
}

std::string cpu_model_name() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

bench::RunContext make_context(const torch::Device& device, bool full) {
  bench::RunContext c;
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M", std::localtime(&now));
  c.date = date;
  c.machine = fmt::format("{} ({} threads, torch uses {})", cpu_model_name(), std::thread::hardware_concurrency(),
                          at::get_num_threads());
#ifdef LIBTORCH_AMP_WITH_CUDA
  if (device.is_cuda()) c.machine += fmt::format("; GPU {}", at::cuda::getCurrentDeviceProperties()->name);
#endif
  c.device = device.str();
  c.mode = full ? "full" : "quick";
  c.torch_version = fmt::format("{}.{}.{}", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
  return c;
}

const char* kLegend =
    "samples/s, step ms: median over interleaved rounds after warmup (CNN: images; transformer: sequences).\n"
    "x FP32 / x TF32: throughput ratio to that run of the same model. peak MiB: CUDA allocator peak above the\n"
    "run's start, measured during its warmup ('-' on CPU: not measured); x mem: to FP32. loss: mean of the last\n"
    "10 steps. acc: CNN test accuracy, transformer held-out next-token accuracy. skipped/scale: overflowed steps\n"
    "and the final loss scale. x loop / x torch: our throughput over the hand-rolled LibTorch autocast loop /\n"
    "torch.autocast + GradScaler (both O1-style, same dtype). Both peers train from our initial weights on our\n"
    "batches in our order (the torch.amp peer gets them as bytes and its digests are checked), with our threads,\n"
    "their timed rounds interleaved with ours; the torch.amp peer times its own steps inside its process.\n";

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"AMP vs FP32: the same training under FP32, TF32 and amp O1/O2/O3, against two peers"};
  app.add_flag("--full", flags.full, "The whole matrix at the full sizes (GPU: fp16 and bf16, larger transformer)");
  app.add_option("--device", flags.device, "auto, cpu, cuda or cuda:N");
  app.add_option("--models", flags.models, "Which models (cnn, transformer)")
      ->delimiter(',')
      ->check(CLI::IsMember({"cnn", "transformer"}));
  app.add_option("--steps", flags.steps, "Cap on the training steps of every run (0: the mode's)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--warmup", flags.warmup, "Untimed steps at the start of each run (default: 3 quick, 10 full)");
  app.add_option("--rounds", flags.rounds, "Timed rounds the steps after warmup are split into (interleaved)")
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", flags.threads,
                 "CPU threads for ours and the torch.amp peer (default: LibTorch's; 1 is steadier on a busy machine)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--synthetic", flags.synthetic, "Train the CNN on generated data instead of Fashion-MNIST");
  app.add_option("--data", flags.data_dir, "Folder with the Fashion-MNIST IDX files");
  app.add_option("--seed", flags.seed, "Seed of the weights and the data order (the same for every run)");
  app.add_option("--out", flags.out_dir, "Folder for amp_vs_fp32.{json,csv,png}");
  app.add_option("--python", flags.python, "Python with torch for the torch.amp peer (default: .venv, else python3)");
  app.add_option("--peer-script", flags.peer_script, "The torch.amp peer script");
  app.add_flag("--no-torch-peer", flags.no_torch_peer, "Do not run the torch.amp peer");
  app.add_flag(
      "--activation-checkpointing", flags.activation_checkpointing,
      "The transformer's blocks under activation checkpointing in every run (the peer: torch.utils.checkpoint)");
  app.add_option("--report", flags.report,
                 "The HTML report (default: amp_vs_fp32.html in --out): summary table and loss curves");
  app.add_option(
      "--metrics", flags.metrics,
      "Also write every run's losses and figures here as JSON lines (after the runs: docs/observability.md)");
  app.add_option("--metrics-every", flags.metrics_every,
                 "A --metrics step line every this many steps and at each run's last; auto: about 100 per run")
      ->default_str("auto");
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;

  try {
    if (flags.threads > 0) at::set_num_threads(flags.threads);
    const torch::Device device = bench::parse_device(flags.device);
    const int64_t warmup = flags.warmup >= 0 ? flags.warmup : (flags.full ? 10 : 3);
    const std::string report_path = flags.report.empty() ? flags.out_dir + "/amp_vs_fp32.html" : flags.report;
    // Checked before the runs, not after them.
    run::ObserveOptions observe;
    observe.report = flags.report;
    observe.metrics = flags.metrics;
    if (flags.metrics_every && flags.metrics.empty()) {
      throw std::invalid_argument("--metrics-every needs --metrics (what it paces)");
    }
    observe.metrics_every = flags.metrics_every;
    run::check_observe_options(observe);
    bench::RunContext context = make_context(device, flags.full);
    fmt::print("AMP vs FP32 on {} ({} mode), {}\nmachine: {} | torch {}\n", context.device, context.mode, context.date,
               context.machine, context.torch_version);
    std::filesystem::create_directories(flags.out_dir);

    std::vector<RunResult> results;
    bool peers_agree = true;
    for (const std::string& model : flags.models) {
      if (model == "cnn") {
        bench::CnnTask task(cnn_settings(flags, device.is_cuda()), device);
        context.task_descriptions.push_back(task.description());
        peers_agree = run_model(task, flags, device, warmup, results) && peers_agree;
      } else {
        bench::TransformerTask task(transformer_settings(flags, device.is_cuda()), device);
        context.task_descriptions.push_back(task.description());
        peers_agree = run_model(task, flags, device, warmup, results) && peers_agree;
      }
    }

    bench::write_json_and_csv(flags.out_dir, context, results);
    const std::string plot = bench::write_plot(flags.out_dir, context, results);
    amp::write_file_atomically(report_path, bench::report_html(context, results));
    if (!flags.metrics.empty()) bench::write_metrics_lines(flags.metrics, results, flags.metrics_every);
    fmt::print("\nresults: {0}/amp_vs_fp32.json, {0}/amp_vs_fp32.csv; {1}; report: {2}{3}\n\n{4}\n", flags.out_dir,
               plot, report_path, flags.metrics.empty() ? "" : "; metrics: " + flags.metrics, kLegend);
    fmt::print("{}", bench::format_table(results));
    if (!peers_agree) {
      std::fprintf(stderr,
                   "bench_amp_vs_fp32: the torch.amp peer's final loss is more than %.0f%% away from our O1's on the "
                   "same weights and batches (lines 'NOT LIKE FOR LIKE' above): its throughput is not comparable\n",
                   100.0 * kPeerLossTolerance);
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_amp_vs_fp32: %s\n", error_text(e).c_str());
    return 1;
  }
  return 0;
}
