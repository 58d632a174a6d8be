#include "common/training.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>

#include <amp/io/archive_error.h>
#include <amp/io/atomic_file.h>
#include <amp/io/checkpoint_dir.h>
#include <ddp/launch/error_file.h>
#include <ddp/progress.h>
#include <fmt/format.h>

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
                 "Keep checkpoints in this folder, one per --save-every steps and one at the end (step-N.pt, the "
                 "newest --keep-last kept), and on start continue from the newest one that reads (a damaged newer one "
                 "is skipped with a warning); replaces --save and --resume");
  app.add_flag("--quiet", flags.quiet, "No progress line (the header, saves and each epoch's result still print)");
  app.add_option("--progress-every", flags.progress_every,
                 "When the output is not a terminal, a progress line every this many seconds (0: every step) and at "
                 "each epoch's end; a terminal gets one line that updates itself");
  app.add_option("--metrics", flags.observe.metrics,
                 "Write the run's metrics here as JSON lines (rank 0): one object per logged step and per epoch "
                 "(docs/observability.md); appended to when the run resumes");
  app.add_option(
      "--metrics-every", flags.observe.metrics_every,
      "Log every this many steps of the run (default 10) and its last step (--metrics, --report): the ranks' "
      "times are gathered then");
  app.add_option("--report", flags.observe.report,
                 "Write one self-contained HTML report of the run here (rank 0): loss, accuracy, throughput, loss "
                 "scale, each rank's step time, and the timeline of --timeline-steps");
  app.add_option(
      "--timeline", flags.observe.timeline,
      "Write the timeline of --timeline-steps here as Chrome trace JSON (rank 0; Perfetto, chrome://tracing)");
  app.add_option("--timeline-steps", flags.observe.timeline_steps,
                 "Steps of the run the timeline records, A:B or A (default with --report or --timeline: 3 steps after "
                 "3 of warm-up)");
  app.add_option("--stop-after-steps", flags.stop_after_steps,
                 "For testing resumption: stop after S optimizer steps of this process, mid-epoch if it falls there, "
                 "and write --save");
}

