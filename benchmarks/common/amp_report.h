#pragma once

// Results of the AMP benchmark (benchmarks/amp_vs_fp32.cpp): one row per training run, the ratios between rows,
// and the outputs: a text table, JSON, CSV, a gnuplot PNG (loss curves and throughput bars), an HTML report and
// metrics as JSON lines.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace bench {

/// One training run: a model under one precision configuration (ours or a peer's).
struct RunResult {
  std::string model;   // "cnn" or "transformer"
  std::string config;  // "FP32", "TF32", "O2 bf16", "loop O1 bf16", "torch.amp bf16", ...
  std::string kind;    // "fp32", "tf32", "amp" (ours), "loop" (hand-rolled LibTorch), "torch.amp" (PyTorch)
  std::string dtype;   // "fp32", "tf32", "bf16" or "fp16"
  std::string error;   // non-empty: the run did not complete, and why
  double samples_per_s = 0.0;
  double step_ms = 0.0;
  std::optional<double> peak_mib;    // CUDA: peak allocated MiB above the run's start
  std::optional<double> final_loss;  // mean of the last steps' losses
  std::optional<double> accuracy;    // [0, 1]: CNN test accuracy, transformer held-out next-token accuracy
  std::optional<int64_t> skipped_steps;
  std::optional<double> final_scale;
  std::vector<float> losses;  // per step (empty for the Python peer)

  bool ok() const { return error.empty(); }
};

/// Ratios of one row to the rows it is compared with (same model; peers: same dtype). Empty when either side
/// is missing or failed.
struct RunRatios {
  std::optional<double> vs_fp32, vs_tf32, peak_vs_fp32, vs_loop, vs_torch_amp;
  std::optional<double> accuracy_delta_points;  // (accuracy - FP32's) in percentage points
};
RunRatios ratios_of(const RunResult& run, const std::vector<RunResult>& all);

/// What the outputs say about where and how the runs were made.
struct RunContext {
  std::string date;     // local "YYYY-MM-DD HH:MM"
  std::string machine;  // CPU model and cores; GPU name
  std::string device;   // "cpu", "cuda:0"
  std::string mode;     // "quick" or "full"
  std::string torch_version;
  std::vector<std::string> task_descriptions;
};

/// The table (one row per run, failures with their reason), for stdout.
std::string format_table(const std::vector<RunResult>& runs);
/// Writes <dir>/amp_vs_fp32.json and <dir>/amp_vs_fp32.csv (creating dir). Throws naming a path it cannot write.
void write_json_and_csv(const std::string& dir, const RunContext& context, const std::vector<RunResult>& runs);
/// Writes the plot's data and script and runs gnuplot for <dir>/amp_vs_fp32.png. Returns a line saying what
/// happened (written, or why not: no gnuplot, gnuplot failed).
std::string write_plot(const std::string& dir, const RunContext& context, const std::vector<RunResult>& runs);

/// The run's HTML report (run::html_page: self-contained, summary table id="summary" with each run's loss scale
/// and skipped steps, per model a loss chart id="fig-loss-<model>" and a throughput chart
/// id="fig-throughput-<model>"), written beside the PNG as amp_vs_fp32.html.
std::string report_html(const RunContext& context, const std::vector<RunResult>& runs);

/// --metrics: JSON lines, per completed run one {"type": "step", ...} line every `every_steps` steps (default:
/// run::default_metrics_every of the run's steps) and at its last, with its loss, then one {"type": "run", ...} line
/// with its figures. Written after the runs (the timed steps record nothing on the host), atomically. Throws naming the
/// path when it cannot be written.
void write_metrics_lines(const std::string& path, const std::vector<RunResult>& runs,
                         std::optional<int64_t> every_steps);

}  // namespace bench
