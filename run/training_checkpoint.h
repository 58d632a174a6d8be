#pragma once

// One checkpoint file that continues a run: the model, the optimizer and the run's state (run::RunState: the
// position, the data order's facts, the CPU generator, DDP's bucket order) together, so that loading it puts a loop
// back exactly where it was (docs/run.md, "Exact resume"). Two kinds, by optimizer:
//   - a plain LibTorch optimizer (torch::optim::SGD, Adam, ...): an archive with "model", "optimizer" and
//     "run_state" parts, written atomically;
//   - amp's (amp::initialize): amp::save_checkpoint, with the run state as its extra run::kRunStateExtra (and amp's
//     checksums, loss scaler and master weights).

#include <optional>
#include <string>

#include <amp/amp.h>
#include <run/run_state.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

namespace run {

/// Saves `module`, `optimizer` and `state` to `path`, atomically (amp::save_archive_atomically): a writer stopped at
/// any point leaves the previous file whole.
void save_training_checkpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                              const RunState& state);

/// Loads what save_training_checkpoint wrote into `module` and `optimizer`, and returns its run state (nullopt for a
/// file written without one). Throws std::runtime_error with one line for a file that is not such a checkpoint:
/// "cannot read it as a checkpoint: <the zip reader's reason>" (random bytes, truncated; amp::short_archive_error),
/// "no 'model' part: ..."; LibTorch's own error for another model's weights.
std::optional<RunState> load_training_checkpoint(const std::string& path, torch::nn::Module& module,
                                                 torch::optim::Optimizer& optimizer);

/// amp::save_checkpoint of `model` and `optimizer` with `state` as the extra run::kRunStateExtra (one file,
/// atomically; under ZeRO every rank calls it, as amp::save_checkpoint requires).
template <typename ModuleHolder>
void save_training_checkpoint(const std::string& path, const amp::Model<ModuleHolder>& model, amp::Optimizer& optimizer,
                              const RunState& state) {
  amp::save_checkpoint(path, model, optimizer, {{kRunStateExtra, encode_run_state(state)}});
}

/// amp::load_checkpoint of `path` into `model` and `optimizer` (its errors: c10::Error, one line naming the file),
/// and the run state it holds (nullopt for a file saved without one).
template <typename ModuleHolder>
std::optional<RunState> load_training_checkpoint(const std::string& path, amp::Model<ModuleHolder>& model,
                                                 amp::Optimizer& optimizer) {
  amp::CheckpointExtras extras;
  amp::load_checkpoint(path, model, optimizer, extras);
  const auto entry = extras.find(kRunStateExtra);
  if (entry == extras.end()) return std::nullopt;
  return decode_run_state(entry->second);
}

}  // namespace run
