#pragma once

// Side-by-side timing for the benchmark programs: every contender runs in the same process, interleaved
// round by round, and we report medians, so machine noise hits all of them alike.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace bench {

struct Contender {
  std::string name;
  std::function<void()> run;
  std::vector<double> seconds;  // one sample per round
};

inline void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

/// Runs each contender `warmup` times, then `rounds` rounds in which each contender runs once (interleaved),
/// synchronizing the device around every sample.
inline void run_interleaved(std::vector<Contender>& contenders, const torch::Device& device, int warmup, int rounds) {
  for (auto& c : contenders) {
    for (int i = 0; i < warmup; ++i) c.run();
  }
  synchronize(device);
  for (int r = 0; r < rounds; ++r) {
    for (auto& c : contenders) {
      const auto start = std::chrono::steady_clock::now();
      c.run();
      synchronize(device);
      c.seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

/// The data-parallel form of run_interleaved, on every rank alike, for the CPU (it synchronizes no device):
/// `rounds` rounds in which each of `runs` runs `per_sample` times after `barrier()`; returns per run the seconds per
/// iteration of each round.
inline std::vector<std::vector<double>> time_rounds_on_ranks(const std::vector<std::function<void()>>& runs,
                                                             const std::function<void()>& barrier, int rounds,
                                                             int per_sample) {
  std::vector<std::vector<double>> seconds(runs.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < runs.size(); ++i) {
      barrier();
      const auto start = std::chrono::steady_clock::now();
      for (int k = 0; k < per_sample; ++k) runs[i]();
      seconds[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
                           per_sample);
    }
  }
  return seconds;
}

/// Prints a markdown row per setup: "| name | median ms | median ratio to seconds[0] [min, max of the per-round
/// ratios] |"; returns the median ratios.
inline std::vector<double> print_ratio_rows(const std::vector<std::string>& names,
                                            const std::vector<std::vector<double>>& seconds) {
  std::vector<double> out;
  if (seconds.empty() || seconds.front().empty()) return out;  // no rounds: nothing to print
  const auto& base = seconds.front();
  for (size_t s = 0; s < seconds.size(); ++s) {
    std::vector<double> ratios;
    for (size_t i = 0; i < base.size(); ++i) ratios.push_back(seconds[s][i] / base[i]);
    out.push_back(median(ratios));
    std::printf("| %s | %.2f | %.3fx [%.3f, %.3f] |\n", names[s].c_str(), median(seconds[s]) * 1e3, out.back(),
                *std::min_element(ratios.begin(), ratios.end()), *std::max_element(ratios.begin(), ratios.end()));
  }
  std::fflush(stdout);
  return out;
}

}  // namespace bench
