// A worker program for the launcher tests, started by ddp-launch or torchrun --no-python:
//   ddp_test_worker train [--steps N] [--out DIR] [--step-delay-ms MS]
//                                                  DDP training over Gloo; checks that every rank ends with
//                                                  bit-identical parameters equal to full-batch single-process
//                                                  training, saves them to DIR/rank<R>.pt; writes the steps done
//                                                  to DIR/progress<R> as it goes, sleeping MS after each step;
//                                                  [--hang-at-step K --hang-rank R]: in the first attempt rank R
//                                                  stops making progress at step K (waits on nothing, forever);
//                                                  [--exit-zero-on-sigterm 1]: exits 0 on SIGTERM;
//                                                  [--slow-ms MS]: rank 0 takes MS more in step 0 and, paused
//                                                  (ddp::ProgressPause), in step 3
//   ddp_test_worker fail --fail-rank R --code C [--message M] [--others barrier] [--exit-delay-ms MS]
//                                                  rank R (every rank for R = all) prints M to stderr and exits
//                                                  with C after meeting the
//                                                  others; the rest sleep (or, with --others barrier, wait in a
//                                                  barrier that fails when rank R is gone); with MS, rank R
//                                                  closes its process group and takes MS more to exit
//                                                  [--fail-attempts K]: only while TORCHELASTIC_RESTART_COUNT < K
//                                                  (later attempts pass a barrier and exit 0);
//                                                  [--error-file-only 1]: M goes to the error file, not stderr
//   ddp_test_worker throw --message M              throws a c10::Error with M that nothing catches (std::terminate
//                                                  prints it and its backtrace to stderr; the process aborts)
//   ddp_test_worker compare A B                     exits 0 when the parameter files A and B hold equal tensors
//
// The timeouts are the launcher's (DDP_*_TIMEOUT_S) when it sets them, else kTimeout.
//   ddp_test_worker env --out DIR                   writes the environment contract (and --local-rank) to a file
//   ddp_test_worker sleep --out DIR                 writes DIR/ready<R>, then sleeps (signal forwarding)
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <future>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cstdio>

#include <ddp/distributed_data_parallel.h>
#include <ddp/launch/error_file.h>
#include <ddp/launch/launch_env.h>
#include <ddp/process_group.h>
#include <ddp/progress.h>
#include <torch/torch.h>

namespace {

constexpr std::chrono::milliseconds kTimeout{20000};
constexpr std::chrono::seconds kLongSleep{60};  // longer than any test waits: the launcher must stop us

std::string arg_value(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == name) return argv[i + 1];
  }
  return fallback;
}

torch::nn::Sequential make_model(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(), torch::nn::Linear(32, 4));
}

/// Rank `rank`'s batch of step `step`: each rank its own data.
std::pair<torch::Tensor, torch::Tensor> batch(int rank, int step) {
  torch::manual_seed(1000 * (rank + 1) + step);
  auto x = torch::randn({8, 8});
  auto y = torch::randn({8, 4});
  return {x, y};
}

/// Stops making progress for good: skips the step's collectives and waits for something that never comes, while the
/// other ranks wait for it in theirs (a deadlock).
[[noreturn]] void hang_forever() {
  std::promise<void> never;
  never.get_future().wait();
  std::abort();  // not reached
}

/// What train() does besides training: to test hang detection.
struct TrainFaults {
  int hang_at = -1;    // --hang-at-step: in the first attempt, rank hang_rank stops making progress at this step
  int hang_rank = -1;  // --hang-rank
  int slow_ms = 0;     // --slow-ms: rank 0 spends this long in its first step (not timed) and, in a ProgressPause,
                       // in step 3 (an evaluation or a save on one rank: the others wait for it, not timed either)
};

