#include <run/observer.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>

#include <amp/io/atomic_file.h>
#include <fmt/format.h>

#include <run/report.h>

namespace run {

namespace {

/// "A" or "A:B" as a window; nullopt when the text is neither.
std::optional<ddp::TimelineWindow> parse_window(const std::string& text) {
  const size_t colon = text.find(':');
  const auto number = [](const std::string& part) -> std::optional<int64_t> {
    if (part.empty() || part.size() > 18 || part.find_first_not_of("0123456789") != std::string::npos) {
      return std::nullopt;
    }
    return std::stoll(part);
  };
  const auto first = number(text.substr(0, colon));
  const auto last = colon == std::string::npos ? first : number(text.substr(colon + 1));
  if (!first || !last || *first < 1 || *last < *first) return std::nullopt;
  return ddp::TimelineWindow{*first, *last};
}

constexpr int64_t kDefaultWindowSteps = 3;
constexpr int64_t kDefaultWarmupSteps = 3;  // the first steps build and rebuild DDP's buckets

}  // namespace

void check_output_path(const char* flag, const std::string& path) {
  if (path.empty()) return;
  const size_t slash = path.rfind('/');
  const std::string folder = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  struct stat info {};
  if (::stat(folder.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    throw std::invalid_argument(fmt::format("{} '{}': the folder '{}' does not exist", flag, path, folder));
  }
  if (::access(folder.c_str(), W_OK) != 0) {
    throw std::invalid_argument(fmt::format("{} '{}': the folder '{}' is not writable", flag, path, folder));
  }
  if (::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode)) {
    throw std::invalid_argument(fmt::format("{} '{}': it is a folder, not a file", flag, path));
  }
  if (::access(path.c_str(), F_OK) == 0 && ::access(path.c_str(), W_OK) != 0) {
    throw std::invalid_argument(fmt::format("{} '{}': the file is not writable", flag, path));
  }
}

void check_observe_options(const ObserveOptions& options) {
  check_output_path("--metrics", options.metrics);
  check_output_path("--report", options.report);
  check_output_path("--timeline", options.timeline);
  if (options.metrics_every) {
    if (*options.metrics_every <= 0) {
      throw std::invalid_argument(
          fmt::format("--metrics-every must be a positive number of steps, got {}", *options.metrics_every));
    }
    if (options.metrics.empty() && options.report.empty()) {
      throw std::invalid_argument("--metrics-every needs --metrics or --report (what it paces)");
    }
  }
  const std::pair<const char*, const std::string*> outputs[] = {
      {"--metrics", &options.metrics}, {"--report", &options.report}, {"--timeline", &options.timeline}};
  for (size_t i = 0; i < 3; ++i) {
    for (size_t j = i + 1; j < 3; ++j) {
      if (!outputs[i].second->empty() && *outputs[i].second == *outputs[j].second) {
        throw std::invalid_argument(fmt::format("{} and {} name the same file '{}': each needs its own",
                                                outputs[i].first, outputs[j].first, *outputs[i].second));
      }
    }
  }
  if (options.timeline_steps.empty()) return;
  const auto window = parse_window(options.timeline_steps);
  if (!window) {
    throw std::invalid_argument(fmt::format(
        "--timeline-steps '{}': give the steps of the run as A or A:B with 1 <= A <= B", options.timeline_steps));
  }
  if (window->last_step - window->first_step >= ddp::kMaxTimelineSteps) {
    throw std::invalid_argument(fmt::format("--timeline-steps '{}': at most {} steps (a window is for a close look)",
                                            options.timeline_steps, ddp::kMaxTimelineSteps));
  }
  if (options.report.empty() && options.timeline.empty()) {
    throw std::invalid_argument("--timeline-steps needs --report or --timeline (where the timeline goes)");
  }
}

std::optional<ddp::TimelineWindow> timeline_window(const ObserveOptions& options, int64_t first_step,
                                                   int64_t last_step) {
  if (options.report.empty() && options.timeline.empty()) return std::nullopt;
  if (!options.timeline_steps.empty()) {
    const auto window = parse_window(options.timeline_steps);
    if (!window || window->first_step < first_step || window->last_step > last_step) {
      throw std::invalid_argument(fmt::format("--timeline-steps '{}': this run takes steps {}..{} only",
                                              options.timeline_steps, first_step, last_step));
    }
    return window;
  }
  const int64_t remaining = last_step - first_step + 1;
  if (remaining < 1) return std::nullopt;
  const int64_t length = std::min(kDefaultWindowSteps, remaining);
  const int64_t skip = std::min(kDefaultWarmupSteps, remaining - length);
  return ddp::TimelineWindow{first_step + skip, first_step + skip + length - 1};
}

int64_t default_metrics_every(int64_t last_step) {
  return std::max<int64_t>(1, (last_step + kLoggedStepsPerRun - 1) / kLoggedStepsPerRun);
}

RunObserver::RunObserver(const ObserveOptions& options, int rank, int world_size, const torch::Device& device,
                         ObservedRun run, int64_t first_step, int64_t last_step)
    : options_(options),
      rank_(rank),
      world_size_(world_size),
      device_(device),
      run_(std::move(run)),
      first_step_(first_step),
      last_step_(last_step),
      metrics_every_(options.metrics_every.value_or(default_metrics_every(last_step))) {
  if (const auto window = timeline_window(options, first_step, last_step)) {
    timeline_ = std::make_shared<ddp::Timeline>(*window);
    if (run_.ddp != nullptr) run_.ddp->set_timeline(timeline_);
  }
  if (rank_ == 0 && !options_.metrics.empty()) open_metrics(first_step);
  last_logged_ = std::chrono::steady_clock::now();
}

RunObserver::~RunObserver() {
  if (run_.ddp != nullptr && timeline_) run_.ddp->set_timeline(nullptr);
  if (metrics_fd_ >= 0) ::close(metrics_fd_);
}

void RunObserver::open_metrics(int64_t first_step) {
  // A resumed run continues the file; lines the interrupted run wrote after its checkpoint (steps this run takes
  // again) are dropped first, so that each step appears once. The file is rewritten atomically for that.
  if (options_.resumed && ::access(options_.metrics.c_str(), F_OK) == 0) {
    std::ifstream in(options_.metrics);
    std::string kept, line;
    while (std::getline(in, line)) {
      const size_t at = line.find("\"step\": ");
      const long long step = at == std::string::npos ? 0 : std::atoll(line.c_str() + at + 8);
      if (step < first_step) kept += line + "\n";
    }
    amp::write_file_atomically(options_.metrics, kept);
  }
  const int mode = O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (options_.resumed ? 0 : O_TRUNC);
  metrics_fd_ = ::open(options_.metrics.c_str(), mode, 0644);
  if (metrics_fd_ < 0) {
    throw std::invalid_argument(
        fmt::format("--metrics '{}': cannot write it: {}", options_.metrics, std::strerror(errno)));
  }
}

bool RunObserver::logged(int64_t step) const {
  return (!options_.metrics.empty() || !options_.report.empty()) && (step % metrics_every_ == 0 || step == last_step_);
}

StepPhases RunObserver::begin_step(int64_t step) {
  if (timeline_) timeline_->begin_step(step);
  return StepPhases(logged(step), device_, timeline_.get());
}

void RunObserver::end_step(int64_t step, int64_t epoch, double loss, const StepPhases& phases, int64_t samples) {
  if (timeline_) {
    timeline_->end_step();
    if (timeline_->finished() && !gathered_window_) gather_window();
  }
  samples_since_logged_ += samples;
  if (!logged(step)) return;
  RankStepTimes mine{phases.step_milliseconds(),
                     phases.milliseconds(Phase::kForward),
                     phases.milliseconds(Phase::kBackward),
                     phases.milliseconds(Phase::kOptimizer),
                     0.0,
                     loss};
  if (run_.ddp != nullptr) {
    const ddp::BackwardTimeline& t = run_.ddp->last_backward_timeline();
    if (t.allreduces_done > t.backward_finished) {
      mine.comm_wait_ms = std::chrono::duration<double, std::milli>(t.allreduces_done - t.backward_finished).count();
    }
  }
  std::vector<RankStepTimes> ranks{mine};
  if (run_.group != nullptr && run_.group->size() > 1) {
    const auto mine_tensor = torch::tensor(
        {mine.step_ms, mine.forward_ms, mine.backward_ms, mine.optimizer_ms, mine.comm_wait_ms, loss}, torch::kFloat64);
    ranks.clear();
    for (const torch::Tensor& r : run_.group->allgather(mine_tensor.to(run_.group->device()))) {
      const auto v = r.cpu();
      const auto* d = v.data_ptr<double>();
      ranks.push_back(RankStepTimes{d[0], d[1], d[2], d[3], d[4], d[5]});
    }
  }
  const auto now = std::chrono::steady_clock::now();
  if (rank_ == 0) {
    StepRecord record;
    record.step = step;
    record.epoch = epoch;
    for (const RankStepTimes& r : ranks) record.loss += r.loss / static_cast<double>(ranks.size());
    if (run_.values) {
      const StepValues values = run_.values();
      record.lr = values.lr;
      record.loss_scale = values.loss_scale;
      record.skipped_steps = values.skipped_steps;
      record.grad_norm = values.grad_norm;
    }
    const double seconds = std::chrono::duration<double>(now - last_logged_).count() - paused_seconds_;
    record.samples_per_s = seconds > 0 ? static_cast<double>(samples_since_logged_) / seconds : 0.0;
    record.ranks = std::move(ranks);
    write_line(metrics_json(record));
    steps_.push_back(std::move(record));
  }
  last_logged_ = now;
  samples_since_logged_ = 0;
  paused_seconds_ = 0.0;
}

void RunObserver::end_epoch(const EpochRecord& record, double paused_seconds) {
  paused_seconds_ += paused_seconds;
  if (rank_ != 0) return;
  write_line(metrics_json(record));
  epochs_.push_back(record);
}

void RunObserver::write_line(const std::string& line) {
  if (metrics_fd_ < 0) return;
  const std::string whole = line + "\n";  // one write() per line (O_APPEND): a reader never sees half of one
  const ssize_t written = ::write(metrics_fd_, whole.data(), whole.size());
  if (written != static_cast<ssize_t>(whole.size())) {
    throw std::runtime_error(fmt::format("--metrics '{}': writing failed: {}", options_.metrics,
                                         written < 0 ? std::strerror(errno) : "short write (disk full?)"));
  }
}

void RunObserver::gather_window() {
  gathered_window_ = true;
  const std::vector<ddp::TimelineEvent> mine = timeline_->resolve();
  if (run_.group != nullptr && run_.group->size() > 1) {
    gathered_ = ddp::gather_timeline(*run_.group, mine);
  } else {
    gathered_ = {mine};
  }
  if (rank_ == 0 && !options_.timeline.empty()) {
    amp::write_file_atomically(options_.timeline, ddp::chrome_trace_json(gathered_));
  }
}

void RunObserver::finish() {
  if (timeline_ && !gathered_window_ && timeline_->step() >= timeline_->window().first_step) gather_window();
  if (rank_ != 0 || options_.report.empty()) return;
  RunReport report;
  report.description = run_.description;
  report.world_size = world_size_;
  report.first_step = first_step_;
  report.steps = steps_;
  report.epochs = epochs_;
  report.timeline = gathered_;
  amp::write_file_atomically(options_.report, report_html(report));
}

}  // namespace run
