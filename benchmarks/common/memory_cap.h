#pragma once

// What the full sharding benchmarks (bench_fsdp, bench_fsdp_amp) share about memory: a process's peak resident size,
// and local ranks that each run in a memory cgroup of their own (cgroup v1, root only), so that a rank past its cap
// is ended by the kernel's OOM killer rather than by the benchmark.

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <string>

#include <c10/util/Exception.h>
#include <ddp/launch/spawn.h>

namespace bench {

/// Peak resident size of this process so far, bytes.
inline int64_t peak_rss() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

/// This process's resident size now, bytes (/proc/self/statm; 0 where it cannot be read).
inline int64_t current_rss() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return resident * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
}

inline double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

/// Moves this process into the memory cgroup `name` (created) limited to `cap_mib`, swap included where the kernel
/// accounts it. Throws naming --cap-mib when it cannot (needs root and cgroup v1's memory controller).
inline void enter_memory_cap(int64_t cap_mib, const std::string& name) {
  const std::string folder = "/sys/fs/cgroup/memory/" + name;
  ::mkdir(folder.c_str(), 0755);
  const auto write = [&](const std::string& file, const std::string& value) {
    std::ofstream out(folder + "/" + file);
    out << value;
    out.flush();
    return static_cast<bool>(out);
  };
  const std::string bytes = std::to_string(cap_mib * 1024 * 1024);
  TORCH_CHECK(write("memory.limit_in_bytes", bytes), "--cap-mib: cannot limit ", folder,
              " (needs root and cgroup v1's memory controller at /sys/fs/cgroup/memory)");
  write("memory.memsw.limit_in_bytes", bytes);  // no swap past the cap, where the kernel accounts swap
  TORCH_CHECK(write("cgroup.procs", std::to_string(::getpid())), "--cap-mib: cannot join ", folder);
}

/// ddp::spawn(world, rank_fn) with each rank in a cgroup of its own capped at `cap_mib`; the cgroups are removed
/// after. Returns "" when every rank returned, else what failed (a rank the OOM killer ended: "signal 9").
inline std::string spawn_capped(int world, int64_t cap_mib, const std::function<void(int, int)>& rank_fn) {
  const std::string prefix = "lta_bench_cap_" + std::to_string(::getpid()) + "_";
  std::string outcome;
  try {
    ddp::spawn(world, [&](int rank, int local_world) {
      enter_memory_cap(cap_mib, prefix + std::to_string(rank));
      rank_fn(rank, local_world);
    });
  } catch (const c10::Error& e) {
    outcome = e.what_without_backtrace();
  } catch (const std::exception& e) {
    outcome = e.what();
  }
  for (int rank = 0; rank < world; ++rank) ::rmdir(("/sys/fs/cgroup/memory/" + prefix + std::to_string(rank)).c_str());
  return outcome;
}

}  // namespace bench