std::string run_header_line(const CommonFlags& flags, const Data& data, const RunHeader& header) {
  // (A global batch that does not split among the processes is refused here, before a header with a wrong split.)
  const std::string batch = flags.global_batch_size
                                ? fmt::format("global batch {} ({} per process)", *flags.global_batch_size,
                                              batch_per_process(flags, std::max<int64_t>(header.processes, 1)))
                                : fmt::format("batch {} per process", flags.batch_size);
  return fmt::format("{} process{}{}, {} | {} | {}, lr {}, {}, {} epoch(s) | {} training samples, {} test samples{}",
                     header.processes, header.processes == 1 ? "" : "es",
                     header.backend.empty() ? std::string() : " (" + header.backend + ")", header.where,
                     header.precision, header.optimizer, flags.lr, batch, flags.epochs, data.train.images.size(0),
                     data.test.images.size(0), header.extras);
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
  check_observe_flags(flags.observe);
  struct stat info {};
  if (!flags.resume.empty()) {
    if (::stat(flags.resume.c_str(), &info) != 0) {
      throw std::invalid_argument(fmt::format("--resume '{}': no such file", flags.resume));
    }
    if (!S_ISREG(info.st_mode)) throw std::invalid_argument(fmt::format("--resume '{}': not a file", flags.resume));
  }
  check_output_path("--save", flags.save);  // checked now, not after an hour of training
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

double train_epoch(const ImageSplit& train, int epoch, int epochs, int64_t batch_size, const torch::Device& device,
                   const Rank& rank, const StepFn& step, Progress& progress, int64_t first_batch,
                   const AfterStepFn& after_step, bool global_order, RunObserver* observer, int64_t observer_step) {
  const auto n = static_cast<size_t>(train.images.size(0));
  // Global order: the one-replica shuffle of every sample, each step's job batch cut into the ranks' parts.
  torch::data::samplers::DistributedRandomSampler sampler(n, global_order ? 1 : static_cast<size_t>(rank.world_size),
                                                          global_order ? 0 : static_cast<size_t>(rank.rank));
  sampler.set_epoch(static_cast<size_t>(epoch));
  sampler.reset();
  const std::vector<size_t> shard = sampler.next(n).value_or(std::vector<size_t>{});
  std::vector<int64_t> shard64(shard.begin(), shard.end());
  auto order = torch::tensor(shard64, torch::kInt64);
  if (global_order) {
    const int64_t job_batch = batch_size * rank.world_size;
    const int64_t steps = static_cast<int64_t>(n) / job_batch;  // a last part-batch is left out
    order = order.slice(0, 0, steps * job_batch)
                .view({steps, rank.world_size, batch_size})
                .select(1, rank.rank)
                .reshape({-1});  // this rank's parts, step after step
  }
  const auto local = order.numel();
  const int64_t steps = (local + batch_size - 1) / batch_size;

  const auto start = Progress::Clock::now();
  const int64_t first = std::clamp<int64_t>(first_batch, 0, steps);
  if (rank.rank == 0) progress.begin_epoch(epoch, epochs, steps, first, start);
  double loss_sum = 0.0;
  int64_t ran = 0;  // batches run by this call
  for (int64_t s = first; s < steps; ++s) {
    auto idx = order.slice(0, s * batch_size, std::min(local, (s + 1) * batch_size));
    auto images = train.images.index_select(0, idx).to(device, /*non_blocking=*/true);
    auto labels = train.labels.index_select(0, idx).to(device, /*non_blocking=*/true);
    const int64_t run_step = observer_step + ran + 1;
    StepPhases phases = observer != nullptr ? observer->begin_step(run_step) : StepPhases();
    phases.begin();
    const double loss = step(images, labels, phases).item<double>();  // the progress line needs it; one sync per step
    phases.finish();
    if (observer != nullptr) observer->end_step(run_step, epoch, loss, phases, idx.numel() * rank.world_size);
    loss_sum += loss;
    ++ran;
    const bool go_on = !after_step || after_step(s + 1, steps);
    if (rank.rank == 0) {
      const auto now = Progress::Clock::now();
      const double seconds = std::chrono::duration<double>(now - start).count();
      const auto seen =
          static_cast<double>((std::min(local, (s + 1) * batch_size) - first * batch_size) * rank.world_size);
      // "mean loss": the running mean of rank 0's step losses in this epoch (since the resume, in a resumed epoch).
      progress.step_done(s + 1, loss_sum / static_cast<double>(ran), seen / seconds, now, !go_on);
    }
    if (!go_on) break;
  }
  if (rank.rank == 0) progress.end_epoch();
  return ran > 0 ? loss_sum / static_cast<double>(ran) : 0.0;
}

int64_t steps_per_epoch(int64_t train_samples, int64_t batch_size, int64_t world_size, bool global_order) {
  if (global_order) return train_samples / (batch_size * world_size);
  const int64_t local = (train_samples + world_size - 1) / world_size;  // the sampler pads every rank's shard alike
  return (local + batch_size - 1) / batch_size;
}

namespace {

constexpr int64_t kRunStateVersion = 1;

int64_t read_int(torch::serialize::InputArchive& archive, const char* key) {
  torch::Tensor value;
  if (!archive.try_read(key, value) || value.numel() != 1 || value.scalar_type() != torch::kInt64) {
    throw std::runtime_error(fmt::format("its run state has no valid '{}'", key));
  }
  return value.item<int64_t>();
}

void write_run_state(torch::serialize::OutputArchive& archive, const RunState& state) {
  int64_t seed_bits = 0;
  std::memcpy(&seed_bits, &state.seed, sizeof seed_bits);  // uint64 stored in int64, bit for bit
  const std::pair<const char*, int64_t> values[] = {{"version", kRunStateVersion},
                                                    {"epoch", state.position.epoch},
                                                    {"batches_done", state.position.batches_done},
                                                    {"steps", state.position.steps},
                                                    {"seed", seed_bits},
                                                    {"batch_size", state.batch_size},
                                                    {"global_batch_size", state.global_batch_size},
                                                    {"world_size", state.world_size},
                                                    {"train_samples", state.train_samples}};
  for (const auto& [key, value] : values) archive.write(key, torch::tensor({value}, torch::kInt64));
  archive.write("cpu_generator_state", state.cpu_generator_state);
  archive.write("ddp_gradient_order",
                torch::tensor(c10::ArrayRef<int64_t>(state.ddp_gradient_order), torch::kInt64).view({-1}));
}

RunState read_run_state(torch::serialize::InputArchive& archive) {
  RunState state;
  const int64_t version = read_int(archive, "version");
  if (version != kRunStateVersion) {
    throw std::runtime_error(
        fmt::format("its run state has version {}; this build reads {}", version, kRunStateVersion));
  }
  state.position.epoch = read_int(archive, "epoch");
  state.position.batches_done = read_int(archive, "batches_done");
  state.position.steps = read_int(archive, "steps");
  const int64_t seed_bits = read_int(archive, "seed");
  std::memcpy(&state.seed, &seed_bits, sizeof seed_bits);
  state.batch_size = read_int(archive, "batch_size");
  state.world_size = read_int(archive, "world_size");
  state.train_samples = read_int(archive, "train_samples");
  torch::Tensor global_batch;  // absent in files written before it was recorded: split by processes
  if (archive.try_read("global_batch_size", global_batch)) {
    state.global_batch_size = read_int(archive, "global_batch_size");
  }
  if (state.position.epoch < 1 || state.position.batches_done < 0 || state.position.steps < 0 || state.batch_size < 1 ||
      state.world_size < 1 || state.train_samples < 0 || state.global_batch_size < 0) {
    throw std::runtime_error(fmt::format(
        "its run state is malformed (epoch {}, batches done {}, steps {}, batch size {}, world size {}, samples {})",
        state.position.epoch, state.position.batches_done, state.position.steps, state.batch_size, state.world_size,
        state.train_samples));
  }
  if (!archive.try_read("cpu_generator_state", state.cpu_generator_state) ||
      state.cpu_generator_state.scalar_type() != torch::kByte) {
    throw std::runtime_error("its run state has no valid 'cpu_generator_state'");
  }
  torch::Tensor order;  // absent in files written before it was recorded: the layout is then rebuilt as usual
  if (archive.try_read("ddp_gradient_order", order)) {
    if (order.scalar_type() != torch::kInt64 || order.dim() != 1) {
      throw std::runtime_error("its run state has no valid 'ddp_gradient_order'");
    }
    order = order.contiguous();
    state.ddp_gradient_order.assign(order.data_ptr<int64_t>(), order.data_ptr<int64_t>() + order.numel());
  }
  return state;
}

}  // namespace

RunState capture_run_state(const CommonFlags& flags, int64_t world_size, int64_t train_samples,
                           const TrainingPosition& position, std::vector<int64_t> ddp_gradient_order) {
  RunState state;
  state.ddp_gradient_order = std::move(ddp_gradient_order);
  state.position = position;
  state.seed = flags.seed;
  state.batch_size = batch_per_process(flags, world_size);
  state.global_batch_size = flags.global_batch_size.value_or(0);
  state.world_size = world_size;
  state.train_samples = train_samples;
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  state.cpu_generator_state = generator.get_state();
  return state;
}

std::string encode_run_state(const RunState& state) {
  torch::serialize::OutputArchive archive;
  write_run_state(archive, state);
  std::ostringstream bytes;
  archive.save_to(bytes);
  return bytes.str();
}

RunState decode_run_state(const std::string& bytes) {
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(bytes.data(), bytes.size());
  } catch (const c10::Error& e) {
    throw std::runtime_error(std::string("its run state cannot be read (") + e.what_without_backtrace() + ")");
  }
  return read_run_state(archive);
}

