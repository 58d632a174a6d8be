// The tutorial's third way: one command starts everything; the program forks its own workers with ddp::spawn
// (torch.multiprocessing.spawn's counterpart) and they meet at tcp://127.0.0.1:PORT.
//   ./ddp_spawn --nproc 2 --synthetic
//   ./ddp_spawn --nproc 2 --synthetic --sync-bn     (BatchNorm statistics over all ranks)
// Each worker runs train() below: the same DDP training as ddp_launch.cpp, only its process group's address differs.
#include <cstdlib>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include <ddp/distributed_data_parallel.h>
#include <ddp/launch/spawn.h>
#include <ddp/sync_batch_norm.h>
#include <fmt/format.h>

#include "common/ddp_worker.h"
#include "common/preemption.h"
#include "common/small_cnn.h"

namespace {

// One worker: rank `local_rank` of the job, meeting the others at `init_method`. After a stop on --stop-signal it
// throws ddp::ResumableStop (its process then ends with run::kExitResumable; ddp::spawn tells the parent).
void train(examples::CommonFlags flags, const examples::DdpFlags& ddp_flags, int local_rank,
           const std::string& init_method) {
  // First: from here on --stop-signal stops the run at a step boundary the ranks agree on, which saves it. (The
  // parent forwards the signal to the workers: they run in process groups of their own.)
  const std::unique_ptr<run::StopSignal> stop_signal = examples::watch_stop_signal(flags);
  // Before joining: the first process of each node speaks for the choice every rank makes alike.
  examples::resume_from_checkpoint_dir(flags, examples::Rank{local_rank, 1}, amp::check_archive_readable);
  const torch::Device device = examples::pick_device(flags.device, local_rank);
  // Same seed on every rank: the replicas start equal (DDP also broadcasts rank 0's state at construction).
  torch::manual_seed(flags.seed);
  // Data and --resume are read before joining the group: a bad file is this rank's own one-line error, not a
  // failed collective on the others.
  const examples::Data data = examples::load_data(flags);
  const int64_t train_samples = data.train.images.size(0);
  examples::SmallCnn net(examples::SmallCnnOptions().sync_batch_norm(ddp_flags.sync_batch_norm));
  net->to(device);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(flags.lr).momentum(examples::kSgdMomentum));
  std::optional<run::RunState> saved;
  if (!flags.resume.empty()) saved = examples::load_checkpoint(flags.resume, *net, optimizer);

  // The process group: every worker meets at the address ddp::spawn gave them, rank local_rank of nproc.
  ddp::InitOptions init = ddp::InitOptions().init_method(init_method).backend(examples::backend_for(device));
  if (device.is_cuda()) init.cuda_device(device.index());
  ddp::ProcessGroup group = ddp::init_process_group(init);
  const examples::Rank rank{group.rank(), group.size()};
  if (stop_signal) stop_signal->join(group);  // the ranks agree on where to stop through the group's store
  // Every rank refuses a global batch that does not split among the processes, before any collective.
  run::DistributedSampler sampler = examples::sampler_from(flags, train_samples, rank);
  // The SyncBatchNorm layers were built before the group existed (so that --resume is read first).
  if (ddp_flags.sync_batch_norm) ddp::set_sync_batch_norm_process_group(*net, group);
  examples::RunHeader header;
  header.processes = rank.world_size;
  header.backend = group.backend_name();
  header.where = "device " + device.str() + " on rank 0";
  header.precision = "fp32";
  header.optimizer = examples::sgd_description();
  header.extras = ddp_flags.sync_batch_norm ? " | SyncBatchNorm over all ranks" : "";
  const std::string header_line = examples::run_header_line(flags, data, header);
  if (rank.rank == 0) fmt::print("{}\n", header_line);
  run::TrainingPosition position;
  if (!flags.resume.empty()) {
    position = examples::resume_position(flags.resume, saved, flags, rank.world_size, train_samples, rank);
  }
  ddp::DistributedDataParallel ddp(net, group);
  if (saved) ddp.restore_gradient_order(saved->ddp_gradient_order);  // the saved run's bucket layout (collective)

