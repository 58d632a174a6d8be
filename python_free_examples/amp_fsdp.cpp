// Mixed precision over full sharding (docs/fsdp.md): each rank keeps 1/N of every parameter and of the optimizer's
// state, and a unit's full parameters exist only while it runs; one process per GPU, started by a launcher:
//   ddp-launch --nproc-per-node 2 ./amp_fsdp --synthetic --opt-level O2 --dtype bf16 --optimizer adamw
// Order matters: join the group first (sharding splits the model among the ranks), mark the units where the model is
// built (here fc1, 95% of the parameters, in a ddp::ShardedUnit), build FullyShardedDataParallel over the model, the
// optimizer over its shards, then amp::initialize over the FullyShardedDataParallel. The fp32 shards are the master
// weights; under O2 the units are gathered in the half dtype. Every forward is collective (it gathers), so every rank
// evaluates; every rank takes part in each save (rank 0 writes one consolidated file, which also resumes amp_ddp or
// another number of processes).
#include <memory>
#include <optional>

#include <amp/amp.h>
#include <ddp/fsdp/fully_sharded.h>
#include <fmt/format.h>

#include "common/amp_flags.h"
#include "common/ddp_worker.h"
#include "common/preemption.h"
#include "common/small_cnn.h"

int main(int argc, char** argv) {
  examples::CommonFlags flags;
  examples::AmpFlags amp_flags;
  int local_rank_flag = 0;
  CLI::App app{"Mixed precision over full sharding (ZeRO-3) on Fashion-MNIST, started by ddp-launch or torchrun"};
  examples::add_common_flags(app, flags);
  examples::add_local_rank_flag(app, local_rank_flag);
  examples::add_amp_flags(app, amp_flags, flags);
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  examples::apply_amp_lr_default(app, amp_flags, flags);

  return examples::run_main("amp_fsdp", [&] {
    examples::check_common_flags(flags);
    const std::unique_ptr<run::StopSignal> stop_signal = examples::watch_stop_signal(flags);
    const int local_rank = examples::local_rank_from_launcher(argc, argv, "amp_fsdp");
    examples::resume_from_checkpoint_dir(flags, examples::Rank{local_rank, 1}, amp::verify_checkpoint);
    const torch::Device device = examples::pick_device(flags.device, local_rank);
    torch::manual_seed(flags.seed);
    const examples::Data data = examples::load_data(flags);
    const int64_t train_samples = data.train.images.size(0);
    ddp::InitOptions init;
    if (device.is_cuda()) init.cuda_device(device.index());
    ddp::ProcessGroup group = ddp::init_process_group(init.backend(examples::backend_for(device)));
    const examples::Rank rank{group.rank(), group.size()};
    if (stop_signal) stop_signal->join(group);
    run::DistributedSampler sampler = examples::sampler_from(flags, train_samples, rank);

    // O2 computes in the half dtype: the units are gathered in it (param_dtype) from the fp32 shards, and a unit
    // gathers one dtype, so BatchNorm computes in it too (keep_batchnorm_fp32 off). Gradients are reduced in fp32.
    const c10::ScalarType half = examples::half_dtype(amp_flags.dtype, device);
    amp::Options options = examples::amp_options(amp_flags.opt_level, half);
    ddp::FullyShardOptions shard_options;
    shard_options.reduce_dtype(torch::kFloat);
    if (amp_flags.opt_level == "O2") {
      shard_options.param_dtype(half);
      options.keep_batchnorm_fp32(false);
    }
    examples::SmallCnn net(examples::SmallCnnOptions().sharded_fc1(true));
    net->to(device);
    ddp::FullyShardedDataParallel fsdp(net, group, shard_options);  // rank 0's values, split among the ranks
    auto inner = examples::make_amp_optimizer(amp_flags.optimizer, fsdp.parameters(), flags.lr);
    auto initialized = amp::initialize(fsdp, *inner, options);
    auto& model = initialized.model;  // (not a structured binding: the lambdas below capture them)
    auto& optimizer = initialized.optimizer;
    if (rank.rank != 0) optimizer.set_overflow_logger([](const std::string&) {});  // one overflow flag for all
    std::optional<run::RunState> saved;  // the run state travels in the amp checkpoint as an extra
    if (!flags.resume.empty()) saved = examples::load_amp_checkpoint(flags.resume, model, optimizer);  // collective

    std::string header_line;
    {
      examples::RunHeader header;
      header.processes = rank.world_size;
      header.backend = group.backend_name();
      header.where = "device " + device.str() + " on rank 0";
      header.precision = amp_flags.opt_level + " " + examples::dtype_name(half);
      header.optimizer = examples::amp_optimizer_description(amp_flags.optimizer);
      header.extras = fmt::format(" | full sharding, {} units", fsdp.units().size());
      header_line = examples::run_header_line(flags, data, header);
      if (rank.rank == 0) fmt::print("{}\n", header_line);
    }
    run::TrainingPosition position;
    if (!flags.resume.empty()) {
      position = examples::resume_position(flags.resume, saved, flags, rank.world_size, train_samples, rank);
    }

    const run::Checkpoints checkpoints = examples::checkpoints_from(flags);
    const auto save = [&](const run::TrainingPosition& at) {  // collective: rank 0 writes the file
      const auto state = examples::capture_run_state(flags, rank.world_size, train_samples, at);
      checkpoints.save(
          at.steps,
          [&](const std::string& path) {
            examples::save_amp_checkpoint(path, model, optimizer, state, /*announce=*/rank.rank == 0);
          },
          /*writer=*/rank.rank == 0);
    };
    run::Monitor monitor(examples::monitor_options(flags, position, sampler.batches_per_epoch()), rank.rank,
                         rank.world_size, device,
                         {header_line, [&] { return run::step_values(*inner, &optimizer); }, &group, nullptr});
    const run::TrainingPosition start = position;
    bool preempted = examples::stop_signalled(stop_signal.get(), position);
    while (position.epoch <= flags.epochs && !examples::stop_requested(flags, start, position) && !preempted) {
      const int64_t epoch = position.epoch;
      sampler.set_epoch(epoch, position.batches_done);
      monitor.begin_epoch(epoch, sampler.batches_per_epoch(), position.batches_done, position.epoch_loss);
      while (const auto indices = sampler.next()) {
        const auto [images, labels] = data.train.batch(*indices, device);
        run::StepPhases& phases = monitor.begin_step();
        optimizer.zero_grad();
        auto loss = torch::cross_entropy_loss(model.forward(images), labels);  // each unit gathered as it runs
        phases.end(run::Phase::kForward);
        {
          auto scaled = amp::scale_loss(loss, optimizer);
          scaled.backward();  // each unit's gradients reduce-scattered into its shard as backward passes it
        }                     // unscaled and checked; the overflow flag agreed over the ranks
        phases.end(run::Phase::kBackward);
        optimizer.step();  // on this rank's shards; skipped on every rank alike after an overflow
        phases.end(run::Phase::kOptimizer);
        const double step_loss = loss.item<double>();
        position.step_done(sampler.batches_done(), sampler.batches_per_epoch(), step_loss);
        preempted = examples::stop_signalled(stop_signal.get(), position);
        const bool stop = examples::stop_requested(flags, start, position) || preempted;
        monitor.step(step_loss, indices->numel() * rank.world_size, /*last=*/stop);
        if (checkpoints.due(position.steps)) {
          monitor.interrupt();
          save(position);
        }
        if (stop) break;
      }
      const double mean_loss = monitor.epoch_trained();
      if (position.epoch > epoch) {
        // Every rank evaluates (each forward gathers); rank 0 prints.
        const double accuracy = examples::test_accuracy(
            *net, [&](const torch::Tensor& x) { return model.forward(x); }, data.test, device);
        std::optional<double> printed;
        if (rank.rank == 0) {
          printed = examples::print_epoch_result(static_cast<int>(epoch), flags.epochs, mean_loss, accuracy);
        }
        monitor.end_epoch(printed);
      }
    }
    monitor.finish();
    examples::print_if_stopped(flags, start, position, rank);
    if (checkpoints.final_save_needed(start, position)) save(position);
    group.barrier();
    return preempted ? examples::stopped_resumable(flags, *stop_signal, rank, position) : 0;
  });
}
