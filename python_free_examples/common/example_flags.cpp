#include "common/example_flags.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <amp/io/checkpoint_dir.h>
#include <ddp/launch/cluster_env.h>
#include <ddp/launch/error_file.h>
#include <ddp/progress.h>
#include <fmt/format.h>
#include <run/stop_signal.h>

namespace examples {

namespace {
constexpr int64_t kSyntheticTrain = 6000;
constexpr int64_t kSyntheticTest = 1000;
constexpr int64_t kEvalBatch = 1000;
}  // namespace

void add_common_flags(CLI::App& app, CommonFlags& flags) {
  app.option_defaults()->always_capture_default();  // --help shows "--batch-size INT=128", and so on
  app.add_option("--data", flags.data_dir, "Folder with the Fashion-MNIST IDX files (.gz or not)");
  app.add_flag("--synthetic", flags.synthetic,
               "Use generated data with the same shapes instead of the data set (a learnable task: each class has its "
               "own pattern; training and test samples come from the same distribution)");
  app.add_option("--epochs", flags.epochs, "Epochs (> 0)");
  app.add_option("--batch-size", flags.batch_size, "Batch size per process (> 0)");
  app.add_option("--global-batch-size", flags.global_batch_size,
                 "Batch size of the whole job, split evenly among the processes; replaces --batch-size. The data order "
                 "and the steps do not depend on the number of processes, so the run resumes on another number (an "
                 "elastic job, ddp-launch --nnodes MIN:MAX)")
      ->excludes("--batch-size");
  app.add_option("--lr", flags.lr, "Learning rate (> 0, finite)");
  app.add_option("--seed", flags.seed, "Random seed (model initialization and synthetic data)");
  app.add_option("--limit-train", flags.limit_train, "Train on the first N samples only (0: all)");
  app.add_option("--device", flags.device, "auto, cpu, cuda or cuda:N");
  app.add_option("--save", flags.save, "Write a checkpoint here after training (rank 0), atomically");
  app.add_option("--save-every", flags.save_every,
                 "Also write --save every K optimizer steps of the run (counted over resumes), not only at the end");
  app.add_option("--resume", flags.resume,
                 "Continue the run this checkpoint was saved from, at its epoch and batch (same --seed, --batch-size, "
                 "processes and training samples)");
  app.add_option("--keep-last", flags.keep_last, "Checkpoints --checkpoint-dir keeps (> 0)");
  app.add_option("--checkpoint-dir", flags.checkpoint_dir,
                 "Keep checkpoints in this folder, one per --save-every steps and one at the end (step-<step in 12 "
                 "digits>.pt: step-000000000050.pt for step 50; the "
                 "newest --keep-last kept), and on start continue from the newest one that reads (a damaged newer one "
                 "is skipped with a warning); replaces --save and --resume");
  app.add_flag("--quiet", flags.quiet, "No progress line (the header, saves and each epoch's result still print)");
  app.add_option("--progress-every", flags.progress_every,
                 "When the output is not a terminal, a progress line every this many seconds (0: every step) and at "
                 "each epoch's end; a terminal gets one line that updates itself");
  app.add_option("--metrics", flags.observe.metrics,
                 "Write the run's metrics here as JSON lines (rank 0): one object per logged step and per epoch "
                 "(docs/observability.md); appended to when the run resumes");
  app.add_option("--metrics-every", flags.observe.metrics_every,
                 "Log every this many steps of the run and its last step (--metrics, --report): the ranks' times are "
                 "gathered then; auto: about 100 logged steps in the run (its steps / 100, at least 1)")
      ->default_str("auto");
  app.add_option("--report", flags.observe.report,
                 "Write one self-contained HTML report of the run here (rank 0): loss, accuracy, throughput, loss "
                 "scale, each rank's step time, and the timeline of --timeline-steps");
  app.add_option(
      "--timeline", flags.observe.timeline,
      "Write the timeline of --timeline-steps here as Chrome trace JSON (rank 0; Perfetto, chrome://tracing)");
  app.add_option("--timeline-steps", flags.observe.timeline_steps,
                 "Steps of the run the timeline records, A:B or A; auto (with --report or --timeline): 3 steps after "
                 "3 of warm-up")
      ->default_str("auto");
  app.add_option("--stop-after-steps", flags.stop_after_steps,
                 "For testing resumption: stop after S optimizer steps of this process, mid-epoch if it falls there, "
                 "and write --save");
  app.add_option("--stop-signal", flags.stop_signal,
                 "With --save or --checkpoint-dir: on this signal (TERM, INT, HUP, QUIT, USR1, USR2, or a list: "
                 "USR1,TERM) every rank stops after the same step, saves it, and the run exits 75 (resumable); with "
                 "--checkpoint-dir the same command then continues, with --save add --resume (docs/clusters.md, "
                 "\"Preemption\")")
      ->default_str("TERM");
  app.add_flag("--requeue", flags.requeue,
               "In a Slurm batch job, with --checkpoint-dir: after a stop on --stop-signal, rank 0 runs `scontrol "
               "requeue $SLURM_JOB_ID`, and the requeued job continues from the checkpoint");
}

std::string run_header_line(const CommonFlags& flags, const Data& data, const RunHeader& header) {
  // (A global batch that does not split among the processes is refused here, before a header with a wrong split.)
  const std::string batch = flags.global_batch_size
                                ? fmt::format("global batch {} ({} per process)", *flags.global_batch_size,
                                              batch_per_process(flags, std::max<int64_t>(header.processes, 1)))
                                : fmt::format("batch {} per process", flags.batch_size);
  // Under a cluster's launcher (Slurm, MPI), where the ranks came from: "launched by slurm: job 1234, ...".
  const auto cluster = header.backend.empty() ? std::nullopt : ddp::cluster_env_from_environment();
  return fmt::format("{} process{}{}, {} | {} | {}, lr {}, {}, {} epoch(s) | {} training samples, {} test samples{}{}",
                     header.processes, header.processes == 1 ? "" : "es",
                     header.backend.empty() ? std::string() : " (" + header.backend + ")", header.where,
                     header.precision, header.optimizer, flags.lr, batch, flags.epochs, data.train.images.size(0),
                     data.test.images.size(0), header.extras, cluster ? " | " + cluster->origin : std::string());
}

int64_t batch_per_process(const CommonFlags& flags, int64_t world_size) {
  if (!flags.global_batch_size) return flags.batch_size;
  if (*flags.global_batch_size % world_size != 0) {
    throw std::invalid_argument(fmt::format("--global-batch-size {} does not split evenly among {} processes",
                                            *flags.global_batch_size, world_size));
  }
  return *flags.global_batch_size / world_size;
}

std::string sgd_description(const std::string& name) { return fmt::format("{} momentum {}", name, kSgdMomentum); }

std::string dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Half:
      return "fp16";
    case c10::ScalarType::BFloat16:
      return "bf16";
    case c10::ScalarType::Float:
      return "fp32";
    default:
      return c10::toString(dtype);
  }
}

