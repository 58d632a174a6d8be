#pragma once

// What a Python peer of a benchmark trains on, handed over as bytes rather than re-created: our initial weights,
// our data and our batch order, written with torch::pickle_save (Python reads it with torch.load), and a digest of
// tensor bytes that both sides compute the same way, so each can prove it trained on exactly what the other did.
// Digest: benchmarks/peers/peer_bundle.py computes the same one in Python.

#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace bench {

/// Named tensors in a fixed order (the order is part of the contract: digests follow it).
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Writes `tensors` (moved to the CPU, made contiguous; any dtype) to `path` as a pickled dict str -> Tensor that
/// Python's torch.load(path, weights_only=True) reads with the same keys in the same order. Throws naming the path
/// and the duplicate when a name repeats, or the path when it cannot be written.
void save_peer_bundle(const std::string& path, const NamedTensors& tensors);

/// Reads what save_peer_bundle wrote (or torch.save of a dict str -> Tensor), CPU tensors in the stored order.
/// Throws naming the path when it is missing or not such a dict.
NamedTensors load_peer_bundle(const std::string& path);

/// The module's parameters, then its buffers, by their dotted names ("conv1.weight", "bn1.running_mean"), as
/// Python's state_dict() names them. The tensors are the module's own (not copies).
NamedTensors module_state(const torch::nn::Module& module);

/// A 16-hex-digit digest of the bytes, shapes and dtypes' element sizes of `tensors`, in order (any device;
/// copied to the CPU). Per tensor: the sum of its bytes and the sum of byte[i] * (i mod 65521 + 1), folded with
/// its element count, shape and element size into h = (h * 1000003 + x) mod (2^61 - 1). Integer arithmetic
/// only, so Python (peers/peer_bundle.py) gets the same digest from the same bytes on any thread count. Not
/// cryptographic: it tells identical from accidentally different, not from adversarial.
std::string byte_digest(const std::vector<at::Tensor>& tensors);

/// byte_digest of the tensors of `named`, in order.
std::string byte_digest(const NamedTensors& named);

}  // namespace bench
