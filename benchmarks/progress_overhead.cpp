// Question: what does hang detection's progress reporting (ddp/progress.h, Note [progress records]) cost a
// training step? DistributedDataParallel writes one event when a training step begins and two per collective it
// waits for (begin, end). This times that sequence for a step with --buckets collectives, with the record mapped
// (DDP_PROGRESS_FILE set, as under ddp-launch --hang-timeout-s) or not (the call returns at once), in two child
// processes run alternately (the record is mapped once per process), and prints ns per event and per step.
// benchmarks/fault_recovery.sh sets this next to a step's measured time.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <ddp/launch/progress_record.h>
#include <ddp/progress.h>

#include "common/command_line.h"
#include "common/timing.h"

namespace {

/// ns per simulated step: one step event and `buckets` collectives (begin + end), `steps` times.
double time_steps(int64_t steps, int buckets) {
  const std::string name = "allreduce of gradient bucket 3 of 8 (12 parameters, conv1.weight .. fc.bias)";
  const auto start = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < steps; ++s) {
    ddp::detail::report_step();
    for (int b = 0; b < buckets; ++b) {
      ddp::detail::report_collective_begin(name);
      ddp::detail::report_collective_end();
    }
  }
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() /
         static_cast<double>(steps);
}

/// Runs time_steps in a child process, with the record mapped or not; returns its ns per step.
double in_child(bool mapped, int64_t steps, int buckets) {
  int fds[2];
  if (::pipe(fds) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    char path[] = "/tmp/lta_progress_XXXXXX";
    const int fd = ::mkstemp(path);
    if (fd >= 0) {
      (void)!::ftruncate(fd, sizeof(ddp::detail::ProgressRecord));
      ::close(fd);
    }
    if (mapped) ::setenv(ddp::detail::kProgressFileEnv, path, 1);
    time_steps(steps / 10, buckets);  // warm up (and map the record)
    const double ns = time_steps(steps, buckets);
    ::unlink(path);
    (void)!::write(fds[1], &ns, sizeof(ns));
    ::_exit(0);
  }
  ::close(fds[1]);
  double ns = -1;
  if (::read(fds[0], &ns, sizeof(ns)) != sizeof(ns)) ns = -1;
  ::close(fds[0]);
  ::waitpid(pid, nullptr, 0);
  return ns;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 2000000;
  int buckets = 4;
  int rounds = 5;
  CLI::App app{"The cost of hang detection's progress reporting per training step"};
  app.add_option("--steps", steps, "Simulated steps per timing")->check(CLI::PositiveNumber);
  app.add_option("--buckets", buckets, "Collectives waited for per step")->check(CLI::NonNegativeNumber);
  app.add_option("--rounds", rounds, "Alternating rounds (each: off, then on)")->check(CLI::PositiveNumber);
  if (const auto status = examples::parse_flags(app, argc, argv)) return *status;
  std::vector<double> off, on;
  for (int r = 0; r < rounds; ++r) {
    off.push_back(in_child(false, steps, buckets));
    on.push_back(in_child(true, steps, buckets));
  }
  const auto [off_min, off_max] = std::minmax_element(off.begin(), off.end());
  const auto [on_min, on_max] = std::minmax_element(on.begin(), on.end());
  const int events = 1 + 2 * buckets;
  fmt::print("progress reporting, {} events per step ({} collectives), {} rounds alternating, median [min, max]:\n",
             events, buckets, rounds);
  fmt::print("  off (no DDP_PROGRESS_FILE): {:.1f} ns per step [{:.1f}, {:.1f}]\n", bench::median(off), *off_min,
             *off_max);
  fmt::print("  on  (record mapped):        {:.1f} ns per step [{:.1f}, {:.1f}], {:.1f} ns per event\n",
             bench::median(on), *on_min, *on_max, bench::median(on) / events);
  return 0;
}
