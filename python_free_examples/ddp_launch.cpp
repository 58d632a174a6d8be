// The tutorial's second way: one process per GPU, started by a launcher that sets the environment contract
// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK):
//   ddp-launch --nproc-per-node 2 ./ddp_launch --synthetic
//   ddp-launch --nproc-per-node 2 ./ddp_launch --synthetic --sync-bn     (BatchNorm statistics over all ranks)
//   torchrun --nproc-per-node 2 --no-python ./ddp_launch --synthetic
// The legacy launcher's --local_rank / --local-rank argument is accepted too.
#include "common/ddp_worker.h"

int main(int argc, char** argv) {
  examples::CommonFlags flags;
  examples::DdpFlags ddp_flags;
  int local_rank_flag = 0;
  CLI::App app{"DDP on Fashion-MNIST, one process per device, started by ddp-launch or torchrun"};
  examples::add_common_flags(app, flags);
  examples::add_ddp_flags(app, ddp_flags);
  examples::add_local_rank_flag(app, local_rank_flag);
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;

  return examples::run_main("ddp_launch", [&] {
    examples::check_common_flags(flags);
    const int local_rank = examples::local_rank_from_launcher(argc, argv, "ddp_launch");
    examples::train_ddp_worker(flags, ddp_flags, ddp::InitOptions().init_method("env://"), local_rank);
  });
}
