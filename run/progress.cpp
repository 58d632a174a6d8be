#include <run/progress.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>

#include <unistd.h>

namespace run {
namespace {

constexpr int kBarWidth = 30;
constexpr auto kTerminalRedraw = std::chrono::milliseconds(200);

/// "m:ss", or "h:mm:ss" from an hour up.
std::string clock_text(double seconds) {
  const auto total = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  if (total >= 3600) return fmt::format("{}:{:02}:{:02}", total / 3600, total / 60 % 60, total % 60);
  return fmt::format("{}:{:02}", total / 60, total % 60);
}

}  // namespace

ProgressStyle progress_style(bool quiet, std::FILE* out) {
  if (quiet) return ProgressStyle::kQuiet;
  return ::isatty(::fileno(out)) == 1 ? ProgressStyle::kTerminal : ProgressStyle::kLines;
}

Progress::Progress(ProgressStyle style, double every_seconds, std::FILE* out)
    : style_(style),
      every_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(std::max(0.0, every_seconds)))),
      out_(out) {}

void Progress::begin_epoch(int epoch, int epochs, int64_t steps, int64_t first_step, Clock::time_point now) {
  epoch_ = epoch;
  epochs_ = epochs;
  steps_ = steps;
  first_step_ = first_step;
  start_ = now;
  last_shown_ = now;
  shown_any_ = false;
}

void Progress::step_done(int64_t done, double mean_loss, double samples_per_second, Clock::time_point now, bool last) {
  if (style_ == ProgressStyle::kQuiet) return;
  const auto interval = style_ == ProgressStyle::kTerminal ? Clock::duration(kTerminalRedraw) : every_;
  const bool due = now - last_shown_ >= interval || (style_ == ProgressStyle::kTerminal && !shown_any_);
  if (due || last || done >= steps_) show(done, mean_loss, samples_per_second, now);
}

void Progress::show(int64_t done, double mean_loss, double samples_per_second, Clock::time_point now) {
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const auto ran = static_cast<double>(std::max<int64_t>(1, done - first_step_));
  const double eta = elapsed / ran * static_cast<double>(std::max<int64_t>(0, steps_ - done));
  const std::string figures = fmt::format("{}/{} mean loss {:.4f} | {:.0f} samples/s | ETA {}", done, steps_, mean_loss,
                                          samples_per_second, clock_text(eta));
  if (style_ == ProgressStyle::kTerminal) {
    const auto filled = static_cast<int>(kBarWidth * done / std::max<int64_t>(1, steps_));
    std::string line = fmt::format("epoch {}/{} [{}{}] {}", epoch_, epochs_, std::string(filled, '#'),
                                   std::string(kBarWidth - filled, '.'), figures);
    const size_t width = line.size();
    if (width < open_line_width_) line.append(open_line_width_ - width, ' ');  // erase a longer previous line
    fmt::print(out_, "\r{}", line);
    open_line_width_ = width;
  } else {
    fmt::print(out_, "epoch {}/{} step {}\n", epoch_, epochs_, figures);
  }
  std::fflush(out_);
  last_shown_ = now;
  shown_any_ = true;
}

void Progress::interrupt() {
  if (open_line_width_ == 0) return;
  fmt::print(out_, "\n");
  std::fflush(out_);
  open_line_width_ = 0;
}

void Progress::end_epoch() { interrupt(); }

}  // namespace run
