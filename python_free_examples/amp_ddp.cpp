// The tutorial's Apex way: mixed precision with amp::initialize, data parallel with DDP, one process per GPU
// started by a launcher (Apex's examples used torch.distributed.launch and --local_rank):
//   ddp-launch --nproc-per-node 2 ./amp_ddp --synthetic --opt-level O2 --dtype bf16 --optimizer adamw --lr 1e-3
// --sync-bn builds the CNN with ddp::SyncBatchNorm (Apex's convert_syncbn_model): batch statistics over all ranks,
// kept fp32 like BatchNorm (keep_batchnorm_fp32) while the activations they normalize are half.
// Order matters: amp::initialize first (it may cast the model), then DDP over the initialized module, and the
// forward runs through the amp policy: model.call(ddp.forward, images).
// --zero 1|2 shards the fp32 masters, their gradients and the optimizer state across the ranks (ZeRO, docs/zero.md):
// the loop is the same; --resume is then read after attach (each rank takes its shard) and every rank takes part
// in --save (rank 0 writes the consolidated file, which also resumes without --zero or at another world size).
#include <memory>
#include <optional>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/sync_batch_norm.h>
#include <fmt/format.h>

#include "common/amp_flags.h"
#include "common/ddp_worker.h"
#include "common/preemption.h"
#include "common/small_cnn.h"

namespace {

struct AmpDdpFlags {
  int local_rank = 0;  // the legacy launcher's --local_rank
  int zero = 0;        // ZeRO stage
  std::string fp8 = "off";
};

}  // namespace