TrainingPosition resume_position(const std::string& path, const std::optional<RunState>& saved,
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
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(saved->cpu_generator_state);
  } catch (const c10::Error& e) {
    throw std::invalid_argument(fmt::format("--resume '{}': its CPU generator state does not load: {}", path,
                                            one_line(e.what_without_backtrace())));
  }
  if (rank.rank == 0) {
    fmt::print("resuming at epoch {}, batch {} of it (step {} of the run)\n", saved->position.epoch,
               saved->position.batches_done, saved->position.steps);
  }
  return saved->position;
}

TrainingPosition train_epochs(const CommonFlags& flags, const ImageSplit& train, const torch::Device& device,
                              const Rank& rank, TrainingPosition position, const Loop& loop) {
  if (position.epoch > flags.epochs && rank.rank == 0) {
    fmt::print("the run is past epoch {} already (--epochs {}): nothing left to train\n", position.epoch - 1,
               flags.epochs);
  }
  const int64_t batch = batch_per_process(flags, rank.world_size);
  if (flags.global_batch_size && *flags.global_batch_size > train.images.size(0)) {
    throw std::invalid_argument(fmt::format("--global-batch-size {} is more than the {} training samples",
                                            *flags.global_batch_size, train.images.size(0)));
  }
  int64_t steps_here = 0;
  bool stop = false;
  Progress progress(progress_style(flags.quiet, stdout), flags.progress_every);
  // The run's last step: every rank computes the same, so the observer's windows and logged steps pair up.
  const bool global_order = flags.global_batch_size.has_value();
  const int64_t epoch_steps = steps_per_epoch(train.images.size(0), batch, rank.world_size, global_order);
  int64_t last_step = position.steps + std::max<int64_t>(0, flags.epochs - position.epoch + 1) * epoch_steps -
                      (position.epoch <= flags.epochs ? position.batches_done : 0);
  if (flags.stop_after_steps) last_step = std::min(last_step, position.steps + *flags.stop_after_steps);
  ObserveFlags observe = flags.observe;
  observe.resumed = !flags.resume.empty();
  RunObserver observer(observe, rank.rank, rank.world_size, device, loop.observed, position.steps + 1, last_step);
  while (position.epoch <= flags.epochs && !stop) {
    const int64_t epoch = position.epoch;
    const auto epoch_began = std::chrono::steady_clock::now();
    const double loss = train_epoch(
        train, static_cast<int>(epoch), flags.epochs, batch, device, rank, loop.step, progress, position.batches_done,
        [&](int64_t batches_done, int64_t batches_in_epoch) {
          ++position.steps;
          ++steps_here;
          position.batches_done = batches_done;
          if (batches_done >= batches_in_epoch) position = {epoch + 1, 0, position.steps};
          if ((rank.rank == 0 || loop.save_on_every_rank) && flags.save_every &&
              position.steps % *flags.save_every == 0) {
            if (rank.rank == 0) progress.interrupt();  // the save's line below the progress line
            loop.save(position);
          }
          stop = flags.stop_after_steps && steps_here >= *flags.stop_after_steps;
          return !stop;
        },
        global_order, &observer, position.steps);
    if (!stop && position.epoch == epoch) position = {epoch + 1, 0, position.steps};  // an epoch without batches
    if (position.epoch > epoch) {
      EpochRecord record;
      record.epoch = epoch;
      record.step = position.steps;
      record.mean_loss = loss;
      const auto trained = std::chrono::steady_clock::now();
      record.seconds = std::chrono::duration<double>(trained - epoch_began).count();
      if (loop.end_epoch) record.test_accuracy = loop.end_epoch(epoch, loss);
      observer.end_epoch(record, std::chrono::duration<double>(std::chrono::steady_clock::now() - trained).count());
    }
  }
  observer.finish();
  if (stop && rank.rank == 0) {
    fmt::print("stopped after {} step(s) (--stop-after-steps), at epoch {}, batch {} of it (step {} of the run)\n",
               steps_here, position.epoch, position.batches_done, position.steps);
  }
  return position;
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

StepValues step_values(torch::optim::Optimizer& optimizer, amp::Optimizer* amp_optimizer) {
  StepValues values;
  if (!optimizer.param_groups().empty()) values.lr = optimizer.param_groups().front().options().get_lr();
  if (amp_optimizer != nullptr) {
    const amp::ScalerDiagnostics diagnostics = amp_optimizer->scaler().diagnostics_now();
    values.loss_scale = diagnostics.scale;
    values.skipped_steps = diagnostics.skipped_steps;
  }
  return values;
}

bool final_save_needed(const CommonFlags& flags, const TrainingPosition& start, const TrainingPosition& end) {
  const bool saved_by_save_every = flags.save_every && end.steps > start.steps && end.steps % *flags.save_every == 0;
  return (!flags.save.empty() || !flags.checkpoint_dir.empty()) && !saved_by_save_every;
}

void resume_from_checkpoint_dir(CommonFlags& flags, const Rank& rank,
                                const std::function<void(const std::string& path)>& check) {
  if (flags.checkpoint_dir.empty()) return;
  const amp::CheckpointDir dir(flags.checkpoint_dir, flags.keep_last);
  const auto newest = dir.load_newest(check, [&](const std::string& line) {
    if (rank.rank == 0) fmt::print(stderr, "warning: --checkpoint-dir: {}\n", line);
  });
  if (newest) {
    flags.resume = newest->path;
    if (rank.rank == 0) fmt::print("--checkpoint-dir: continuing from {}\n", newest->path);
  }
}

void write_checkpoint(const CommonFlags& flags, const TrainingPosition& at, const Rank& rank,
                      const std::function<void(const std::string& path)>& write) {
  const ddp::ProgressPause pause("a checkpoint save");  // not timed by the launcher's hang detection
  if (flags.checkpoint_dir.empty()) {
    write(flags.save);
    return;
  }
  const amp::CheckpointDir dir(flags.checkpoint_dir, flags.keep_last);
  if (rank.rank == 0) {
    dir.save(at.steps, write);
  } else {
    write(dir.path_for(at.steps));  // a collective save's other ranks: rank 0 writes the file
  }
}

void save_checkpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                     const RunState& run) {
  torch::serialize::OutputArchive archive, model_archive, optimizer_archive, run_archive;
  module.save(model_archive);
  optimizer.save(optimizer_archive);
  write_run_state(run_archive, run);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("run_state", run_archive);
  amp::save_archive_atomically(archive, path);
  fmt::print("saved model, optimizer and training position to {}\n", path);
}