amp::Options amp_options(const std::string& opt_level, c10::ScalarType half_dtype, const std::string& fp8) {
  auto options = amp::Options().opt_level(amp::parse_opt_level(opt_level)).half_dtype(half_dtype);
  if (fp8 != "off") {
    options.fp8(amp::Fp8Recipe().scaling(fp8 == "current" ? amp::Fp8Scaling::kCurrent : amp::Fp8Scaling::kDelayed));
  }
  return options;
}

void require_positive(const char* flag, int64_t value) {
  if (value <= 0) throw std::invalid_argument(fmt::format("{} must be a positive integer, got {}", flag, value));
}

void check_common_flags(const CommonFlags& flags) {
  require_positive("--epochs", flags.epochs);
  require_positive("--batch-size", flags.batch_size);
  if (flags.global_batch_size) require_positive("--global-batch-size", *flags.global_batch_size);
  if (!(std::isfinite(flags.lr) && flags.lr > 0)) {
    throw std::invalid_argument(fmt::format("--lr must be a positive finite number, got {}", flags.lr));
  }
  if (!(std::isfinite(flags.progress_every) && flags.progress_every >= 0)) {
    throw std::invalid_argument(fmt::format(
        "--progress-every must be 0 (every step) or a positive number of seconds, got {}", flags.progress_every));
  }
  if (flags.limit_train < 0) {
    throw std::invalid_argument(fmt::format("--limit-train must be 0 (all) or positive, got {}", flags.limit_train));
  }
  require_positive("--keep-last", flags.keep_last);
  if (!flags.checkpoint_dir.empty()) {
    if (!flags.save.empty() || !flags.resume.empty()) {
      throw std::invalid_argument(fmt::format(
          "--checkpoint-dir '{}' replaces --save and --resume: give one or the other", flags.checkpoint_dir));
    }
    struct stat dir_info {};
    if (::stat(flags.checkpoint_dir.c_str(), &dir_info) == 0 && !S_ISDIR(dir_info.st_mode)) {
      throw std::invalid_argument(
          fmt::format("--checkpoint-dir '{}': it is a file, not a folder", flags.checkpoint_dir));
    }
  }
  if (flags.save_every) {
    require_positive("--save-every", *flags.save_every);
    if (flags.save.empty() && flags.checkpoint_dir.empty()) {
      throw std::invalid_argument("--save-every needs --save or --checkpoint-dir (where it writes)");
    }
  }
  if (flags.stop_after_steps) require_positive("--stop-after-steps", *flags.stop_after_steps);
  if (flags.stop_signal) {
    run::parse_stop_signals(*flags.stop_signal);  // throws naming --stop-signal
    if (flags.save.empty() && flags.checkpoint_dir.empty()) {
      throw std::invalid_argument(fmt::format(
          "--stop-signal {} needs --save or --checkpoint-dir: where the stopped run saves", *flags.stop_signal));
    }
  }
  if (flags.requeue) {
    if (flags.checkpoint_dir.empty()) {
      throw std::invalid_argument(
          "--requeue needs --checkpoint-dir: the requeued job runs the same command, which continues from the "
          "newest checkpoint there");
    }
    const char* job = std::getenv("SLURM_JOB_ID");
    if (job == nullptr || *job == '\0') {
      throw std::invalid_argument("--requeue: SLURM_JOB_ID is not set: this is not a Slurm job");
    }
  }
  run::check_observe_options(flags.observe);
  struct stat info {};
  if (!flags.resume.empty()) {
    if (::stat(flags.resume.c_str(), &info) != 0) {
      throw std::invalid_argument(fmt::format("--resume '{}': no such file", flags.resume));
    }
    if (!S_ISREG(info.st_mode)) throw std::invalid_argument(fmt::format("--resume '{}': not a file", flags.resume));
  }
  run::check_output_path("--save", flags.save);  // checked now, not after an hour of training
}

