#pragma once

#include <ddp/process_group.h>

#include "common/example_flags.h"

namespace examples {

/// Registers the legacy launcher's --local_rank / --local-rank on `app` (its value is read by
/// local_rank_from_launcher; `storage` only keeps CLI11 from rejecting it).
void add_local_rank_flag(CLI::App& app, int& storage);

/// For a process started by ddp-launch or torchrun: --local_rank / --local-rank when given, else LOCAL_RANK.
/// Throws with the command to use when the launcher's variables are absent.
int local_rank_from_launcher(int argc, const char* const* argv, const std::string& program);

/// The flags of the multi-process examples beyond CommonFlags.
struct DdpFlags {
  bool check_replicas = false;   // after training, every rank's parameters must be bit-identical
  bool sync_batch_norm = false;  // the CNN normalizes with ddp::SyncBatchNorm over the DDP process group
};

/// Registers DdpFlags on `app`: --check-replicas, --sync-bn.
void add_ddp_flags(CLI::App& app, DdpFlags& flags);

/// With --check-replicas: compares every rank's parameters (ddp::check_replicas, collective), and with --sync-bn
/// also the buffers (without it, BatchNorm's buffers hold each rank's last local statistics), and prints
/// "replicas: all N ranks hold bit-identical parameters[ and buffers] (FNV-1a 0x...)" on rank 0; throws on every
/// rank, naming the ranks that differ, when they do not. Without it: nothing.
void check_replicas_if_asked(const DdpFlags& flags, const torch::nn::Module& module, const ddp::ProcessGroup& group);

/// "nccl" for a CUDA device, "gloo" otherwise.
std::string backend_for(const torch::Device& device);

}  // namespace examples
