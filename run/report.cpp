#include <run/report.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

#include <fmt/format.h>

namespace run {

namespace {

constexpr double kChartWidth = 760;
constexpr double kChartHeight = 260;
constexpr double kMarginLeft = 70;
constexpr double kMarginRight = 150;  // the legend
constexpr double kMarginTop = 12;
constexpr double kMarginBottom = 36;
constexpr int kTicks = 5;
const char* const kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

std::string color(size_t i) { return kPalette[i % (sizeof kPalette / sizeof kPalette[0])]; }

std::vector<std::pair<double, double>> thinned(const std::vector<std::pair<double, double>>& points,
                                               size_t limit = kMaxChartPoints) {
  if (points.size() <= limit) return points;
  const size_t stride = (points.size() + limit - 1) / limit;
  std::vector<std::pair<double, double>> out;
  for (size_t i = 0; i < points.size(); i += stride) out.push_back(points[i]);
  if (out.back() != points.back()) out.push_back(points.back());
  return out;
}

/// 10^e, exact for the exponents a tick step has.
double power_of_ten(int e) { return std::pow(10.0, e); }

}  // namespace

std::vector<double> axis_ticks(double lo, double hi, bool whole) {
  if (!std::isfinite(lo) || !std::isfinite(hi) || hi < lo) return {};
  if (hi == lo) return {lo};
  // The step m x 10^e, m in {1, 2, 5}: the round number nearest a fifth of the range.
  const double raw = (hi - lo) / kTicks;
  int e = static_cast<int>(std::floor(std::log10(raw)));
  const double f = raw / power_of_ten(e);
  int m = f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10;
  if (m == 10) {
    m = 1;
    ++e;
  }
  if (whole && e < 0) {
    m = 1;
    e = 0;
  }
  const double step = m * power_of_ten(e);
  if (std::max(std::fabs(lo), std::fabs(hi)) / step > 1e15) return {lo, hi};  // a range of a few ulps: its ends
  // k x m / 10^-e rather than k x step: 0.6, not 0.6000000000000001.
  const auto tick = [&](long long k) {
    return e >= 0 ? static_cast<double>(k * m) * power_of_ten(e) : static_cast<double>(k * m) / power_of_ten(-e);
  };
  std::vector<double> ticks;
  for (auto k = static_cast<long long>(std::ceil(lo / step)); tick(k) <= hi; ++k) {
    if (tick(k) >= lo) ticks.push_back(tick(k));
  }
  return ticks;
}

namespace {

std::string number_text(double v) {
  if (v == std::round(v) && std::fabs(v) < 1e9) return fmt::format("{:.0f}", v);  // a count, a loss scale: 16384
  if (v != 0 && (std::fabs(v) >= 1e5 || std::fabs(v) < 1e-3)) return fmt::format("{:.2e}", v);
  return fmt::format("{:.4g}", v);
}

/// The event colors of the Gantt chart, by what the event is.
/// What the timeline draws, in the legend's order: the name a reader sees and the color (event_color's).
struct TimelineKind {
  const char* label;
  const char* color;
};
constexpr TimelineKind kTimelineKinds[] = {
    {"forward", "#1f77b4"},        {"backward", "#ff7f0e"},     {"backward's wait for the allreduces", "#4d4d4d"},
    {"optimizer step", "#2ca02c"}, {"bucket ready", "#000000"}, {"allreduce", "#9467bd"},
    {"amp unscale", "#d62728"}};

std::string event_color(const ddp::TimelineEvent& e) {
  if (e.name == "forward") return "#1f77b4";
  if (e.name == "backward") return "#ff7f0e";
  if (e.name == "optimizer step") return "#2ca02c";
  if (e.name == ddp::kAllreduceWaitEvent) return "#4d4d4d";  // dark: a thin band inside backward
  if (e.lane == "comm") return "#9467bd";
  if (e.lane == "amp") return "#d62728";
  return "#000000";
}

}  // namespace

std::string html_escape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string line_chart_svg(const std::string& id, const std::string& y_label, const std::vector<ChartSeries>& series,
                           YAxis y_axis) {
  const bool log_y = y_axis == YAxis::kLog2;
  const auto y_of = [&](double v) { return log_y ? std::log2(v) : v; };
  double x_min = 0, x_max = 0, y_min = 0, y_max = 0;
  bool any = false;
  std::vector<std::vector<std::pair<double, double>>> drawn;
  for (const ChartSeries& s : series) {
    drawn.push_back({});
    for (const auto& [x, y] : thinned(s.points)) {
      if (!std::isfinite(y) || (log_y && y <= 0)) continue;
      drawn.back().emplace_back(x, y);
      const double yy = y_of(y);
      x_min = any ? std::min(x_min, x) : x;
      x_max = any ? std::max(x_max, x) : x;
      y_min = any ? std::min(y_min, yy) : yy;
      y_max = any ? std::max(y_max, yy) : yy;
      any = true;
    }
  }
  if (x_max <= x_min) {  // one point: in the middle
    x_min -= 1;
    x_max += 1;
  }
  if (y_axis != YAxis::kLinear) {  // whole counts, whole powers of two: the axis ends on whole numbers
    y_min = std::floor(y_min);
    y_max = std::max(y_min + 1, std::ceil(y_max));
  } else if (y_max <= y_min) {  // a flat line: centered, 0 drawn from 0 up
    const double pad = y_min == 0 ? 1.0 : std::fabs(y_min) * 0.1;
    y_max += pad;
    y_min = y_min == 0 ? 0.0 : y_min - pad;
  }
  const double plot_w = kChartWidth - kMarginLeft - kMarginRight;
  const double plot_h = kChartHeight - kMarginTop - kMarginBottom;
  const auto px = [&](double x) { return kMarginLeft + (x - x_min) / (x_max - x_min) * plot_w; };
  const auto py = [&](double y) { return kMarginTop + (1 - (y_of(y) - y_min) / (y_max - y_min)) * plot_h; };

  std::string svg = fmt::format(
      "<svg id=\"{}\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" viewBox=\"0 0 {} {}\" "
      "role=\"img\" aria-label=\"{}\">\n",
      id, kChartWidth, kChartHeight, kChartWidth, kChartHeight, html_escape(y_label));
  svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#fff\" stroke=\"#999\"/>\n",
                     kMarginLeft, kMarginTop, plot_w, plot_h);
  for (const double fy : axis_ticks(y_min, y_max, y_axis != YAxis::kLinear)) {
    const double y = kMarginTop + (1 - (fy - y_min) / (y_max - y_min)) * plot_h;
    svg += fmt::format(
        "<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#eee\"/><text x=\"{}\" y=\"{:.1f}\" "
        "font-size=\"11\" text-anchor=\"end\">{}</text>\n",
        kMarginLeft, y, kMarginLeft + plot_w, y, kMarginLeft - 4, y + 4, number_text(log_y ? std::exp2(fy) : fy));
  }
  // Steps are whole numbers: each tick is a whole step, drawn where that step is.
  for (const double fx : axis_ticks(x_min, x_max, /*whole=*/true)) {
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\">{}</text>\n", px(fx),
                       kMarginTop + plot_h + 14, number_text(fx));
  }
  svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"12\" text-anchor=\"middle\">step</text>\n",
                     kMarginLeft + plot_w / 2, kChartHeight - 4);
  svg += fmt::format(
      "<text x=\"14\" y=\"{}\" font-size=\"12\" text-anchor=\"middle\" transform=\"rotate(-90 14 {})\">{}</text>\n",
      kMarginTop + plot_h / 2, kMarginTop + plot_h / 2, html_escape(y_label));
  for (size_t i = 0; i < series.size(); ++i) {
    std::string path;
    for (const auto& [x, y] : drawn[i]) path += fmt::format("{}{:.1f},{:.1f}", path.empty() ? "M" : " L", px(x), py(y));
    if (!path.empty()) {
      svg += fmt::format("<path d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\"/>\n", path, color(i));
    }
    for (const auto& [x, y] : thinned(drawn[i], kMaxTooltipPoints)) {
      svg +=
          fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2\" fill=\"{}\"><title>{} step {}: {}</title></circle>",
                      px(x), py(y), color(i), html_escape(series[i].name), number_text(x), number_text(y));
    }
    svg += fmt::format(
        "\n<rect x=\"{}\" y=\"{}\" width=\"12\" height=\"3\" fill=\"{}\"/><text x=\"{}\" y=\"{}\" "
        "font-size=\"11\">{}</text>\n",
        kMarginLeft + plot_w + 10, kMarginTop + 10 + 16 * i, color(i), kMarginLeft + plot_w + 26,
        kMarginTop + 14 + 16 * i, html_escape(series[i].name));
  }
  if (!any) {
    svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"12\" text-anchor=\"middle\">no data</text>\n",
                       kMarginLeft + plot_w / 2, kMarginTop + plot_h / 2);
  }
  return svg + "</svg>\n";
}

