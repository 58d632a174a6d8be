#include <run/run_state.h>

#include <cstring>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

namespace run {

namespace {

constexpr int64_t kRunStateVersion = 1;

int64_t read_int(torch::serialize::InputArchive& archive, const char* key) {
  torch::Tensor value;
  if (!archive.try_read(key, value) || value.numel() != 1 || value.scalar_type() != torch::kInt64) {
    throw std::runtime_error(fmt::format("its run state has no valid '{}'", key));
  }
  return value.item<int64_t>();
}

}  // namespace

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
  archive.write("epoch_loss_sum", torch::tensor({state.position.epoch_loss.sum}, torch::kFloat64));
  archive.write("epoch_loss_steps", torch::tensor({state.position.epoch_loss.steps}, torch::kInt64));
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
  torch::Tensor loss_sum;  // absent in files written before the epoch's losses were kept: the mean then restarts
  if (archive.try_read("epoch_loss_sum", loss_sum)) {
    if (loss_sum.numel() != 1 || loss_sum.scalar_type() != torch::kFloat64) {
      throw std::runtime_error("its run state has no valid 'epoch_loss_sum'");
    }
    state.position.epoch_loss.sum = loss_sum.item<double>();
    state.position.epoch_loss.steps = read_int(archive, "epoch_loss_steps");
    if (state.position.epoch_loss.steps < 0) throw std::runtime_error("its run state has no valid 'epoch_loss_steps'");
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

int64_t last_step(const TrainingPosition& at, int64_t epochs, int64_t batches_per_epoch) {
  if (at.epoch > epochs) return at.steps;
  return at.steps + (epochs - at.epoch + 1) * batches_per_epoch - at.batches_done;
}

torch::Tensor cpu_generator_state() {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void restore_cpu_generator(const torch::Tensor& state) {
  try {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  } catch (const c10::Error& e) {
    std::string message = e.what_without_backtrace();
    message = message.substr(0, message.find('\n'));
    throw std::runtime_error("its CPU generator state does not load: " + message);
  }
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

}  // namespace run
