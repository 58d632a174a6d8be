// The tutorial's third way: one command starts everything; the program forks its own workers with ddp::spawn
// (torch.multiprocessing.spawn's counterpart) and they meet at tcp://127.0.0.1:PORT.
//   ./ddp_spawn --nproc 2 --synthetic
#include <cstdlib>
#include <stdexcept>

#include <ddp/launch/spawn.h>
#include <fmt/format.h>

#include "common/ddp_worker.h"

int main(int argc, char** argv) {
  examples::CommonFlags flags;
  examples::DdpFlags ddp_flags;
  int nproc = 2;
  int port = 0;
  CLI::App app{"DDP on Fashion-MNIST with workers spawned by the program itself"};
  examples::add_common_flags(app, flags);
  examples::add_ddp_flags(app, ddp_flags);
  app.add_option("--nproc", nproc, "Worker processes (one per GPU on a GPU machine)");
  app.add_option("--port", port, "Rendezvous port on 127.0.0.1 (0: a free one)");
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;

  return examples::run_main("ddp_spawn", [&] {
    examples::check_common_flags(flags);
    examples::require_positive("--nproc", nproc);
    if (port < 0 || port > 65535) {
      throw std::invalid_argument(fmt::format("--port must be 0 (a free one) or in 1..65535, got {}", port));
    }
    // Fork before CUDA: the parent must not touch the GPU, so the workers pick their devices themselves.
    ddp::spawn(
        nproc,
        [&](int local_rank, int /*nprocs*/) {
          // ddp::spawn exports the port it chose (a free one when --port is 0) as MASTER_PORT.
          const char* chosen_port = std::getenv("MASTER_PORT");
          TORCH_CHECK(chosen_port != nullptr, "ddp_spawn: MASTER_PORT is not set in the worker");
          const std::string init_method = fmt::format("tcp://127.0.0.1:{}", chosen_port);
          examples::train_ddp_worker(flags, ddp_flags, ddp::InitOptions().init_method(init_method), local_rank);
        },
        ddp::SpawnOptions().master_port(port));
  });
}
