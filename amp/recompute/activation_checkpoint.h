#pragma once

// Activation checkpointing (docs/activation_checkpointing.md): a part of the forward that keeps only its inputs, and
// runs again in backward to rebuild its activations, as torch.utils.checkpoint (its reentrant form) does in Python.

#include <functional>
#include <vector>

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

namespace amp {

/// How activation_checkpoint recomputes.
struct ActivationCheckpointOptions {
  /// Stash the CPU generator (and, for CUDA inputs, the CUDA generator of their device) before the forward and
  /// restore it for the recompute, so that dropout draws the same masks: the gradients are those of the unwrapped
  /// function, bit for bit. false skips the stash (PyTorch's preserve_rng_state=False): cheaper, and exact only for
  /// a function that draws no random numbers.
  bool preserve_rng_state = true;
};

/// Runs `fn(inputs)` without keeping its activations: only `inputs` are kept, and backward runs `fn` again under
/// grad with the same random state and the same autocast state (CPU and CUDA: enabled, dtype) to rebuild them, then
/// backpropagates through it. Gradients reach the inputs and the leaves `fn` uses that require grad (a module's
/// parameters), and equal those of `fn` called directly. An activation `fn` uses must come in through `inputs`, not
/// be captured: backpropagating through a captured non-leaf tensor (an encoder's output) in the recompute would
/// free the graph behind it. Capture what `fn` uses by value (module.ptr()): backward calls it again later.
///
/// `fn` must compute the same thing each time it is called with the same inputs and random state: a recompute
/// whose outputs differ in number, shape or dtype from the first forward is refused with one line (c10::Error) in
/// backward. With grad enabled, at least one input must require grad (else backward would never reach `fn`: its
/// parameters would get no gradient); refused with one line. With grad disabled (evaluation) it is `fn(inputs)`.
/// As PyTorch's reentrant checkpoint: backward() only (not torch::autograd::grad or backward with `inputs`, whose
/// gradients the recompute's own backward would leak into the parameters), and no double backward; both refused
/// with one line. Autocast's cast cache is off inside `fn` (the same values, cast each time).
std::vector<torch::Tensor> activation_checkpoint(
    const std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>& fn,
    const std::vector<torch::Tensor>& inputs, const ActivationCheckpointOptions& options = {});

/// activation_checkpoint for a function of one tensor to one tensor (a block of a model).
torch::Tensor activation_checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                                    const torch::Tensor& input, const ActivationCheckpointOptions& options = {});

/// torch.utils.checkpoint.checkpoint_sequential: runs `sequential` (each module taking and returning one tensor) on
/// `input` in `segments` consecutive parts of
/// size()/segments modules (the last takes the rest), each but the last under activation_checkpoint, the last as
/// usual (its activations are needed at once by backward anyway). A part whose input does not require grad (the first
/// one, fed the data) runs as usual too: backward would not reach it through a checkpoint. Throws (one line) unless
/// 1 <= segments <= size(). With grad disabled it is sequential->forward(input).
torch::Tensor checkpoint_sequential(torch::nn::Sequential& sequential, int64_t segments, const torch::Tensor& input,
                                    const ActivationCheckpointOptions& options = {});

}  // namespace amp