Data load_data(const CommonFlags& flags) {
  Data data;
  if (flags.synthetic) {
    data.train = synthetic_fashion_mnist(kSyntheticTrain, flags.seed, /*train=*/true);
    data.test = synthetic_fashion_mnist(kSyntheticTest, flags.seed, /*train=*/false);
  } else {
    data.train = load_fashion_mnist(flags.data_dir, /*train=*/true);
    data.test = load_fashion_mnist(flags.data_dir, /*train=*/false);
  }
  if (flags.limit_train > 0 && flags.limit_train < data.train.images.size(0)) {
    data.train.images = data.train.images.slice(0, 0, flags.limit_train);
    data.train.labels = data.train.labels.slice(0, 0, flags.limit_train);
  }
  return data;
}

torch::Device pick_device(const std::string& name, int local_rank) {
  if (name == "auto") {
    return torch::cuda::is_available() ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank))
                                       : torch::Device(torch::kCPU);
  }
  std::optional<torch::Device> device;
  try {
    device.emplace(name);
  } catch (const c10::Error&) {
    throw std::invalid_argument(fmt::format("--device '{}' is not a device: use auto, cpu, cuda or cuda:N", name));
  }
  if (device->is_cpu()) return *device;
  if (!device->is_cuda()) {
    throw std::invalid_argument(fmt::format("--device '{}': the examples run on cpu or cuda", name));
  }
  const auto visible = static_cast<int64_t>(torch::cuda::device_count());
  if (visible == 0) {
    throw std::invalid_argument(fmt::format("--device {}: no CUDA GPU is visible (use --device cpu)", name));
  }
  const int64_t index = device->has_index() ? device->index() : local_rank;
  if (index >= visible) {
    throw std::invalid_argument(
        fmt::format("--device {}: cuda:{} asked for, but only {} CUDA GPU(s) are visible", name, index, visible));
  }
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

run::RunState capture_run_state(const CommonFlags& flags, int64_t world_size, int64_t train_samples,
                                const run::TrainingPosition& position, std::vector<int64_t> ddp_gradient_order) {
  run::RunState state;
  state.ddp_gradient_order = std::move(ddp_gradient_order);
  state.position = position;
  state.seed = flags.seed;
  state.batch_size = batch_per_process(flags, world_size);
  state.global_batch_size = flags.global_batch_size.value_or(0);
  state.world_size = world_size;
  state.train_samples = train_samples;
  state.cpu_generator_state = run::cpu_generator_state();
  return state;
}