std::string bar_chart_svg(const std::string& id, const std::string& y_label,
                          const std::vector<std::pair<std::string, double>>& bars) {
  constexpr double kLabelHeight = 90;  // rotated labels under the bars
  const double plot_w = kChartWidth - kMarginLeft - 20;
  const double plot_h = kChartHeight - kMarginTop - kLabelHeight;
  double top = 0;
  for (const auto& bar : bars) top = std::max(top, std::isfinite(bar.second) ? bar.second : 0.0);
  if (top <= 0) top = 1;
  std::string svg = fmt::format(
      "<svg id=\"{}\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" viewBox=\"0 0 {} {}\" "
      "role=\"img\" aria-label=\"{}\">\n",
      id, kChartWidth, kChartHeight, kChartWidth, kChartHeight, html_escape(y_label));
  for (const double value : axis_ticks(0, top)) {
    const double y = kMarginTop + (1 - value / top) * plot_h;
    svg += fmt::format(
        "<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#eee\"/><text x=\"{}\" y=\"{:.1f}\" "
        "font-size=\"11\" text-anchor=\"end\">{}</text>\n",
        kMarginLeft, y, kMarginLeft + plot_w, y, kMarginLeft - 4, y + 4, number_text(value));
  }
  svg += fmt::format(
      "<text x=\"14\" y=\"{}\" font-size=\"12\" text-anchor=\"middle\" transform=\"rotate(-90 14 {})\">{}</text>\n",
      kMarginTop + plot_h / 2, kMarginTop + plot_h / 2, html_escape(y_label));
  const double slot = plot_w / static_cast<double>(std::max<size_t>(1, bars.size()));
  for (size_t i = 0; i < bars.size(); ++i) {
    const double value = std::isfinite(bars[i].second) ? std::max(0.0, bars[i].second) : 0.0;
    const double h = value / top * plot_h;
    const double x = kMarginLeft + slot * static_cast<double>(i) + slot * 0.15;
    const double label_x = x + slot * 0.35;
    const double label_y = kMarginTop + plot_h + 12;
    svg += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\"><title>{}: {}</title></rect>"
        "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"end\" transform=\"rotate(-35 {:.1f} "
        "{:.1f})\">{}</text>\n",
        x, kMarginTop + plot_h - h, slot * 0.7, h, color(0), html_escape(bars[i].first), number_text(value), label_x,
        label_y, label_x, label_y, html_escape(bars[i].first));
  }
  return svg + "</svg>\n";
}

