// Question: what does per-block activation checkpointing (amp::activation_checkpoint around each block of the tiny
// transformer, TinyTransformerOptions::activation_checkpointing) save in memory, and what does it cost a training
// step? Issue 40's goals: the peak activation memory at most the inputs of the wrapped blocks plus one block's
// activations (instead of every block's), and a step at most 1.4x (one more forward of the blocks; a forward is
// about a third of a step).
//
// Memory, per sequence length: the peak of the bytes allocated during one training step above what was held when it
// started (activations, their gradients, the recompute, the gradients if zero_grad freed them: the same in both
// runs), read from the allocator's own reports (common/allocation_tracker.h), for the model unwrapped and wrapped.
// The bound the wrapped peak is held to: the unwrapped peak, less L blocks' activations, plus L block inputs and
// one block's activations, where a block's activations are measured as what one block's forward keeps (less its
// output). Step time: both models, same weights and data, interleaved round by round (common/timing.h); the ratio
// of each round's times, median [min, max].
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <amp/amp.h>

#include "common/allocation_tracker.h"
#include "common/command_line.h"
#include "common/flags.h"
#include "common/timing.h"
#include "common/tiny_transformer.h"

namespace {

constexpr double kStepGoal = 1.4;

struct Sizes {
  int64_t batch, d_model, heads, layers;
  std::vector<int64_t> seq_lens;
};

struct Run {
  bench::TinyTransformer net{nullptr};
  std::unique_ptr<torch::optim::SGD> sgd;
  std::unique_ptr<amp::Initialized<bench::TinyTransformer>> amp;
};

Run make_run(const bench::TinyTransformerOptions& options, bool checkpointed, const amp::Options& amp_options,
             const torch::Device& device) {
  torch::manual_seed(1);  // the same weights in both runs
  Run run;
  run.net = bench::TinyTransformer(bench::TinyTransformerOptions(options).activation_checkpointing(checkpointed));
  run.net->to(device);
  run.sgd = std::make_unique<torch::optim::SGD>(run.net->parameters(), torch::optim::SGDOptions(1e-3));
  run.amp = std::make_unique<amp::Initialized<bench::TinyTransformer>>(amp::initialize(run.net, *run.sgd, amp_options));
  return run;
}

void step(Run& run, const torch::Tensor& tokens) {
  const int64_t seq = tokens.size(1) - 1;
  run.amp->optimizer.zero_grad();
  const torch::Tensor logits = run.amp->model(tokens.narrow(1, 0, seq));
  const torch::Tensor loss =
      torch::cross_entropy_loss(logits.to(torch::kFloat).flatten(0, 1), tokens.narrow(1, 1, seq).flatten());
  {
    auto scaled = amp::scale_loss(loss, run.amp->optimizer);
    scaled.backward();
  }
  run.amp->optimizer.step();
}

/// What one block's forward keeps for backward: bytes held after it, less its output.
int64_t block_activation_bytes(bench::AllocationTracker& tracker, const bench::TinyTransformerOptions& options,
                               const torch::Tensor& input, const amp::Options& amp_options) {
  torch::manual_seed(2);
  bench::TransformerBlock block(options);
  block->to(input.device());
  torch::optim::SGD sgd(block->parameters(), 1e-3);
  auto [model, optimizer] = amp::initialize(block, sgd, amp_options);
  const torch::Tensor x = input.detach().clone().requires_grad_();
  const int64_t before = tracker.current();
  const torch::Tensor y = model(x);
  return tracker.current() - before - static_cast<int64_t>(y.nbytes());
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

int main(int argc, char** argv) {
  bench::CommonFlags common(10);
  std::string opt_level = "O0";
  CLI::App app{
      "Per-block activation checkpointing of the tiny transformer: peak activation memory and step time, "
      "with and without (interleaved)"};
  common.add_to(app, "The GPU's sizes (sequence lengths 1024 and 2048, d_model 1024, 8 blocks)");
  app.add_option("--opt-level", opt_level, "O0 (fp32) or O1 (autocast bf16)")->check(CLI::IsMember({"O0", "O1"}));
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  const torch::Device device = common.device();
  bench::TrackAllocations tracking(device);  // before anything is allocated: every free is of a block it saw
  bench::AllocationTracker& tracker = tracking.tracker();

  const Sizes sizes = common.full ? Sizes{8, 1024, 16, 8, {1024, 2048}} : Sizes{8, 128, 4, 4, {128, 256}};
  const amp::Options amp_options =
      amp::Options().opt_level(amp::parse_opt_level(opt_level)).half_dtype(torch::kBFloat16);
  fmt::print("tiny transformer: {} blocks, d_model {}, {} heads, batch {}, {} on {}, SGD; {} timed rounds\n",
             sizes.layers, sizes.d_model, sizes.heads, sizes.batch, opt_level == "O0" ? "fp32" : "O1 bf16",
             device.str(), common.rounds);
  bool all_met = true;
  for (const int64_t seq : sizes.seq_lens) {
    const auto options = bench::TinyTransformerOptions()
                             .seq_len(seq)
                             .d_model(sizes.d_model)
                             .num_heads(sizes.heads)
                             .num_layers(sizes.layers);
    const torch::Tensor tokens = bench::synthetic_token_sequences(sizes.batch, seq, options.vocab_size(), 7).to(device);
    Run plain = make_run(options, false, amp_options, device);
    Run wrapped = make_run(options, true, amp_options, device);

    // Memory: one step each after a warmup step (the optimizer's state and the gradients exist).
    int64_t peak[2];
    Run* runs[2] = {&plain, &wrapped};
    for (int i = 0; i < 2; ++i) {
      step(*runs[i], tokens);
      bench::synchronize(device);
      tracker.reset_peak();
      const int64_t start = tracker.current();
      step(*runs[i], tokens);
      bench::synchronize(device);
      peak[i] = tracker.peak() - start;
    }
    const torch::Tensor block_input =
        torch::randn({sizes.batch, seq, sizes.d_model}, torch::TensorOptions().device(device));
    const int64_t block_bytes = block_activation_bytes(tracker, options, block_input, amp_options);
    const int64_t input_bytes = static_cast<int64_t>(block_input.nbytes());
    const int64_t bound = peak[0] - sizes.layers * block_bytes + sizes.layers * input_bytes + block_bytes;
    const bool memory_met = peak[1] <= bound;

    // Step time, interleaved.
    std::vector<bench::Contender> contenders{{"unwrapped", [&] { step(plain, tokens); }, {}},
                                             {"per block", [&] { step(wrapped, tokens); }, {}}};
    bench::run_interleaved(contenders, device, 2, common.rounds);
    std::vector<double> ratios;
    for (int r = 0; r < common.rounds; ++r) ratios.push_back(contenders[1].seconds[r] / contenders[0].seconds[r]);
    const double ratio = bench::median(ratios);
    const bool time_met = ratio <= kStepGoal;
    all_met = all_met && memory_met && time_met;

    fmt::print("\nsequence length {}:\n", seq);
    fmt::print("  peak above the step's start: unwrapped {:.2f} MiB, per block {:.2f} MiB ({:.2f}x less)\n",
               mib(peak[0]), mib(peak[1]), static_cast<double>(peak[0]) / static_cast<double>(peak[1]));
    fmt::print(
        "  one block keeps {:.2f} MiB of activations, its input is {:.2f} MiB; bound for per block = "
        "unwrapped - {} x block + {} x input + 1 x block = {:.2f} MiB: {}\n",
        mib(block_bytes), mib(input_bytes), sizes.layers, sizes.layers, mib(bound), memory_met ? "met" : "NOT met");
    fmt::print(
        "  step: unwrapped {:.1f} ms, per block {:.1f} ms (medians); per block / unwrapped {:.3f}x "
        "[{:.3f}, {:.3f}] (goal <= {:.1f}x: {})\n",
        1e3 * bench::median(contenders[0].seconds), 1e3 * bench::median(contenders[1].seconds), ratio,
        *std::min_element(ratios.begin(), ratios.end()), *std::max_element(ratios.begin(), ratios.end()), kStepGoal,
        time_met ? "met" : "NOT met");
  }
  fmt::print("\n{}\n", all_met ? "all goals met" : "a goal was missed (above)");
  return 0;
}