run::TrainingPosition resume_position(const std::string& path, const std::optional<run::RunState>& saved,
                                      const CommonFlags& flags, int64_t world_size, int64_t train_samples,
                                      const Rank& rank) {
  if (!saved) {
    if (rank.rank == 0) {
      fmt::print(
          "--resume '{}' holds no training position (saved before checkpoints recorded one): training starts "
          "at epoch 1\n",
          path);
    }
    return {};
  }
  const auto differs = [&](const std::string& what) {
    return std::invalid_argument(
        fmt::format("--resume '{}': {} (a resume continues the run it was saved from)", path, what));
  };
  if (saved->seed != flags.seed) {
    throw differs(
        fmt::format("the checkpoint was made with --seed {}, this run has --seed {}", saved->seed, flags.seed));
  }
  const auto global_flag = [](int64_t global) {
    return global > 0 ? fmt::format("--global-batch-size {}", global) : std::string("no --global-batch-size");
  };
  if (saved->global_batch_size != flags.global_batch_size.value_or(0)) {
    throw differs(fmt::format("the checkpoint was made with {}, this run has {}", global_flag(saved->global_batch_size),
                              global_flag(flags.global_batch_size.value_or(0))));
  }
  if (!flags.global_batch_size && saved->batch_size != flags.batch_size) {
    throw differs(fmt::format("the checkpoint was made with --batch-size {}, this run has --batch-size {}",
                              saved->batch_size, flags.batch_size));
  }
  if (flags.global_batch_size && saved->world_size != world_size && rank.rank == 0) {
    fmt::print(
        "resuming on {} process(es), saved on {}: the same samples per step (--global-batch-size {}), {} per process "
        "now; the sums run in another order, so the result matches the unbroken run to rounding, not bit for bit\n",
        world_size, saved->world_size, *flags.global_batch_size, batch_per_process(flags, world_size));
  }
  if (!flags.global_batch_size && saved->world_size != world_size) {
    throw differs(
        fmt::format("the checkpoint was made by {} process(es), this run has {} (--nproc, "
                    "--nproc-per-node x --nnodes; --global-batch-size resumes on another number)",
                    saved->world_size, world_size));
  }
  if (saved->train_samples != train_samples) {
    throw differs(
        fmt::format("the checkpoint was made on {} training samples, this run has {} (--limit-train, "
                    "--synthetic, --data)",
                    saved->train_samples, train_samples));
  }
  try {
    run::restore_cpu_generator(saved->cpu_generator_state);
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(fmt::format("--resume '{}': {}", path, one_line(e.what())));
  }
  if (rank.rank == 0) {
    fmt::print("resuming at epoch {}, batch {} of it (step {} of the run)\n", saved->position.epoch,
               saved->position.batches_done, saved->position.steps);
    if (saved->position.epoch > flags.epochs) {
      fmt::print("the run is past epoch {} already (--epochs {}): nothing left to train\n", saved->position.epoch - 1,
                 flags.epochs);
    }
  }
  return saved->position;
}

run::Checkpoints checkpoints_from(const CommonFlags& flags) {
  run::CheckpointOptions options;
  options.file = flags.save;
  options.folder = flags.checkpoint_dir;
  options.keep_last = flags.keep_last;
  options.every = flags.save_every;
  return run::Checkpoints(options);
}

run::DistributedSampler sampler_from(const CommonFlags& flags, int64_t train_samples, const Rank& rank) {
  const int64_t batch = batch_per_process(flags, rank.world_size);
  if (flags.global_batch_size && *flags.global_batch_size > train_samples) {
    throw std::invalid_argument(fmt::format("--global-batch-size {} is more than the {} training samples",
                                            *flags.global_batch_size, train_samples));
  }
  return run::DistributedSampler(
      train_samples, batch, rank.rank, rank.world_size,
      flags.global_batch_size ? run::DistributedSampler::Order::kGlobal : run::DistributedSampler::Order::kPerRank);
}

run::MonitorOptions monitor_options(const CommonFlags& flags, const run::TrainingPosition& start,
                                    int64_t batches_per_epoch) {
  run::MonitorOptions options;
  options.progress = run::progress_style(flags.quiet, stdout);
  options.progress_every_seconds = flags.progress_every;
  options.epochs = flags.epochs;
  options.observe = flags.observe;
  options.observe.resumed = !flags.resume.empty();
  options.first_step = start.steps + 1;
  // The run's last step: every rank computes the same, so the observer's windows and logged steps pair up.
  options.last_step = run::last_step(start, flags.epochs, batches_per_epoch);
  if (flags.stop_after_steps) options.last_step = std::min(options.last_step, start.steps + *flags.stop_after_steps);
  return options;
}

