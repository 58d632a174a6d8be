#include "common/ddp_worker.h"

#include <stdexcept>

#include <ddp/launch/launch_env.h>
#include <ddp/replica_check.h>
#include <fmt/format.h>

namespace examples {

void add_local_rank_flag(CLI::App& app, int& storage) {
  app.add_option("--local_rank,--local-rank", storage, "Set by the legacy launcher (else LOCAL_RANK is read)");
}

int local_rank_from_launcher(int argc, const char* const* argv, const std::string& program) {
  if (!ddp::launched_by_launcher()) {
    throw std::runtime_error(
        fmt::format("RANK and WORLD_SIZE are not set: start me with `ddp-launch --nproc-per-node N {0} ...` or "
                    "`torchrun --nproc-per-node N --no-python {0} ...`",
                    program));
  }
  const ddp::LaunchEnv env = ddp::launch_env_from_environment();
  return ddp::parse_local_rank_arg(argc, argv).value_or(env.local_rank);
}

void add_ddp_flags(CLI::App& app, DdpFlags& flags) {
  app.add_flag("--check-replicas", flags.check_replicas,
               "After training, check that every rank holds bit-identical parameters (exit 1 if not)");
  app.add_flag("--sync-bn", flags.sync_batch_norm,
               "Synchronized BatchNorm: batch statistics over all ranks' batches (ddp::SyncBatchNorm)");
}

void check_replicas_if_asked(const DdpFlags& flags, const torch::nn::Module& module, const ddp::ProcessGroup& group) {
  if (!flags.check_replicas) return;
  // With SyncBatchNorm every rank's running statistics are the global ones: they must agree too.
  const bool buffers = flags.sync_batch_norm;
  const uint64_t digest = ddp::check_replicas(module, group, buffers);
  if (group.rank() == 0) {
    fmt::print("replicas: all {} ranks hold bit-identical parameters{} (FNV-1a {})\n", group.size(),
               buffers ? " and buffers" : "", ddp::digest_hex(digest));
  }
}

std::string backend_for(const torch::Device& device) { return device.is_cuda() ? "nccl" : "gloo"; }

}  // namespace examples
