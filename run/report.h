#pragma once

// The HTML report of one training run (--report FILE.html, docs/observability.md): one self-contained page (inline
// SVG figures, a few lines of inline script, no network), readable without JavaScript.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ddp/timeline.h>

#include <run/metrics.h>

namespace run {

/// What the report shows.
struct RunReport {
  /// The page's title element and its heading (HTML-escaped).
  std::string title = "Training run";
  std::string description;  ///< the run's header line (its configuration)
  /// The number of processes (ranks) in the run, shown in the summary table.
  int world_size = 1;
  int64_t first_step = 1;                                 ///< the first step this process took (> 1: a resumed run)
  std::vector<StepRecord> steps;                          ///< the logged steps
  std::vector<EpochRecord> epochs;                        ///< the ends of epochs
  std::vector<std::vector<ddp::TimelineEvent>> timeline;  ///< per rank, the recorded window (may be empty)
};

/// Points a chart draws at most per series; longer series are thinned to every k-th point (the last one kept).
constexpr size_t kMaxChartPoints = 400;
/// Of those, the points that carry a tooltip (a dot with its value), thinned the same way: what keeps a long run's
/// report a few hundred KB.
constexpr size_t kMaxTooltipPoints = 50;

/// One line of a chart: (x, y) points in x order.
struct ChartSeries {
  std::string name;                               ///< shown in the legend and the tooltips (HTML-escaped)
  std::vector<std::pair<double, double>> points;  ///< (x, y), x ascending
};

/// What a line chart's y axis holds.
enum class YAxis {
  kLinear,  ///< any values
  kCount,   ///< whole numbers (skipped steps): whole ticks only
  kLog2,    ///< a base-2 logarithmic axis (the loss scale; points <= 0 are left out), ticks at whole powers of two
};

/// Round tick values for an axis over [lo, hi], in order: the multiples of one step (1, 2 or 5 x 10^k) that lie inside
/// [lo, hi], three to eight of them. `whole`: a step of 1 at least (steps, counts), so a short range may have fewer.
std::vector<double> axis_ticks(double lo, double hi, bool whole = false);

/// An SVG line chart (<svg id="`id`">), with axes, round ticks, a legend and points' values as tooltips (<title>).
std::string line_chart_svg(const std::string& id, const std::string& y_label, const std::vector<ChartSeries>& series,
                           YAxis y_axis = YAxis::kLinear);

/// An SVG bar chart (<svg id="`id`">): one labelled bar per (label, value), values >= 0, each value as a tooltip.
std::string bar_chart_svg(const std::string& id, const std::string& y_label,
                          const std::vector<std::pair<std::string, double>>& bars);

/// The Gantt chart of a recorded window (<svg id="`id`">): per rank its lanes (the loop's phases, bucket readiness,
/// allreduces, amp's unscale), times in ms from the window's first event.
std::string timeline_svg(const std::string& id, const std::vector<std::vector<ddp::TimelineEvent>>& per_rank);

/// The page. Its figures have the ids fig-loss, fig-accuracy (with epochs that evaluated), fig-throughput,
/// fig-scale (amp runs), fig-rank-step-time and fig-timeline (with a recorded window); the summary table is
/// id="summary". The page's script sets <body data-report-ready="1"> as its last statement.
std::string report_html(const RunReport& report);

/// A whole self-contained page around `body` (its style, and the script that ends by setting
/// <body data-report-ready="1">): what report_html and the main job's report share.
std::string html_page(const std::string& title, const std::string& body);

/// `text` with &, <, >, " escaped for HTML.
std::string html_escape(const std::string& text);

}  // namespace run