bool stop_requested(const CommonFlags& flags, const run::TrainingPosition& start, const run::TrainingPosition& now) {
  return flags.stop_after_steps && now.steps - start.steps >= *flags.stop_after_steps;
}

void print_if_stopped(const CommonFlags& flags, const run::TrainingPosition& start, const run::TrainingPosition& end,
                      const Rank& rank) {
  if (!stop_requested(flags, start, end) || rank.rank != 0) return;
  fmt::print("stopped after {} step(s) (--stop-after-steps), at epoch {}, batch {} of it (step {} of the run)\n",
             end.steps - start.steps, end.epoch, end.batches_done, end.steps);
}

double test_accuracy(torch::nn::Module& module, const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                     const ImageSplit& split, const torch::Device& device) {
  const ddp::ProgressPause pause("an evaluation");  // not timed by the launcher's hang detection
  torch::NoGradGuard no_grad;
  module.eval();
  int64_t correct = 0;
  const int64_t n = split.images.size(0);
  for (int64_t begin = 0; begin < n; begin += kEvalBatch) {
    const int64_t end = std::min(n, begin + kEvalBatch);
    auto logits = forward(split.images.slice(0, begin, end).to(device));
    correct += logits.argmax(1).eq(split.labels.slice(0, begin, end).to(logits.device())).sum().item<int64_t>();
  }
  module.train();
  return static_cast<double>(correct) / static_cast<double>(n);
}

double print_epoch_result(int epoch, int epochs, double mean_loss, double accuracy) {
  fmt::print("epoch {}/{}: mean loss {:.4f} | test accuracy {:.2f}%\n", epoch, epochs, mean_loss, 100.0 * accuracy);
  return accuracy;
}

void resume_from_checkpoint_dir(CommonFlags& flags, const Rank& rank,
                                const std::function<void(const std::string& path)>& check) {
  const auto newest = checkpoints_from(flags).newest(check, [&](const std::string& line) {
    if (rank.rank == 0) fmt::print(stderr, "warning: --checkpoint-dir: {}\n", line);
  });
  if (newest) {
    flags.resume = *newest;
    if (rank.rank == 0) fmt::print("--checkpoint-dir: continuing from {}\n", *newest);
  }
}

void save_checkpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                     const run::RunState& state) {
  run::save_training_checkpoint(path, module, optimizer, state);
  fmt::print("saved model, optimizer and training position to {}\n", path);
}

std::optional<run::RunState> load_checkpoint(const std::string& path, torch::nn::Module& module,
                                             torch::optim::Optimizer& optimizer) {
  std::optional<run::RunState> state;
  load_resume_checkpoint(path, [&] { state = run::load_training_checkpoint(path, module, optimizer); });
  return state;
}

void load_resume_checkpoint(const std::string& path, const std::function<void()>& load) {
  // amp's errors name the file ("checkpoint 'PATH': ..."): the line names it once, after --resume.
  const auto resume_error = [&](std::string message) {
    const std::string named = "checkpoint '" + path + "': ";
    if (message.rfind(named, 0) == 0) message.erase(0, named.size());
    return std::invalid_argument(fmt::format("--resume '{}': {}", path, one_line(message)));
  };
  try {
    load();
  } catch (const c10::Error& e) {
    throw resume_error(e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw resume_error(e.what());
  }
}

int run_main(const char* program, const std::function<int()>& body) {
  // Each line the run prints (its header, each save, each epoch's result) reaches a log or the launcher's pipe when
  // it is printed, not when a 4 KiB buffer fills: a log read mid-run has it, and a SIGTERM loses none. (Before any
  // output: parse_flags prints only when it returns early.)
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string error;
  try {
    return body();
  } catch (const c10::Error& e) {
    error = one_line(e.what_without_backtrace());
  } catch (const std::exception& e) {
    error = one_line(e.what());
  }
  // Under a launcher (ddp-launch, torchrun: TORCHELASTIC_ERROR_FILE) the error goes to the launcher, which prints it
  // once in its summary, naming every rank that failed with it: an error each rank hits alike (a bad flag, a bad
  // --resume) is one line, not one per rank and the launcher's again. Run directly, the program prints it.
  if (!ddp::record_error(error)) std::fprintf(stderr, "%s: %s\n", program, error.c_str());
  return 1;
}

}  // namespace examples