  const run::Checkpoints checkpoints = examples::checkpoints_from(flags);
  const auto save = [&](const run::TrainingPosition& at) {  // rank 0's
    checkpoints.save(at.steps, [&](const std::string& path) {
      examples::save_checkpoint(
          path, *net, optimizer,
          examples::capture_run_state(flags, rank.world_size, train_samples, at, ddp.gradient_order()));
    });
  };
  run::Monitor monitor(examples::monitor_options(flags, position, sampler.batches_per_epoch()), rank.rank,
                       rank.world_size, device,
                       {header_line, [&] { return run::step_values(optimizer); }, &group, &ddp});
  const run::TrainingPosition start = position;
  bool preempted = examples::stop_signalled(stop_signal.get(), position);  // (a signal during the start)
  while (position.epoch <= flags.epochs && !examples::stop_requested(flags, start, position) && !preempted) {
    const int64_t epoch = position.epoch;
    sampler.set_epoch(epoch, position.batches_done);  // this rank's shard of the epoch's shuffle
    monitor.begin_epoch(epoch, sampler.batches_per_epoch(), position.batches_done, position.epoch_loss);
    while (const auto indices = sampler.next()) {
      const auto [images, labels] = data.train.batch(*indices, device);
      run::StepPhases& phases = monitor.begin_step();
      optimizer.zero_grad();
      auto loss = torch::cross_entropy_loss(ddp.forward(images), labels);
      phases.end(run::Phase::kForward);
      loss.backward();  // returns with the gradients averaged over the ranks
      phases.end(run::Phase::kBackward);
      optimizer.step();
      phases.end(run::Phase::kOptimizer);
      const double step_loss = loss.item<double>();  // the step's one host sync
      position.step_done(sampler.batches_done(), sampler.batches_per_epoch(), step_loss);
      preempted = examples::stop_signalled(stop_signal.get(), position);
      const bool stop = examples::stop_requested(flags, start, position) || preempted;
      monitor.step(step_loss, indices->numel() * rank.world_size, /*last=*/stop);
      if (rank.rank == 0 && checkpoints.due(position.steps)) {
        monitor.interrupt();
        save(position);
      }
      if (stop) break;
    }
    const double mean_loss = monitor.epoch_trained();
    if (position.epoch > epoch) {
      std::optional<double> accuracy;  // rank 0 alone evaluates, on the module itself: ddp.forward() is collective
      if (rank.rank == 0) {
        accuracy = examples::print_epoch_result(
            static_cast<int>(epoch), flags.epochs, mean_loss,
            examples::test_accuracy(
                *net, [&](const torch::Tensor& x) { return net->forward(x); }, data.test, device));
      }
      monitor.end_epoch(accuracy);
    }
  }
  monitor.finish();
  examples::print_if_stopped(flags, start, position, rank);
  examples::check_replicas_if_asked(ddp_flags, *net, group);
  if (rank.rank == 0 && checkpoints.final_save_needed(start, position)) save(position);
  group.barrier();  // nobody leaves (and tears the group down) while rank 0 is still evaluating or saving
  if (preempted && examples::stopped_resumable(flags, *stop_signal, rank, position) == run::kExitResumable) {
    throw ddp::ResumableStop("stopped on " + run::stop_signal_name(stop_signal->signal()));
  }
}

}  // namespace

int main(int argc, char** argv) {
  examples::CommonFlags flags;
  examples::DdpFlags ddp_flags;
  int nproc = 2;
  int port = 0;
  CLI::App app{"DDP on Fashion-MNIST with workers spawned by the program itself"};
  examples::add_common_flags(app, flags);
  examples::add_ddp_flags(app, ddp_flags);
  app.add_option("--nproc", nproc, "Worker processes (one per GPU on a GPU machine)");
  app.add_option("--port", port, "Rendezvous port on 127.0.0.1 (0: a free one)");
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;

  return examples::run_main("ddp_spawn", [&] {
    examples::check_common_flags(flags);
    examples::require_positive("--nproc", nproc);
    if (port < 0 || port > 65535) {
      throw std::invalid_argument(fmt::format("--port must be 0 (a free one) or in 1..65535, got {}", port));
    }
    // Fork before CUDA: the parent must not touch the GPU, so the workers pick their devices themselves.
    const ddp::SpawnOutcome outcome = ddp::spawn(
        nproc,
        [&](int local_rank, int /*nprocs*/) {
          // ddp::spawn exports the port it chose (a free one when --port is 0) as MASTER_PORT.
          const char* chosen_port = std::getenv("MASTER_PORT");
          TORCH_CHECK(chosen_port != nullptr, "ddp_spawn: MASTER_PORT is not set in the worker");
          train(flags, ddp_flags, local_rank, fmt::format("tcp://127.0.0.1:{}", chosen_port));
        },
        ddp::SpawnOptions().master_port(port));
    return outcome == ddp::SpawnOutcome::kStoppedResumable ? run::kExitResumable : 0;
  });
}