std::string timeline_svg(const std::string& id, const std::vector<std::vector<ddp::TimelineEvent>>& per_rank) {
  static const char* const kLanes[] = {"step", "buckets", "comm", "amp"};
  constexpr double kLaneHeight = 16;
  constexpr double kRankGap = 10;
  constexpr double kLabelWidth = 110;
  constexpr double kMinEventWidth = 3;
  constexpr double kLegendRow = 18;
  double t0 = 0, t1 = 0;
  bool any = false;
  for (const auto& events : per_rank) {
    for (const ddp::TimelineEvent& e : events) {
      t0 = any ? std::min(t0, e.start_us) : e.start_us;
      t1 = any ? std::max(t1, e.end_us) : e.end_us;
      any = true;
    }
  }
  if (t1 <= t0) t1 = t0 + 1;
  const double plot_w = kChartWidth + kMarginRight - kLabelWidth - 10;
  std::vector<std::vector<std::string>> rank_lanes(per_rank.size());
  double height = kMarginTop;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    for (const char* lane : kLanes) {
      const bool used = std::any_of(per_rank[r].begin(), per_rank[r].end(),
                                    [&](const ddp::TimelineEvent& e) { return e.lane == lane; });
      if (used) rank_lanes[r].push_back(lane);
    }
    height += kLaneHeight * static_cast<double>(rank_lanes[r].size()) + kRankGap;
  }
  height += 30;
  const double width = kChartWidth + kMarginRight;
  // The legend: a swatch and a name for each kind drawn, in rows under the axis.
  std::vector<const TimelineKind*> shown;
  for (const TimelineKind& kind : kTimelineKinds) {
    const bool drawn = std::any_of(per_rank.begin(), per_rank.end(), [&](const auto& events) {
      return std::any_of(events.begin(), events.end(),
                         [&](const ddp::TimelineEvent& e) { return event_color(e) == kind.color; });
    });
    if (drawn) shown.push_back(&kind);
  }
  std::vector<std::pair<double, double>> legend_at;  // x, row of each shown kind
  double legend_x = kLabelWidth;
  double legend_rows = shown.empty() ? 0 : 1;
  for (const TimelineKind* kind : shown) {
    const double item = 18 + 6.2 * static_cast<double>(std::string(kind->label).size()) + 16;
    if (legend_x + item > width && legend_x > kLabelWidth) {
      legend_x = kLabelWidth;
      ++legend_rows;
    }
    legend_at.emplace_back(legend_x, legend_rows - 1);
    legend_x += item;
  }
  height += kLegendRow * legend_rows;
  const auto px = [&](double us) { return kLabelWidth + (us - t0) / (t1 - t0) * plot_w; };
  std::string svg = fmt::format(
      "<svg id=\"{}\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{:.0f}\" viewBox=\"0 0 {} {:.0f}\" "
      "role=\"img\" aria-label=\"timeline\">\n",
      id, width, height, width, height);
  double y = kMarginTop;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    for (const std::string& lane : rank_lanes[r]) {
      svg += fmt::format("<text x=\"4\" y=\"{:.1f}\" font-size=\"11\">rank {} {}</text>\n", y + 12, r, lane);
      for (const ddp::TimelineEvent& e : per_rank[r]) {
        if (e.lane != lane) continue;
        const double x0 = px(e.start_us);
        const double w = std::max(kMinEventWidth, px(e.end_us) - x0);     // a short step still shows
        const double inset = e.name == ddp::kAllreduceWaitEvent ? 3 : 1;  // drawn inside the backward it is part of
        svg += fmt::format(
            "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\" opacity=\"0.85\"><title>{} "
            "(step {}): {:.3f} ms at {:.3f} ms</title></rect>\n",
            x0, y + inset, w, kLaneHeight - 2 * inset, event_color(e), html_escape(e.name), e.step,
            (e.end_us - e.start_us) / 1000.0, (e.start_us - t0) / 1000.0);
      }
      y += kLaneHeight;
    }
    y += kRankGap;
  }
  for (const double ms : axis_ticks(0, (t1 - t0) / 1000.0)) {
    const double x = px(t0 + ms * 1000.0);
    // Labels near the ends stay inside the picture.
    const char* anchor = x < kLabelWidth + 30 ? "start" : x > width - 40 ? "end" : "middle";
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"{}\">{} ms</text>\n", x, y + 12,
                       anchor, number_text(ms));
  }
  svg += fmt::format("<g id=\"{}-legend\">\n", id);
  for (size_t i = 0; i < shown.size(); ++i) {
    const double ly = y + 22 + kLegendRow * legend_at[i].second;
    svg += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{:.1f}\" y=\"{:.1f}\" "
        "font-size=\"11\">{}</text>\n",
        legend_at[i].first, ly, shown[i]->color, legend_at[i].first + 16, ly + 10, html_escape(shown[i]->label));
  }
  svg += "</g>\n";
  if (!any) svg += "<text x=\"200\" y=\"30\" font-size=\"12\">no events recorded</text>\n";
  return svg + "</svg>\n";
}