std::optional<RunState> load_checkpoint(const std::string& path, torch::nn::Module& module,
                                        torch::optim::Optimizer& optimizer) {
  std::optional<RunState> run;
  load_resume_checkpoint(path, [&] {
    torch::serialize::InputArchive archive, model_archive, optimizer_archive;
    try {
      archive.load_from(path);
    } catch (const c10::Error& e) {
      throw std::runtime_error("cannot read it as a checkpoint: " +
                               amp::short_archive_error(e.what_without_backtrace()));
    }
    for (const auto& [key, part] : {std::pair<const char*, torch::serialize::InputArchive*>{"model", &model_archive},
                                    {"optimizer", &optimizer_archive}}) {
      if (!archive.try_read(key, *part)) {
        throw std::runtime_error(fmt::format("no '{}' part: not a checkpoint written by --save of this example", key));
      }
    }
    torch::serialize::InputArchive run_archive;
    if (archive.try_read("run_state", run_archive)) run = read_run_state(run_archive);  // absent in older files
    module.load(model_archive);
    optimizer.load(optimizer_archive);
  });
  return run;
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

int run_main(const char* program, const std::function<void()>& body) {
  std::string error;
  try {
    body();
    return 0;
  } catch (const c10::Error& e) {
    error = one_line(e.what_without_backtrace());
  } catch (const std::exception& e) {
    error = one_line(e.what());
  }
  // For the launcher's root-cause line (TORCHELASTIC_ERROR_FILE), before the line to stderr: a pipe may lose it.
  ddp::record_error(error);
  std::fprintf(stderr, "%s: %s\n", program, error.c_str());
  return 1;
}

}  // namespace examples
