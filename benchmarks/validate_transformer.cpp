// The tiny transformer's half of the accuracy validation (issue 26, benchmarks/validate_accuracy.sh --task
// transformer): trains benchmarks/common's TinyTransformer on its synthetic bigram tokens under one precision and
// parallel configuration and prints the held-out next-token loss, next to the lowest loss any model can reach on
// that data (the bigram rule's entropy). Started like amp_ddp, by a launcher (one process: FP32 and the
// precision configurations; 2 or 4: DDP, ZeRO and full sharding):
//   ddp-launch --nproc-per-node 2 bench_validate_transformer --opt-level O2 --dtype bf16 --zero 1 --seed 1
//   ddp-launch --nproc-per-node 2 bench_validate_transformer --opt-level O2 --fsdp --seed 1
// --fsdp: full sharding (docs/fsdp.md) instead of DDP, each block a ddp::ShardedUnit, amp over it (O2 gathers the
// blocks in the half dtype from fp32 shards; --fp8 runs the blocks' layers in FP8); every rank takes part in the
// held-out evaluation (its forwards gather).
// The recipe: --steps steps of --global-batch-size sequences (split evenly among the processes, so every process
// count takes the same sequences per step), amp::FusedAdamW (torch's AdamW: weight decay 0.01) with the usual
// transformer schedule: --lr reached linearly over the first --warmup-steps, then a cosine decay to 0 at the last
// step (a constant rate left the held-out loss wandering by +-0.02 from one step count to the next, which would have
// been read as differences between configurations). The sequences, their order and the initial weights follow from
// --seed alone.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include <amp/amp.h>
#include <amp/optim/fused_optimizers.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/fsdp/fully_sharded.h>
#include <ddp/progress.h>
#include <fmt/format.h>

#include "common/ddp_worker.h"
#include "common/training_tasks.h"

namespace {

struct Flags {
  std::string opt_level = "O0";
  std::string dtype = "bf16";
  std::string fp8 = "off";
  int zero = 0;
  bool fsdp = false;
  int64_t steps = 200;  // the recipe of RESULTS.md's table
  int64_t global_batch_size = 32;
  double lr = 1e-3;
  int64_t warmup_steps = 20;
  uint64_t seed = 1;
  int64_t eval_sequences = 4096;
  std::string device = "auto";
  bool activation_checkpointing = false;
  int local_rank = 0;  // the legacy launcher's --local_rank
};

constexpr double kWeightDecay = 1e-2;  // torch.optim.AdamW's default
constexpr int kProgressLines = 5;      // rank 0 prints the mean loss this many times in a run

/// The learning rate of step `step` (0-based) of `steps`: linear warmup to `peak` over `warmup` steps (step s, 1-based,
/// gets peak * s / warmup), then cosine decay: step s > warmup gets peak * (1 + cos(pi * (s - warmup) / (steps -
/// warmup))) / 2, which reaches 0 at the last step.
double scheduled_lr(double peak, int64_t step, int64_t steps, int64_t warmup) {
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double span = static_cast<double>(std::max<int64_t>(1, steps - warmup));
  const double progress = static_cast<double>(step - warmup + 1) / span;
  const double pi = std::acos(-1.0);
  return peak * 0.5 * (1.0 + std::cos(pi * std::min(1.0, progress)));
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"TinyTransformer held-out loss under one amp / DDP / ZeRO configuration (started by ddp-launch)"};
  app.option_defaults()->always_capture_default();
  app.add_option("--opt-level", flags.opt_level, "O0 (fp32), O1 (autocast), O2 (half model, fp32 masters), O3")
      ->check(CLI::IsMember({"O0", "O1", "O2", "O3"}));
  app.add_option("--dtype", flags.dtype, "Half dtype of O1-O3: fp16 or bf16")->check(CLI::IsMember({"fp16", "bf16"}));
  app.add_option("--fp8", flags.fp8, "FP8 GEMMs in the Float8Linear layers (O1/O2): off, delayed or current")
      ->check(CLI::IsMember({"off", "delayed", "current"}));
  app.add_option("--zero", flags.zero, "ZeRO stage: 0, 1 or 2")->check(CLI::IsMember({0, 1, 2}));
  app.add_flag("--fsdp", flags.fsdp,
               "Full sharding (ZeRO stage 3) instead of DDP: each block a unit, amp over the shards (O0-O2)");
  app.add_option("--steps", flags.steps, "Optimizer steps");
  app.add_option("--global-batch-size", flags.global_batch_size, "Sequences per step, all processes together");
  app.add_option("--lr", flags.lr, "AdamW's peak learning rate");
  app.add_option("--warmup-steps", flags.warmup_steps, "Steps of linear warmup to --lr (then cosine decay to 0)");
  app.add_option("--seed", flags.seed, "Seed of the data, its order and the initial weights");
  app.add_option("--eval-sequences", flags.eval_sequences, "Held-out sequences scored after training");
  app.add_option("--device", flags.device, "auto, cpu, cuda or cuda:N");
  app.add_flag("--activation-checkpointing", flags.activation_checkpointing,
               "Each transformer block keeps only its input and is recomputed in backward (same results)");
  examples::add_local_rank_flag(app, flags.local_rank);
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;

