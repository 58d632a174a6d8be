// The HTML report's promises that need no program run: a long run stays a few hundred KB, text is escaped, the
// per-rank table shows the overlap the timeline implies. (observability_test.cpp runs the programs; tests/report/
// opens a report in a browser.)
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <run/report.h>

namespace {

size_t count_of(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

ddp::TimelineEvent event(const std::string& name, const std::string& lane, double start, double end) {
  return ddp::TimelineEvent{name, lane, 4, -1, start, end};
}

run::RunReport long_run(int64_t steps, int ranks) {
  run::RunReport report;
  report.description = "8 processes (gloo), a long run";
  report.world_size = ranks;
  for (int64_t s = 1; s <= steps; ++s) {
    run::StepRecord r;
    r.step = s * 10;
    r.epoch = 1 + s / 1000;
    r.loss = 2.0 / static_cast<double>(s);
    r.lr = 0.1;
    r.loss_scale = 65536.0;
    r.skipped_steps = s / 5000;
    r.samples_per_s = 1000.0 + static_cast<double>(s % 7);
    for (int k = 0; k < ranks; ++k) r.ranks.push_back({30.0 + k, 10, 15, 1, 4, r.loss});
    report.steps.push_back(r);
  }
  for (int64_t e = 1; e <= steps / 1000; ++e) report.epochs.push_back({e, e * 10000, 1.0 / e, 0.5 + 0.01 * e, 60.0});
  report.timeline.resize(ranks);
  for (int k = 0; k < ranks; ++k) {
    for (int b = 0; b < 40; ++b)
      report.timeline[k].push_back(event("allreduce bucket", "comm", b * 100.0, b * 100.0 + 50));
  }
  return report;
}

TEST(ReportTest, ALongRunStaysAFewHundredKilobytesWithEveryFigure) {
  const std::string html = run::report_html(long_run(/*steps=*/100000, /*ranks=*/8));  // a million steps logged
  EXPECT_LT(html.size(), 400u * 1024u) << "bytes";
  for (const char* id : {"summary", "ranks", "fig-loss", "fig-accuracy", "fig-throughput", "fig-scale", "fig-skipped",
                         "fig-rank-step-time", "fig-timeline"}) {
    EXPECT_NE(html.find(std::string("id=\"") + id + "\""), std::string::npos) << id;
  }
  EXPECT_NE(html.find("document.body.dataset.reportReady = '1'"), std::string::npos);
  EXPECT_EQ(html.find("http://"), html.find("http://www.w3.org/2000/svg")) << "no network: only SVG's namespace";
  EXPECT_EQ(html.find("https://"), std::string::npos);
}

TEST(ReportTest, ALongSeriesIsThinnedToTheChartsLimitAndKeepsItsLastPoint) {
  run::ChartSeries series{"loss", {}};
  for (int i = 1; i <= 10000; ++i) series.points.emplace_back(i, 1.0 / i);
  const std::string svg = run::line_chart_svg("fig-x", "loss", {series});
  const size_t path_points = count_of(svg, " L") + 1;
  EXPECT_LE(path_points, run::kMaxChartPoints + 1);
  EXPECT_GE(path_points, run::kMaxChartPoints / 2);
  EXPECT_LE(count_of(svg, "<circle"), run::kMaxTooltipPoints + 1);
  EXPECT_NE(svg.find("loss step 10000:"), std::string::npos) << "the last point keeps its tooltip";
}

TEST(ReportTest, AResumedRunSaysWhichStepsItCovers) {
  run::RunReport report;
  EXPECT_EQ(run::report_html(report).find("continued the run"), std::string::npos);
  report.first_step = 9;
  EXPECT_NE(run::report_html(report).find("continued the run at step 9"), std::string::npos);
}

TEST(ReportTest, StepTicksAreWholeStepsDrawnWhereThoseStepsAre) {
  run::ChartSeries series{"loss", {{2, 1.0}, {8, 0.5}}};
  const std::string svg = run::line_chart_svg("fig-x", "loss", {series});
  // Steps 2..8: a tick at each step, each once, and step 3 drawn at step 3 (1/6 of the way).
  for (const char* tick : {">2</text>", ">3</text>", ">4</text>", ">5</text>", ">6</text>", ">7</text>", ">8</text>"}) {
    EXPECT_EQ(count_of(svg, tick), 1u) << tick << "\n" << svg;
  }
  EXPECT_NE(svg.find("<text x=\"160.0\" y=\"238\" font-size=\"11\" text-anchor=\"middle\">3</text>"), std::string::npos)
      << svg;
  run::ChartSeries one{"accuracy", {{16, 60.0}}};
  const std::string single = run::line_chart_svg("fig-y", "accuracy", {one});
  EXPECT_NE(single.find("cx=\"340.0\""), std::string::npos) << "one point sits in the middle: " << single;
}

TEST(ReportTest, AxisTicksAreRoundNumbersInsideTheRange) {
  using V = std::vector<double>;
  EXPECT_EQ(run::axis_ticks(0.552, 1.37), (V{0.6, 0.8, 1.0, 1.2})) << "a loss: not 0.552, 0.7155, 0.8791";
  EXPECT_EQ(run::axis_ticks(10, 96, /*whole=*/true), (V{20, 40, 60, 80}));
  EXPECT_EQ(run::axis_ticks(2, 3, /*whole=*/true), (V{2, 3})) << "a count: not 2.2, 2.4";
  EXPECT_EQ(run::axis_ticks(0, 880.3), (V{0, 200, 400, 600, 800}));
  EXPECT_EQ(run::axis_ticks(-0.03, 0.07), (V{-0.02, 0, 0.02, 0.04, 0.06}));
  EXPECT_EQ(run::axis_ticks(368, 439.5), (V{370, 380, 390, 400, 410, 420, 430}));
  EXPECT_EQ(run::axis_ticks(5, 5), (V{5}));
  EXPECT_EQ(run::axis_ticks(1e17, 1e17 + 16), (V{1e17, 1e17 + 16})) << "a range of a few ulps: its ends";
  EXPECT_TRUE(run::axis_ticks(3, 2).empty());
  EXPECT_TRUE(run::axis_ticks(0, std::numeric_limits<double>::infinity()).empty());
  for (double lo : {-7.3, 0.0, 0.001, 12.5, 3e6}) {
    for (double span : {1e-6, 0.37, 1.0, 9.99, 1234.5, 8e9}) {
      const V ticks = run::axis_ticks(lo, lo + span);
      EXPECT_GE(ticks.size(), 3u) << lo << " + " << span;
      EXPECT_LE(ticks.size(), 8u) << lo << " + " << span;
      for (double t : ticks) {
        EXPECT_GE(t, lo);
        EXPECT_LE(t, lo + span);
      }
    }
  }
}

TEST(ReportTest, TheSkippedStepsAxisCountsInWholeSteps) {
  run::RunReport report;
  for (int64_t s = 1; s <= 3; ++s) {
    run::StepRecord r;
    r.step = s;
    r.loss = 1;
    r.loss_scale = 65536.0;
    r.skipped_steps = s < 3 ? 2 : 3;
    report.steps.push_back(r);
  }
  const std::string html = run::report_html(report);
  const std::string skipped = html.substr(html.find("id=\"fig-skipped\""));
  EXPECT_EQ(skipped.find(">2.2</text>"), std::string::npos) << skipped;
  EXPECT_NE(skipped.find(">2</text>"), std::string::npos) << skipped;
  EXPECT_NE(skipped.find(">3</text>"), std::string::npos) << skipped;
}

TEST(ReportTest, TheRunsTextIsEscaped) {
  run::RunReport report;
  report.description = "<script>alert(1)</script> & \"quoted\"";
  const std::string html = run::report_html(report);
  EXPECT_EQ(html.find("<script>alert"), std::string::npos);
  EXPECT_NE(html.find("&lt;script&gt;alert(1)&lt;/script&gt; &amp; &quot;quoted&quot;"), std::string::npos);
}

TEST(ReportTest, ThePerRankTableShowsHowMuchAllreduceHidBehindBackward) {
  run::RunReport report;
  report.world_size = 2;
  run::StepRecord step;
  step.step = 4;
  step.ranks = {{30, 10, 15, 1, 4, 1.0}, {31, 10, 16, 1, 3, 1.0}};
  report.steps = {step};
  // Rank 0: autograd done at 100; allreduces [0, 50] and [50, 150]: 100 of 150 us hidden. Rank 1: none hidden.
  report.timeline = {
      {event(ddp::kAllreduceWaitEvent, "step", 100, 150), event("allreduce bucket 0", "comm", 0, 50),
       event("allreduce bucket 1", "comm", 50, 150)},
      {event(ddp::kAllreduceWaitEvent, "step", 100, 150), event("allreduce bucket 0", "comm", 100, 150)}};
  const std::string html = run::report_html(report);
  EXPECT_NE(html.find("<td>4.00</td><td>67%</td></tr>"), std::string::npos) << html;
  EXPECT_NE(html.find("<td>3.00</td><td>0%</td></tr>"), std::string::npos) << html;
  // What the shares mean is said under the table (issue 39: 3% on one rank and 43% on another looked wrong).
  const size_t note = html.find("<p id=\"overlap-note\">Allreduce hidden behind backward: ");
  ASSERT_NE(note, std::string::npos) << html;
  EXPECT_LT(html.find("<table id=\"ranks\">"), note);
  EXPECT_NE(html.find("the shares differ by rank", note), std::string::npos) << html;
}

// The timeline's legend is a legend: a swatch in each drawn kind's color with its name, none for what is not drawn.
TEST(ReportTest, TheTimelineHasALegendOfWhatItDraws) {
  const std::vector<std::vector<ddp::TimelineEvent>> per_rank = {
      {event("forward", "step", 0, 100), event("backward", "step", 100, 300),
       event(ddp::kAllreduceWaitEvent, "step", 250, 300), event("optimizer step", "step", 300, 300.5),
       event("allreduce bucket 0", "comm", 200, 290)}};
  const std::string svg = run::timeline_svg("fig-timeline", per_rank);
  const size_t legend = svg.find("<g id=\"fig-timeline-legend\">");
  ASSERT_NE(legend, std::string::npos) << svg;
  const std::string part = svg.substr(legend, svg.find("</g>", legend) - legend);
  for (const auto& [color, label] :
       std::vector<std::pair<std::string, std::string>>{{"#1f77b4", "forward"},
                                                        {"#ff7f0e", "backward"},
                                                        {"#4d4d4d", "backward's wait for the allreduces"},
                                                        {"#2ca02c", "optimizer step"},
                                                        {"#9467bd", "allreduce"}}) {
    EXPECT_NE(part.find("fill=\"" + color + "\"/><text"), std::string::npos) << label << ": " << part;
    EXPECT_NE(part.find(">" + run::html_escape(label) + "</text>"), std::string::npos) << label << ": " << part;
  }
  EXPECT_EQ(part.find("amp unscale"), std::string::npos) << "nothing of amp was drawn: " << part;
  EXPECT_EQ(part.find("bucket ready"), std::string::npos) << part;
  // The half-microsecond optimizer step of a 300 us window is still 3 px wide.
  EXPECT_NE(svg.find("width=\"3.0\" height=\"14.0\" fill=\"#2ca02c\""), std::string::npos) << svg;
}

}  // namespace
