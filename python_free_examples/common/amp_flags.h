#pragma once

// The amp flags of the examples that train with amp (amp_ddp, amp_fsdp): --opt-level, --dtype and --optimizer, and
// the optimizer they build.

#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "common/example_flags.h"

namespace examples {

struct AmpFlags {
  std::string opt_level = "O1";
  std::string dtype = "auto";  // fp16 on CUDA, bf16 on the CPU (which has no fast fp16)
  std::string optimizer = "sgd";
};

/// --opt-level, --dtype and --optimizer; and --lr's default for each optimizer (adamw's when --lr is not given, after
/// parsing: apply_amp_lr_default).
void add_amp_flags(CLI::App& app, AmpFlags& amp_flags, const CommonFlags& flags);
/// Without --lr, adamw's learning rate (SGD's 0.05 makes Adam diverge).
void apply_amp_lr_default(const CLI::App& app, const AmpFlags& amp_flags, CommonFlags& flags);

/// amp::FusedAdamW (adamw, weight decay 1e-2) or amp::FusedSGD with the examples' momentum (sgd) over `params`.
std::unique_ptr<torch::optim::Optimizer> make_amp_optimizer(const std::string& name,
                                                            const std::vector<torch::Tensor>& params, double lr);
/// How the header names that optimizer.
std::string amp_optimizer_description(const std::string& name);
/// --dtype: "auto" is fp16 on CUDA, bf16 on the CPU.
c10::ScalarType half_dtype(const std::string& name, const torch::Device& device);

}  // namespace examples