void train(const ddp::ProcessGroup& pg, int steps, const std::string& out, std::chrono::milliseconds step_delay,
           const TrainFaults& faults = {}) {
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const bool first_attempt = restart == nullptr || std::string(restart) == "0";
  // Different initializations: DDP must start everyone from rank 0's.
  torch::nn::Sequential model = make_model(100 + pg.rank());
  ddp::DistributedDataParallel ddp(model, pg, ddp::DistributedDataParallelOptions().bucket_cap_mb(0.001));
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < steps; ++step) {
    if (step == faults.hang_at && pg.rank() == faults.hang_rank && first_attempt) hang_forever();
    const auto [x, y] = batch(pg.rank(), step);
    opt.zero_grad();
    auto loss = torch::mse_loss(ddp.forward(x), y);
    if (pg.rank() == 0 && faults.slow_ms > 0 && step == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(faults.slow_ms));
    }
    if (pg.rank() == 0 && faults.slow_ms > 0 && step == 3) {
      const ddp::ProgressPause pause("a long evaluation");
      std::this_thread::sleep_for(std::chrono::milliseconds(faults.slow_ms));
    }
    loss.backward();
    opt.step();
    if (!out.empty()) {
      const std::string progress = out + "/progress" + std::to_string(pg.rank());
      std::ofstream(progress + ".tmp") << step + 1 << "\n";
      std::rename((progress + ".tmp").c_str(), progress.c_str());
    }
    std::this_thread::sleep_for(step_delay);
  }
  for (const auto& p : model->named_parameters()) {
    const auto all = pg.allgather(p.value().detach());
    for (size_t r = 1; r < all.size(); ++r) {
      TORCH_CHECK(torch::equal(all[0], all[r]), "parameter ", p.key(), " differs between rank 0 and rank ", r);
    }
  }
  // And they are the right ones: a single process replaying the same steps on the full batch (every rank's data)
  // from rank 0's initialization ends where DDP did, and training moved the parameters.
  torch::nn::Sequential reference = make_model(100);
  const auto initial = make_model(100)->parameters();
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < steps; ++step) {
    std::vector<torch::Tensor> xs, ys;
    for (int r = 0; r < pg.size(); ++r) {
      auto [x, y] = batch(r, step);
      xs.push_back(x);
      ys.push_back(y);
    }
    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(torch::cat(xs)), torch::cat(ys)).backward();
    ref_opt.step();
  }
  const auto mine = model->parameters(), expected = reference->parameters();
  double moved = 0;
  for (size_t i = 0; i < mine.size(); ++i) {
    // fp32 training: the sharded and full-batch gradients differ by fp32 summation order (a few 2^-24 of the sum of
    // |terms| on any kernel path), carried along a few SGD steps with momentum: 1e-4 is ~100 times that.
    TORCH_CHECK(torch::allclose(mine[i], expected[i], 1e-4, 1e-5), "rank ", pg.rank(), ": parameter ", i,
                " differs from full-batch single-process training by ",
                (mine[i] - expected[i]).abs().max().item<double>());
    moved = std::max(moved, (mine[i] - initial[i]).abs().max().item<double>());
  }
  TORCH_CHECK(steps == 0 || moved > 1e-3, "rank ", pg.rank(), ": training did not move the parameters");
  if (!out.empty()) torch::save(model->parameters(), out + "/rank" + std::to_string(pg.rank()) + ".pt");
  std::cout << "rank " << pg.rank() << " of " << pg.size() << " done" << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "throw") {  // outside the try below: nothing catches it
    TORCH_CHECK(false, arg_value(argc, argv, "--message", "uncaught"));
  }
  try {
    // The mode is the first argument that is not the launcher's --local-rank=N.
    std::string mode;
    for (int i = 1; i < argc && mode.empty(); ++i) {
      if (std::string(argv[i]).rfind("--local", 0) != 0) mode = argv[i];
    }
    const std::string out = arg_value(argc, argv, "--out", "");
    if (mode == "env") {
      const ddp::LaunchEnv env = ddp::launch_env_from_environment();
      const auto local_rank_arg = ddp::parse_local_rank_arg(argc, argv);
      const char* group_rank = std::getenv("GROUP_RANK");
      std::ofstream(out + "/env" + std::to_string(env.rank))
          << env.rank << " " << env.world_size << " " << env.local_rank << " " << env.local_world_size << " "
          << env.master_addr << " " << (group_rank ? group_rank : "-") << " " << local_rank_arg.value_or(-1);
      return 0;
    }
    if (mode == "sleep") {
      const ddp::LaunchEnv env = ddp::launch_env_from_environment();
      std::ofstream(out + "/ready" + std::to_string(env.rank)) << ::getpid();
      std::this_thread::sleep_for(kLongSleep);
      return 0;
    }
    if (mode == "stop_on_signal") {  // a preemption-aware program: on --signal it "saves" and exits --code
      const ddp::LaunchEnv env = ddp::launch_env_from_environment();
      static volatile std::sig_atomic_t got = 0;
      const int signal = std::stoi(arg_value(argc, argv, "--signal", std::to_string(SIGUSR1)));
      if (arg_value(argc, argv, "--ignore", "") == "1") {
        std::signal(signal, SIG_IGN);  // one that never stops: the launcher's stop grace ends it
      } else {
        std::signal(signal, [](int) { got = 1; });
      }
      std::ofstream(out + "/ready" + std::to_string(env.rank)) << ::getpid();
      const auto deadline = std::chrono::steady_clock::now() + kLongSleep;
      while (got == 0 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      if (got == 0) return 3;
      // Rank 0 "saves" longer: the others' resumable exits must not stop it.
      if (env.rank == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(std::stoi(arg_value(argc, argv, "--save-ms", "0"))));
      }
      std::ofstream(out + "/saved" + std::to_string(env.rank)) << "saved";
      return std::stoi(arg_value(argc, argv, "--code", "75"));
    }
    if (mode == "compare") {
      TORCH_CHECK(argc >= 4, "compare needs two files");
      std::vector<torch::Tensor> a, b;
      torch::load(a, argv[2]);
      torch::load(b, argv[3]);
      TORCH_CHECK(a.size() == b.size(), argv[2], " holds ", a.size(), " tensors, ", argv[3], " ", b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        TORCH_CHECK(torch::equal(a[i], b[i]), "parameter ", i, " differs between ", argv[2], " and ", argv[3]);
      }
      std::cout << "equal: " << argv[2] << " " << argv[3] << std::endl;
      return 0;
    }
    if (arg_value(argc, argv, "--exit-zero-on-sigterm", "") == "1") {
      std::signal(SIGTERM, [](int) { ::_exit(0); });  // as a program that saves and leaves on preemption
    }
    at::set_num_threads(1);
    ddp::InitOptions init = ddp::InitOptions().init_method("env://");
    if (std::getenv(ddp::kCollectiveTimeoutEnv) == nullptr) init.timeout(kTimeout);
    if (std::getenv(ddp::kRendezvousTimeoutEnv) == nullptr) init.rendezvous_timeout(kTimeout);
    auto pg_holder = std::make_unique<ddp::ProcessGroup>(ddp::init_process_group(init));
    const ddp::ProcessGroup& pg = *pg_holder;
    if (mode == "train") {
      train(pg, std::stoi(arg_value(argc, argv, "--steps", "4")), out,
            std::chrono::milliseconds(std::stoi(arg_value(argc, argv, "--step-delay-ms", "0"))),
            TrainFaults{std::stoi(arg_value(argc, argv, "--hang-at-step", "-1")),
                        std::stoi(arg_value(argc, argv, "--hang-rank", "-1")),
                        std::stoi(arg_value(argc, argv, "--slow-ms", "0"))});
      return 0;
    }
    if (mode == "fail") {
      pg.barrier();
      const std::string fail_rank = arg_value(argc, argv, "--fail-rank", "0");
      const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
      const bool failing_attempt =
          std::stoi(restart != nullptr ? restart : "0") < std::stoi(arg_value(argc, argv, "--fail-attempts", "1000"));
      if (!failing_attempt) {  // a restart that goes through: every rank meets the others and ends well
        pg.barrier();
        std::cerr << "rank " << pg.rank() << " passed" << std::endl;
        return 0;
      }
      if (fail_rank == "all" || pg.rank() == std::stoi(fail_rank)) {
        const std::string message = arg_value(argc, argv, "--message", "");
        if (arg_value(argc, argv, "--error-file-only", "") == "1") {
          ddp::record_error(message);  // nothing on stderr: the launcher must quote the error file
        } else if (!message.empty()) {
          std::cerr << "ddp_test_worker: " << message << std::endl;
          // The launcher reads its workers' lines as they come; a peer's error written in the same moment could be
          // read in the same poll, in rank order. The pause keeps this failure first by a clear margin.
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
        }
        const int exit_delay_ms = std::stoi(arg_value(argc, argv, "--exit-delay-ms", "0"));
        if (exit_delay_ms > 0) {  // a slow teardown: the peers see the connection close well before this exits
          pg_holder.reset();
          std::this_thread::sleep_for(std::chrono::milliseconds(exit_delay_ms));
        }
        return std::stoi(arg_value(argc, argv, "--code", "1"));
      }
      if (arg_value(argc, argv, "--others", "sleep") == "barrier") {
        pg.barrier();  // fails once the failing rank is gone
        return 0;
      }
      std::this_thread::sleep_for(kLongSleep);
      return 0;
    }
    std::cerr << "ddp_test_worker: unknown mode '" << mode << "'" << std::endl;
    return 2;
  } catch (const c10::Error& e) {
    ddp::record_error(e.what_without_backtrace());
    std::cerr << "ddp_test_worker: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    ddp::record_error(e.what());
    std::cerr << "ddp_test_worker: " << e.what() << std::endl;
    return 1;
  }
}