  return examples::run_main("bench_validate_transformer", [&] {
    examples::require_positive("--steps", flags.steps);
    examples::require_positive("--global-batch-size", flags.global_batch_size);
    examples::require_positive("--eval-sequences", flags.eval_sequences);
    // (At least two steps after the warmup: the last one's rate is 0.)
    if (flags.warmup_steps < 0 || flags.warmup_steps > flags.steps - 2) {
      throw std::invalid_argument(fmt::format("--warmup-steps must lie in [0, --steps - 2] = [0, {}], got {}",
                                              flags.steps - 2, flags.warmup_steps));
    }
    if (!(flags.lr > 0 && std::isfinite(flags.lr))) {
      throw std::invalid_argument(fmt::format("--lr must be positive and finite, got {}", flags.lr));
    }
    if (flags.fp8 != "off" && (flags.opt_level == "O0" || flags.opt_level == "O3")) {
      throw std::invalid_argument(
          fmt::format("--fp8 {} needs --opt-level O1 or O2, got {}", flags.fp8, flags.opt_level));
    }
    if (flags.fsdp && flags.zero != 0) {
      throw std::invalid_argument(fmt::format(
          "--fsdp and --zero {} are two ways of sharding: full sharding shards what ZeRO does and the parameters too; "
          "choose one",
          flags.zero));
    }
    if (flags.fsdp && flags.opt_level == "O3") {
      throw std::invalid_argument("--fsdp takes --opt-level O0, O1 or O2, got O3 (the fp32 shards are the masters)");
    }
    const int local_rank = examples::local_rank_from_launcher(argc, argv, "bench_validate_transformer");
    // Refused before anything is built: every rank sees the same WORLD_SIZE, so every rank says it.
    const int64_t world = ddp::launch_env_from_environment().world_size;
    if (flags.global_batch_size % world != 0) {
      throw std::invalid_argument(fmt::format("--global-batch-size {} does not split evenly among {} processes",
                                              flags.global_batch_size, world));
    }
    const torch::Device device = examples::pick_device(flags.device, local_rank);
    const c10::ScalarType half = flags.dtype == "fp16" ? at::kHalf : at::kBFloat16;

    bench::TransformerTask::Settings settings;
    settings.steps = flags.steps;
    settings.batch_size = flags.global_batch_size;
    settings.eval_sequences = flags.eval_sequences;
    settings.lr = flags.lr;
    settings.seed = flags.seed;
    settings.model.activation_checkpointing(flags.activation_checkpointing).sharded_blocks(flags.fsdp);
    const bench::TransformerTask task(settings, device);

    ddp::InitOptions init;
    if (device.is_cuda()) init.cuda_device(device.index());
    ddp::ProcessGroup group = ddp::init_process_group(init.backend(examples::backend_for(device)));
    const int rank = group.rank();
    const int64_t per_rank = flags.global_batch_size / world;

    auto net = task.make_model();  // seeded: every rank starts from the same weights
    const amp::Options amp_options = examples::amp_options(flags.opt_level, half, flags.fp8);
    // DDP + amp (and ZeRO), or amp over full sharding: the optimizer over the model's parameters or the shards.
    std::unique_ptr<ddp::FullyShardedDataParallel> fsdp;
    std::unique_ptr<ddp::DistributedDataParallel> ddp;
    std::unique_ptr<amp::FusedAdamW> inner;
    std::optional<amp::Initialized<bench::TinyTransformer>> replicated;
    std::optional<amp::Initialized<amp::FullyShardedModule>> fully_sharded;
    const auto adam = amp::FusedAdamOptions(flags.lr).weight_decay(kWeightDecay);
    if (flags.fsdp) {
      ddp::FullyShardOptions shard_options;
      if (flags.opt_level == "O2") shard_options.param_dtype(half);
      fsdp = std::make_unique<ddp::FullyShardedDataParallel>(net, group, shard_options);
      inner = std::make_unique<amp::FusedAdamW>(fsdp->parameters(), adam);
      fully_sharded.emplace(amp::initialize(*fsdp, *inner, amp_options));
    } else {
      inner = std::make_unique<amp::FusedAdamW>(net->parameters(), adam);
      replicated.emplace(amp::initialize(net, *inner, amp_options));
      ddp = std::make_unique<ddp::DistributedDataParallel>(net, group);
      replicated->optimizer.attach(*ddp, static_cast<amp::ZeroStage>(flags.zero));
    }
    amp::Optimizer& optimizer = fsdp ? fully_sharded->optimizer : replicated->optimizer;
    const auto train_forward = [&](const torch::Tensor& x) {
      if (fsdp) return fully_sharded->model.forward(x);
      return replicated->model.call([&](const torch::Tensor& in) { return ddp->forward(in); }, x);
    };
    // Through the model as trained: O2, O3 and FP8 score their half-precision model (logits rounded to bf16/fp16).
    const auto eval_forward = [&](const torch::Tensor& x) {
      return fsdp ? fully_sharded->model.forward(x) : replicated->model.forward(x);
    };
    if (rank == 0) {
      fmt::print("{} process(es) ({}), device {} on rank 0 | {} {}{}{} | {} (peak), {} warmup steps, cosine decay\n",
                 world, group.backend_name(), device.str(), flags.opt_level,
                 flags.opt_level == "O0" ? "fp32" : flags.dtype, flags.fp8 != "off" ? " + FP8 " + flags.fp8 : "",
                 flags.fsdp   ? " | full sharding"
                 : flags.zero ? fmt::format(" | ZeRO {}", flags.zero)
                              : "",
                 task.description(), flags.warmup_steps);
    }

    auto loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(device));
    int64_t summed = 0;
    const int64_t report_every = std::max<int64_t>(1, flags.steps / kProgressLines);
    for (int64_t step = 0; step < flags.steps; ++step) {
      const bench::Batch whole = task.batch(step);
      const bench::Batch mine{whole.input.narrow(0, rank * per_rank, per_rank),
                              whole.target.narrow(0, rank * per_rank, per_rank)};
      // (ZeRO keeps the groups' options: setting them schedules the shards too, docs/zero.md.)
      for (auto& group_of_params : optimizer.inner().param_groups()) {
        group_of_params.options().set_lr(scheduled_lr(flags.lr, step, flags.steps, flags.warmup_steps));
      }
      optimizer.zero_grad();
      auto logits = train_forward(mine.input);
      // (The loss runs outside the amp policy: O1's bf16/fp16 logits are widened first, as autocast would.)
      auto loss = task.loss(logits.to(torch::kFloat), mine);
      {
        auto scaled = amp::scale_loss(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
      loss_sum.add_(loss.detach());  // in place, fp32 into fp64; no host sync until the report
      ++summed;
      if (rank == 0 && (step + 1) % report_every == 0) {
        fmt::print("step {}/{}: mean training loss {:.4f} (rank 0's batches since the last line)\n", step + 1,
                   flags.steps, loss_sum.item<double>() / static_cast<double>(summed));
        loss_sum.zero_();
        summed = 0;
      }
    }
    if (rank == 0 || fsdp) {  // full sharding: every rank's forward takes part in gathering the blocks
      std::optional<ddp::ProgressPause> pause;
      if (!fsdp) pause.emplace("the held-out evaluation");  // the others wait in the barrier below
      torch::NoGradGuard no_grad;
      net->eval();
      const auto held_out = task.held_out(eval_forward);
      const auto diagnostics = optimizer.scaler().diagnostics_now();
      if (rank == 0) {
        fmt::print("held-out loss {:.4f} | next-token accuracy {:.2f}% | loss floor {:.4f} | skipped steps {}\n",
                   held_out.loss, 100.0 * held_out.accuracy, task.loss_floor(), diagnostics.skipped_steps);
      }
    }
    group.barrier();
    return 0;
  });
}