int main(int argc, char** argv) {
  examples::CommonFlags flags;
  examples::DdpFlags ddp_flags;
  examples::AmpFlags amp_flags;
  AmpDdpFlags more;
  CLI::App app{"Apex-style mixed precision + DDP on Fashion-MNIST, started by ddp-launch or torchrun"};
  examples::add_common_flags(app, flags);
  examples::add_ddp_flags(app, ddp_flags);
  examples::add_local_rank_flag(app, more.local_rank);
  examples::add_amp_flags(app, amp_flags, flags);
  app.add_option("--zero", more.zero,
                 "ZeRO stage: 0 (off), 1 (shard fp32 masters and optimizer state), 2 (also reduce-scatter gradients)")
      ->check(CLI::IsMember({0, 1, 2}));
  app.add_option("--fp8", more.fp8,
                 "FP8 GEMMs in the CNN's Float8Linear layers (O1/O2): off, delayed (Transformer Engine's recipe) or "
                 "current scaling (docs/fp8.md)")
      ->check(CLI::IsMember({"off", "delayed", "current"}));
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  examples::apply_amp_lr_default(app, amp_flags, flags);

  return examples::run_main("amp_ddp", [&] {
    examples::check_common_flags(flags);
    // First: from here on --stop-signal stops the run at a step boundary the ranks agree on, which saves it.
    const std::unique_ptr<run::StopSignal> stop_signal = examples::watch_stop_signal(flags);
    const int local_rank = examples::local_rank_from_launcher(argc, argv, "amp_ddp");
    // Before joining: the first process of each node speaks for the choice every rank makes alike.
    examples::resume_from_checkpoint_dir(flags, examples::Rank{local_rank, 1}, amp::verify_checkpoint);
    const torch::Device device = examples::pick_device(flags.device, local_rank);
    torch::manual_seed(flags.seed);
    const examples::Data data = examples::load_data(flags);
    const int64_t train_samples = data.train.images.size(0);
    examples::SmallCnn net(examples::SmallCnnOptions().sync_batch_norm(ddp_flags.sync_batch_norm));
    net->to(device);
    auto inner = examples::make_amp_optimizer(amp_flags.optimizer, net->parameters(), flags.lr);
    auto initialized = amp::initialize(
        net, *inner,
        examples::amp_options(amp_flags.opt_level, examples::half_dtype(amp_flags.dtype, device), more.fp8));
    auto& model = initialized.model;  // (not a structured binding: the lambdas below capture them)
    auto& optimizer = initialized.optimizer;
    const auto zero_stage = static_cast<amp::ZeroStage>(more.zero);
    const bool zero = zero_stage != amp::ZeroStage::kNone;
    std::optional<run::RunState> saved;    // the run state travels in the amp checkpoint as an extra
    if (!flags.resume.empty() && !zero) {  // model + optimizer + amp (ZeRO: after attach, below)
      saved = examples::load_amp_checkpoint(flags.resume, model, optimizer);
    }
    // Data and --resume are read before joining the group: a bad file is this rank's own one-line error.
    ddp::InitOptions init;
    if (device.is_cuda()) init.cuda_device(device.index());
    ddp::ProcessGroup group = ddp::init_process_group(init.backend(examples::backend_for(device)));
    const examples::Rank rank{group.rank(), group.size()};
    if (stop_signal) stop_signal->join(group);  // the ranks agree on where to stop through the group's store
    // The ranks' gradients are allreduced, so they overflow alike: rank 0's overflow lines speak for all.
    if (rank.rank != 0) optimizer.set_overflow_logger([](const std::string&) {});
    // Every rank refuses a global batch that does not split among the processes, before any collective (else rank 0
    // alone would, and the others would fail in the model's broadcast).
    run::DistributedSampler sampler = examples::sampler_from(flags, train_samples, rank);
    // The SyncBatchNorm layers were built before the group existed (so that --resume is read first).
    if (ddp_flags.sync_batch_norm) ddp::set_sync_batch_norm_process_group(*net, group);
    ddp::DistributedDataParallel ddp(net, group);
    if (saved) ddp.restore_gradient_order(saved->ddp_gradient_order);  // the saved run's bucket layout (collective)
    // Each bucket is unscaled and checked as soon as its allreduce (--zero 2: reduce-scatter) completes.
    optimizer.attach(ddp, zero_stage);
    if (!flags.resume.empty() && zero) {  // collective: every rank takes its shard
      saved = examples::load_amp_checkpoint(flags.resume, model, optimizer);
    }
    std::string header_line;
    {
      examples::RunHeader header;
      header.processes = rank.world_size;
      header.backend = group.backend_name();
      header.where = "device " + device.str() + " on rank 0";
      header.precision =
          amp_flags.opt_level + " " + examples::dtype_name(examples::half_dtype(amp_flags.dtype, device));
      header.optimizer = examples::amp_optimizer_description(amp_flags.optimizer);
      header.extras = std::string(ddp_flags.sync_batch_norm ? " | SyncBatchNorm over all ranks" : "") +
                      (zero ? fmt::format(" | ZeRO stage {}", more.zero) : std::string()) +
                      (more.fp8 != "off" ? fmt::format(" | FP8 {} scaling", more.fp8) : std::string());
      header_line = examples::run_header_line(flags, data, header);
      if (rank.rank == 0) fmt::print("{}\n", header_line);  // the first line, before a resume's "resuming at ..."
    }
    run::TrainingPosition position;
    if (!flags.resume.empty()) {
      position = examples::resume_position(flags.resume, saved, flags, rank.world_size, train_samples, rank);
    }

    const run::Checkpoints checkpoints = examples::checkpoints_from(flags);
    const auto save = [&](const run::TrainingPosition& at) {  // ZeRO: collective (rank 0 writes the file)
      const auto state = examples::capture_run_state(flags, rank.world_size, train_samples, at, ddp.gradient_order());
      checkpoints.save(
          at.steps,
          [&](const std::string& path) {
            examples::save_amp_checkpoint(path, model, optimizer, state, /*announce=*/rank.rank == 0);
          },
          /*writer=*/rank.rank == 0);
    };
    const bool saves_here = rank.rank == 0 || zero;  // ZeRO: the masters and optimizer state come from every rank
    run::Monitor monitor(examples::monitor_options(flags, position, sampler.batches_per_epoch()), rank.rank,
                         rank.world_size, device,
                         {header_line, [&] { return run::step_values(*inner, &optimizer); }, &group, &ddp});
    const run::TrainingPosition start = position;
    bool preempted = examples::stop_signalled(stop_signal.get(), position);  // (a signal during the start)
    while (position.epoch <= flags.epochs && !examples::stop_requested(flags, start, position) && !preempted) {
      const int64_t epoch = position.epoch;
      sampler.set_epoch(epoch, position.batches_done);
      monitor.begin_epoch(epoch, sampler.batches_per_epoch(), position.batches_done, position.epoch_loss);
      while (const auto indices = sampler.next()) {
        const auto [images, labels] = data.train.batch(*indices, device);
        run::StepPhases& phases = monitor.begin_step();
        optimizer.zero_grad();
        // amp's cast policy around DDP's forward (Apex: amp.initialize, then DDP over the initialized model).
        auto out = model.call([&](const torch::Tensor& in) { return ddp.forward(in); }, images);
        auto loss = torch::cross_entropy_loss(out, labels);
        phases.end(run::Phase::kForward);
        {
          auto scaled = amp::scale_loss(loss, optimizer);  // Apex's `with amp.scale_loss(loss, optimizer)`
          scaled.backward();  // DDP averages the scaled gradients; amp unscales and checks each bucket
        }
        phases.end(run::Phase::kBackward);
        optimizer.step();  // skipped on the device when a gradient overflowed
        phases.end(run::Phase::kOptimizer);
        const double step_loss = loss.item<double>();  // the step's one host sync
        position.step_done(sampler.batches_done(), sampler.batches_per_epoch(), step_loss);
        preempted = examples::stop_signalled(stop_signal.get(), position);  // the same answer on every rank
        const bool stop = examples::stop_requested(flags, start, position) || preempted;
        monitor.step(step_loss, indices->numel() * rank.world_size, /*last=*/stop);
        if (saves_here && checkpoints.due(position.steps)) {
          monitor.interrupt();
          save(position);
        }
        if (stop) break;
      }
      const double mean_loss = monitor.epoch_trained();
      if (position.epoch > epoch) {
        std::optional<double> accuracy;  // rank 0 alone evaluates, through amp's policy on the module itself
        if (rank.rank == 0) {
          accuracy = examples::print_epoch_result(
              static_cast<int>(epoch), flags.epochs, mean_loss,
              examples::test_accuracy(
                  *net, [&](const torch::Tensor& x) { return model.forward(x); }, data.test, device));
        }
        monitor.end_epoch(accuracy);
      }
    }
    monitor.finish();
    examples::print_if_stopped(flags, start, position, rank);
    examples::check_replicas_if_asked(ddp_flags, *net, group);  // the model's weights (half under O2)
    if (saves_here && checkpoints.final_save_needed(start, position)) save(position);  // (a stop's save too)
    group.barrier();
    return preempted ? examples::stopped_resumable(flags, *stop_signal, rank, position) : 0;
  });
}
