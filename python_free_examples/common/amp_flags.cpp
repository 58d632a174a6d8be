#include "common/amp_flags.h"

#include <fmt/format.h>

#include <amp/optim/fused_optimizers.h>

namespace examples {
namespace {

constexpr double kAdamWeightDecay = 1e-2;
constexpr double kAdamWDefaultLr = 1e-3;

}  // namespace

void add_amp_flags(CLI::App& app, AmpFlags& amp_flags, const CommonFlags& flags) {
  app.add_option("--opt-level", amp_flags.opt_level, "O0 (fp32), O1 (autocast), O2 (half model, fp32 masters), O3")
      ->check(CLI::IsMember({"O0", "O1", "O2", "O3"}));
  app.add_option("--dtype", amp_flags.dtype, "Half dtype: fp16, bf16, or auto: fp16 on CUDA, bf16 on the CPU")
      ->check(CLI::IsMember({"auto", "fp16", "bf16"}));
  app.add_option("--optimizer", amp_flags.optimizer, "amp::FusedSGD (sgd) or amp::FusedAdamW (adamw)")
      ->check(CLI::IsMember({"sgd", "adamw"}));
  app.get_option("--lr")
      ->default_str(fmt::format("sgd:{},adamw:{}", flags.lr, kAdamWDefaultLr))
      ->description("Learning rate (> 0, finite); without it, the --optimizer's: 0.05 for sgd, 0.001 for adamw");
}

void apply_amp_lr_default(const CLI::App& app, const AmpFlags& amp_flags, CommonFlags& flags) {
  if (amp_flags.optimizer == "adamw" && app.get_option("--lr")->count() == 0) flags.lr = kAdamWDefaultLr;
}

std::unique_ptr<torch::optim::Optimizer> make_amp_optimizer(const std::string& name,
                                                            const std::vector<torch::Tensor>& params, double lr) {
  if (name == "adamw") {
    return std::make_unique<amp::FusedAdamW>(params, amp::FusedAdamOptions(lr).weight_decay(kAdamWeightDecay));
  }
  return std::make_unique<amp::FusedSGD>(params, amp::FusedSgdOptions(lr).momentum(kSgdMomentum));
}

std::string amp_optimizer_description(const std::string& name) {
  if (name == "adamw") return fmt::format("FusedAdamW weight decay {}", kAdamWeightDecay);
  return sgd_description("FusedSGD");
}

c10::ScalarType half_dtype(const std::string& name, const torch::Device& device) {
  if (name == "auto") return device.is_cuda() ? at::kHalf : at::kBFloat16;
  return name == "fp16" ? at::kHalf : at::kBFloat16;
}

}  // namespace examples
