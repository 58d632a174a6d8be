#pragma once

// The flags every side-by-side benchmark takes: --full (the sizes instead of quick CPU-sized ones),
// --device (auto, cpu, cuda) and --rounds.

#include <string>

#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "common/workloads.h"

namespace bench {

struct CommonFlags {
  bool full = false;
  std::string device_name = "auto";
  int rounds;

  explicit CommonFlags(int default_rounds) : rounds(default_rounds) {}
  void add_to(CLI::App& app, const std::string& full_help) {
    app.add_flag("--full", full, full_help);
    app.add_option("--device", device_name, "auto, cpu or cuda");
    app.add_option("--rounds", rounds, "Timed rounds per contender")->check(CLI::PositiveNumber);
  }
  torch::Device device() const { return parse_device(device_name); }
};

}  // namespace bench