namespace {

std::string figure(const std::string& caption, const std::string& svg) {
  return fmt::format("<figure>\n{}<figcaption>{}</figcaption>\n</figure>\n", svg, caption);
}

std::string mean_text(const std::vector<double>& values, const char* format) {
  if (values.empty()) return "-";
  double sum = 0;
  for (double v : values) sum += v;
  return fmt::format(fmt::runtime(format), sum / static_cast<double>(values.size()));
}

std::string summary_table(const RunReport& report) {
  std::string rows;
  const auto row = [&](const std::string& what, const std::string& value) {
    rows += fmt::format("<tr><th>{}</th><td>{}</td></tr>\n", html_escape(what), html_escape(value));
  };
  row("run", report.description.empty() ? "-" : report.description);
  row("processes", std::to_string(report.world_size));
  if (report.first_step > 1) {
    row("resumed", fmt::format("this process continued the run at step {}: the figures cover steps {} on, and an "
                               "epoch it resumed into counts only its own part (--metrics holds the whole run)",
                               report.first_step, report.first_step));
  }
  row("logged steps", std::to_string(report.steps.size()));
  if (!report.steps.empty()) {
    const StepRecord& last = report.steps.back();
    row("last logged step",
        fmt::format("step {} (epoch {}): loss {:.4f}, lr {}", last.step, last.epoch, last.loss, number_text(last.lr)));
    std::vector<double> throughput;
    for (const StepRecord& s : report.steps) throughput.push_back(s.samples_per_s);
    row("samples/s (mean over logged intervals)", mean_text(throughput, "{:.0f}"));
    if (last.loss_scale) row("loss scale (last)", number_text(*last.loss_scale));
    if (last.skipped_steps) row("skipped steps (overflow)", std::to_string(*last.skipped_steps));
  }
  for (const EpochRecord& e : report.epochs) {
    row(fmt::format("epoch {}", e.epoch),
        fmt::format("mean loss {:.4f}{}, {:.1f} s", e.mean_loss,
                    e.test_accuracy ? fmt::format(", test accuracy {:.2f}%", 100 * *e.test_accuracy) : std::string(),
                    e.seconds));
  }
  const size_t ranks = report.steps.empty() ? 0 : report.steps.back().ranks.size();
  std::string rank_rows;
  for (size_t r = 0; r < ranks; ++r) {
    std::vector<double> step, fwd, bwd, opt, wait;
    for (const StepRecord& s : report.steps) {
      if (r >= s.ranks.size()) continue;
      step.push_back(s.ranks[r].step_ms);
      fwd.push_back(s.ranks[r].forward_ms);
      bwd.push_back(s.ranks[r].backward_ms);
      opt.push_back(s.ranks[r].optimizer_ms);
      wait.push_back(s.ranks[r].comm_wait_ms);
    }
    std::string overlap = "-";
    if (r < report.timeline.size()) {
      if (const auto share = ddp::allreduce_overlap(report.timeline[r])) overlap = fmt::format("{:.0f}%", 100 * *share);
    }
    rank_rows += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
                             r, mean_text(step, "{:.2f}"), mean_text(fwd, "{:.2f}"), mean_text(bwd, "{:.2f}"),
                             mean_text(opt, "{:.2f}"), mean_text(wait, "{:.2f}"), overlap);
  }
  std::string out = "<table id=\"summary\">\n" + rows + "</table>\n";
  if (!rank_rows.empty()) {
    out +=
        "<h3>Per rank (mean over logged steps, ms)</h3>\n<table id=\"ranks\">\n<tr><th>rank</th><th>step</th>"
        "<th>forward</th><th>backward</th><th>optimizer</th><th>comm wait</th><th>allreduce hidden behind "
        "backward</th></tr>\n" +
        rank_rows + "</table>\n" +
        "<p id=\"overlap-note\">Allreduce hidden behind backward: of the time a rank's allreduces ran in the "
        "timeline's steps, the share that ran while its backward was still computing gradients (DDP starts a bucket's "
        "allreduce as soon as the bucket is ready); the rest the rank spent waiting after backward (comm wait). An "
        "allreduce is one collective for all ranks, so the shares differ by rank: a rank whose backward ends later "
        "(slower, or with more to do) finds more of it already done, and a rank that ends first waits for the "
        "others. '-' where the timeline has no allreduce of that rank.</p>\n";
  }
  return out;
}

}  // namespace

