#pragma once

// The PyTorch peer of the AMP benchmark: benchmarks/peers/torch_amp_peer.py (torch.autocast + torch.amp.GradScaler
// on the same architecture), run as one long-lived subprocess per model that trains on our bundle (weights, data,
// batch order: common/peer_bundle.h) and is driven one line at a time, so its timed steps take turns with ours.

#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace bench {

struct TorchPeerRequest {
  std::string python;  // interpreter with torch
  std::string script;  // path of torch_amp_peer.py
  std::string bundle;  // written by save_peer_bundle: weights/<name>, and the task's data and order
  std::string model;   // "cnn" or "transformer"
  std::string device;  // "cpu", "cuda:0"
  int threads = 0;     // intra-op CPU threads (> 0), as ours
  int64_t batch_size = 0;
  double lr = 0.0;
  std::vector<std::string> model_args;  // e.g. {"--vocab", "512", ...}
  std::string log_path;                 // the script's stderr goes here
};

/// The Python to use: <source_dir>/.venv/bin/python when it exists, else python3 from PATH.
std::string default_python(const std::string& source_dir);

/// One running peer process. Not copyable; the destructor asks it to quit and reaps it.
class TorchAmpPeer {
 public:
  /// Starts the peer and waits for its "ready" line (it has loaded the bundle and digested its batches). Returns
  /// nullptr and sets *skip_reason when it cannot run at all (interpreter missing, no torch, died on start).
  static std::unique_ptr<TorchAmpPeer> start(const TorchPeerRequest& request, std::string* skip_reason);
  ~TorchAmpPeer();
  TorchAmpPeer(const TorchAmpPeer&) = delete;
  TorchAmpPeer& operator=(const TorchAmpPeer&) = delete;

  /// byte_digest of every step's input and target as the peer builds them (from its "ready" line).
  const std::string& batch_digest() const { return batch_digest_; }
  /// Steps the peer's data has (the C++ task's num_steps(), if the bundle is right).
  int64_t num_steps() const { return num_steps_; }

  /// Sends one command line ("create bf16", "train bf16 3 7", "finish bf16") and returns the reply's key=value
  /// fields. Throws with the peer's own message when it answers "error ...", or naming the log when it died.
  std::map<std::string, std::string> call(const std::string& command);

 private:
  TorchAmpPeer() = default;
  std::string read_line();

  pid_t pid_ = -1;
  FILE* to_peer_ = nullptr;
  FILE* from_peer_ = nullptr;
  std::string log_path_;
  std::string batch_digest_;
  int64_t num_steps_ = 0;
};

/// fields[key] as a number; throws naming the key and the reply when it is missing or not a number.
double number_field(const std::map<std::string, std::string>& fields, const std::string& key);

}  // namespace bench
