#pragma once

// Side-by-side timing for the benchmark programs: every contender runs in the same process, interleaved
// round by round, and we report medians, so machine noise hits all of them alike.

#include <algorithm>
#include <chrono>
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

}  // namespace bench
