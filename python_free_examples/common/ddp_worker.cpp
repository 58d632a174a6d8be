#include "common/ddp_worker.h"

#include <optional>
#include <stdexcept>

#include <ddp/distributed_data_parallel.h>
#include <ddp/launch/launch_env.h>
#include <ddp/replica_check.h>
#include <ddp/sync_batch_norm.h>
#include <fmt/format.h>

#include "common/small_cnn.h"

namespace examples {

void add_local_rank_flag(CLI::App& app, int& storage) {
  app.add_option("--local_rank,--local-rank", storage, "Set by the legacy launcher (else LOCAL_RANK is read)");
}

int local_rank_from_launcher(int argc, const char* const* argv, const std::string& program) {
  if (!ddp::launched_by_launcher()) {
    throw std::runtime_error(
        fmt::format("RANK and WORLD_SIZE are not set: start me with `ddp-launch --nproc-per-node N {0} ...` or "
                    "`torchrun --nproc-per-node N --no-python {0} ...`",
                    program));
  }
  const ddp::LaunchEnv env = ddp::launch_env_from_environment();
  return ddp::parse_local_rank_arg(argc, argv).value_or(env.local_rank);
}

void add_ddp_flags(CLI::App& app, DdpFlags& flags) {
  app.add_flag("--check-replicas", flags.check_replicas,
               "After training, check that every rank holds bit-identical parameters (exit 1 if not)");
  app.add_flag("--sync-bn", flags.sync_batch_norm,
               "Synchronized BatchNorm: batch statistics over all ranks' batches (ddp::SyncBatchNorm)");
}

void check_replicas_if_asked(const DdpFlags& flags, const torch::nn::Module& module, const ddp::ProcessGroup& group) {
  if (!flags.check_replicas) return;
  // With SyncBatchNorm every rank's running statistics are the global ones: they must agree too.
  const bool buffers = flags.sync_batch_norm;
  const uint64_t digest = ddp::check_replicas(module, group, buffers);
  if (group.rank() == 0) {
    fmt::print("replicas: all {} ranks hold bit-identical parameters{} (FNV-1a {})\n", group.size(),
               buffers ? " and buffers" : "", ddp::digest_hex(digest));
  }
}

std::string backend_for(const torch::Device& device) { return device.is_cuda() ? "nccl" : "gloo"; }

void train_ddp_worker(const CommonFlags& flags_given, const DdpFlags& ddp_flags, ddp::InitOptions init,
                      int local_rank) {
  CommonFlags flags = flags_given;
  // Before joining: the first process of each node speaks for the choice every rank makes alike.
  resume_from_checkpoint_dir(flags, Rank{local_rank, 1}, amp::check_archive_readable);
  const torch::Device device = pick_device(flags.device, local_rank);
  // Same seed on every rank: the replicas start equal (DDP also broadcasts rank 0's state at construction).
  torch::manual_seed(flags.seed);
  // Data and --resume are read before joining the group: a bad file is this rank's own one-line error, not a
  // failed collective on the others.
  const Data data = load_data(flags);
  SmallCnn net(SmallCnnOptions().sync_batch_norm(ddp_flags.sync_batch_norm));
  net->to(device);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(flags.lr).momentum(kSgdMomentum));
  std::optional<run::RunState> saved;
  if (!flags.resume.empty()) saved = load_checkpoint(flags.resume, *net, optimizer);

  if (device.is_cuda()) init.cuda_device(device.index());
  ddp::ProcessGroup group = ddp::init_process_group(init.backend(backend_for(device)));
  const Rank rank{group.rank(), group.size()};
  // Every rank refuses a global batch that does not split among the processes, before any collective (else rank 0
  // alone would, and the others would fail in the model's broadcast).
  batch_per_process(flags, rank.world_size);
  // The SyncBatchNorm layers were built before the group existed (so that --resume is read first).
  if (ddp_flags.sync_batch_norm) ddp::set_sync_batch_norm_process_group(*net, group);
  std::string header_line;
  {
    RunHeader header;
    header.processes = rank.world_size;
    header.backend = group.backend_name();
    header.where = "device " + device.str() + " on rank 0";
    header.precision = "fp32";
    header.optimizer = sgd_description();
    header.extras = ddp_flags.sync_batch_norm ? " | SyncBatchNorm over all ranks" : "";
    header_line = run_header_line(flags, data, header);
    if (rank.rank == 0) fmt::print("{}\n", header_line);
  }
  const int64_t train_samples = data.train.images.size(0);
  run::TrainingPosition position;
  if (!flags.resume.empty()) {
    position = resume_position(flags.resume, saved, flags, rank.world_size, train_samples, rank);
  }
  ddp::DistributedDataParallel ddp(net, group);
  if (saved) ddp.restore_gradient_order(saved->ddp_gradient_order);  // the saved run's bucket layout (collective)

  const auto save = [&](const run::TrainingPosition& at) {
    write_checkpoint(flags, at, rank, [&](const std::string& path) {
      save_checkpoint(path, *net, optimizer,
                      capture_run_state(flags, rank.world_size, train_samples, at, ddp.gradient_order()));
    });
  };
  Loop loop;
  loop.step = [&](const torch::Tensor& images, const torch::Tensor& labels, run::StepPhases& phases) {
    optimizer.zero_grad();
    auto l = torch::cross_entropy_loss(ddp.forward(images), labels);
    phases.end(run::Phase::kForward);
    l.backward();  // returns with gradients averaged over the ranks
    phases.end(run::Phase::kBackward);
    optimizer.step();
    phases.end(run::Phase::kOptimizer);
    return l;
  };
  loop.observed = {header_line, [&] { return run::step_values(optimizer); }, &group, &ddp};
  loop.save = save;
  // Rank 0 alone evaluates, on the module itself: ddp.forward() is collective.
  loop.end_epoch = [&](int64_t epoch, double loss) -> std::optional<double> {
    if (rank.rank != 0) return std::nullopt;
    return print_epoch_result(static_cast<int>(epoch), flags.epochs, loss,
                              test_accuracy(
                                  *net, [&](const torch::Tensor& x) { return net->forward(x); }, data.test, device));
  };
  const run::TrainingPosition end = train_epochs(flags, data.train, device, rank, position, loop);
  check_replicas_if_asked(ddp_flags, *net, group);
  if (rank.rank == 0 && final_save_needed(flags, position, end)) save(end);
  group.barrier();  // nobody leaves (and tears the group down) while rank 0 is still evaluating or saving
}

}  // namespace examples
