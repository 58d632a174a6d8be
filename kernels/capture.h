#pragma once

// CUDA graph capture: what the library asks before doing something a capture cannot hold.
//
// Note [capture-safe step]
// A captured CUDA graph replays device work only: host code that ran during capture (reading a value, recording
// or querying an event, copying a host buffer that is later freed) does not run again, and some of it is illegal
// while the stream captures. The amp step (scale_loss scope end, clip_grad_norm_, a fused optimizer's step, the
// scale update) is therefore written so that, while capturing, it only launches kernels on device-resident data:
// the loss scaler defers its diagnostics snapshot to the next diagnostics() call outside capture, the fused
// optimizers read a learning rate written before capture or replay (FusedOptimizer::sync_lr), and l2_norm builds
// its slot table on the device. What cannot be captured (a plain torch::optim optimizer, which reads the overflow
// flag on the host; diagnostics_now(), which waits) refuses with an error while the stream captures.

#include <string>

#include <c10/core/Device.h>

namespace kernels {

/// True while the current stream of `device` is capturing a CUDA graph (also while a capture there was
/// invalidated). False for a CPU device and in a CPU-only build. Costs one cudaStreamIsCapturing call; no sync.
bool is_capturing(const c10::Device& device);

/// Throws "<what> cannot run while a CUDA graph is being captured on <device>: <why>" when is_capturing(device).
void check_not_capturing(const c10::Device& device, const std::string& what, const std::string& why);

namespace testing {
/// Makes is_capturing() report true for every device on this thread for its lifetime, so the decisions the
/// library makes while capturing can be tested on a machine without a GPU. For tests only; not nestable.
class SimulatedCapture {
 public:
  SimulatedCapture();
  ~SimulatedCapture();
  SimulatedCapture(const SimulatedCapture&) = delete;
  SimulatedCapture& operator=(const SimulatedCapture&) = delete;
};
}  // namespace testing

}  // namespace kernels