std::string report_html(const RunReport& report) {
  std::vector<ChartSeries> loss{{"loss (mean over ranks)", {}}};
  std::vector<ChartSeries> throughput{{"samples/s (job)", {}}};
  std::vector<ChartSeries> scale{{"loss scale", {}}};
  std::vector<ChartSeries> skipped{{"skipped steps", {}}};
  std::vector<ChartSeries> rank_steps;
  bool amp = false;
  for (const StepRecord& s : report.steps) {
    const auto x = static_cast<double>(s.step);
    loss[0].points.emplace_back(x, s.loss);
    throughput[0].points.emplace_back(x, s.samples_per_s);
    if (s.loss_scale) {
      amp = true;
      scale[0].points.emplace_back(x, *s.loss_scale);
    }
    if (s.skipped_steps) skipped[0].points.emplace_back(x, static_cast<double>(*s.skipped_steps));
    for (size_t r = 0; r < s.ranks.size(); ++r) {
      if (rank_steps.size() <= r) rank_steps.push_back({fmt::format("rank {}", r), {}});
      rank_steps[r].points.emplace_back(x, s.ranks[r].step_ms);
    }
  }
  std::vector<ChartSeries> accuracy{{"test accuracy %", {}}};
  for (const EpochRecord& e : report.epochs) {
    if (e.test_accuracy) accuracy[0].points.emplace_back(static_cast<double>(e.step), 100 * *e.test_accuracy);
  }

  std::string body;
  body += fmt::format("<h1>{}</h1>\n", html_escape(report.title));
  body += "<h2>Summary</h2>\n" + summary_table(report);
  body += "<h2>Loss and accuracy</h2>\n" + figure("Loss of the logged steps", line_chart_svg("fig-loss", "loss", loss));
  if (!accuracy[0].points.empty()) {
    body += figure("Test accuracy at the end of each epoch", line_chart_svg("fig-accuracy", "accuracy %", accuracy));
  }
  body += "<h2>Throughput</h2>\n" + figure("Samples per second of the whole job between logged steps",
                                           line_chart_svg("fig-throughput", "samples/s", throughput));
  if (amp) {
    body +=
        "<h2>Loss scale</h2>\n" + figure("Dynamic loss scale (log scale) and the steps skipped for overflow so far",
                                         line_chart_svg("fig-scale", "loss scale", scale, YAxis::kLog2) +
                                             line_chart_svg("fig-skipped", "skipped steps", skipped, YAxis::kCount));
  }
  body += "<h2>Step time per rank</h2>\n" +
          figure("Each rank's step time on the logged steps: a straggler stands above the others",
                 line_chart_svg("fig-rank-step-time", "step ms", rank_steps));
  if (!report.timeline.empty()) {
    int64_t first = 0, last = 0;
    for (const auto& events : report.timeline) {
      for (const ddp::TimelineEvent& e : events) {
        first = first == 0 ? e.step : std::min(first, e.step);
        last = std::max(last, e.step);
      }
    }
    body += "<h2>Timeline</h2>\n" +
            figure(fmt::format("Steps {}..{} per rank, each lane a row: the loop's phases (step), each gradient "
                               "bucket becoming ready (buckets), its allreduce (comm) and amp's unscale of it (amp); "
                               "backward's wait for the allreduces is the dark band inside backward. Hover for times.",
                               first, last),
                   timeline_svg("fig-timeline", report.timeline));
  }
  return html_page(report.title, body);
}

std::string html_page(const std::string& title, const std::string& body) {
  return fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{}</title>\n<style>\n"
      "body {{ font-family: sans-serif; margin: 24px; max-width: 960px; }}\n"
      "table {{ border-collapse: collapse; margin-bottom: 12px; }}\n"
      "th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: left; font-size: 13px; }}\n"
      "figure {{ margin: 8px 0 20px 0; }} figcaption {{ font-size: 13px; color: #444; }}\n"
      "</style>\n</head>\n<body>\n{}<script>\n"
      "// Highlights a chart's point under the pointer; the page reads the same without it.\n"
      "for (const c of document.querySelectorAll('circle')) {{\n"
      "  c.addEventListener('mouseenter', () => c.setAttribute('r', '4'));\n"
      "  c.addEventListener('mouseleave', () => c.setAttribute('r', '2'));\n"
      "}}\n"
      "document.body.dataset.reportReady = '1';\n</script>\n</body>\n</html>\n",
      html_escape(title), body);
}

}  // namespace run
