#pragma once

// The PyTorch peer of the AMP benchmark: benchmarks/peers/torch_amp_peer.py (torch.autocast + torch.amp.GradScaler
// on the same architecture, sizes, batch and steps), run as a subprocess, its one-line results parsed back.

#include <cstdint>
#include <string>
#include <vector>

#include "common/amp_report.h"

namespace bench {

struct TorchPeerRequest {
  std::string python;               // interpreter with torch
  std::string script;               // path of torch_amp_peer.py
  std::string model;                // "cnn" or "transformer"
  std::string device;               // "cpu", "cuda:0"
  std::vector<std::string> dtypes;  // "bf16", "fp16"
  int64_t steps = 0, warmup = 0, rounds = 1, batch_size = 0;
  int threads = 0;  // intra-op CPU threads (> 0), as ours
  uint64_t seed = 0;
  double lr = 0.0;
  std::vector<std::string> model_args;  // e.g. {"--vocab", "512", ...}
  std::string log_path;                 // the script's stderr goes here
};

/// The Python to use: <source_dir>/.venv/bin/python when it exists, else python3 from PATH.
std::string default_python(const std::string& source_dir);

/// Runs the peer once for all dtypes and returns one row per dtype (kind "torch.amp"). When the peer cannot
/// run at all (no torch in that Python, interpreter missing, script failed) it returns no rows and sets
/// *skip_reason to why.
std::vector<RunResult> run_torch_amp_peer(const TorchPeerRequest& request, std::string* skip_reason);

}  // namespace bench
