#include "common/amp_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <amp/io/atomic_file.h>
#include <c10/util/Exception.h>
#include <ddp/json.h>
#include <fmt/format.h>

#include <run/observer.h>
#include <run/report.h>

namespace bench {
namespace {

const RunResult* find_run(const std::vector<RunResult>& all, const std::string& model, const std::string& kind,
                          const std::string& dtype) {
  for (const auto& r : all) {
    if (r.ok() && r.model == model && r.kind == kind && (dtype.empty() || r.dtype == dtype)) return &r;
  }
  return nullptr;
}

std::optional<double> throughput_ratio(const RunResult& run, const RunResult* peer) {
  if (!run.ok() || peer == nullptr || peer->samples_per_s <= 0.0) return std::nullopt;
  return run.samples_per_s / peer->samples_per_s;
}

std::string or_dash(const std::optional<double>& v, const char* format) {
  return v ? fmt::format(fmt::runtime(format), *v) : std::string("-");
}

/// A fraction as a percentage with two decimals ("72.60"), or "-".
std::string accuracy_text(const std::optional<double>& fraction) {
  return fraction ? fmt::format("{:.2f}", 100.0 * *fraction) : std::string("-");
}

std::string ratio_text(const std::optional<double>& v) { return v ? fmt::format("{:.2f}x", *v) : std::string("-"); }

using ddp::json_number;

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string csv_number(const std::optional<double>& v, const char* format = "{:.6g}") {
  return v && std::isfinite(*v) ? fmt::format(fmt::runtime(format), *v) : std::string();
}

std::optional<double> as_double(const std::optional<int64_t>& v) {
  return v ? std::optional<double>(static_cast<double>(*v)) : std::nullopt;
}

std::ofstream open_for_writing(const std::string& path) {
  std::ofstream out(path);
  TORCH_CHECK(out.good(), "cannot write ", path);
  return out;
}

}  // namespace

RunRatios ratios_of(const RunResult& run, const std::vector<RunResult>& all) {
  RunRatios r;
  if (!run.ok()) return r;
  const RunResult* fp32 = find_run(all, run.model, "fp32", "");
  r.vs_fp32 = throughput_ratio(run, fp32);
  r.vs_tf32 = throughput_ratio(run, find_run(all, run.model, "tf32", ""));
  if (fp32 != nullptr && fp32->peak_mib && run.peak_mib && *fp32->peak_mib > 0.0) {
    r.peak_vs_fp32 = *run.peak_mib / *fp32->peak_mib;
  }
  if (fp32 != nullptr && fp32->accuracy && run.accuracy)
    r.accuracy_delta_points = 100.0 * (*run.accuracy - *fp32->accuracy);
  if (run.kind == "amp") {
    r.vs_loop = throughput_ratio(run, find_run(all, run.model, "loop", run.dtype));
    r.vs_torch_amp = throughput_ratio(run, find_run(all, run.model, "torch.amp", run.dtype));
  }
  return r;
}

std::string format_table(const std::vector<RunResult>& runs) {
  std::string out =
      fmt::format("{:<12} {:<15} {:>10} {:>7} {:>7} {:>9} {:>9} {:>6} {:>8} {:>7} {:>7} {:>8} {:>7} {:>9}\n", "model",
                  "config", "samples/s", "x FP32", "x TF32", "step ms", "peak MiB", "x mem", "loss", "acc %", "skipped",
                  "scale", "x loop", "x torch");
  for (const auto& run : runs) {
    if (!run.ok()) {
      out += fmt::format("{:<12} {:<15} skipped: {}\n", run.model, run.config, run.error);
      continue;
    }
    const RunRatios r = ratios_of(run, runs);
    out +=
        fmt::format("{:<12} {:<15} {:>10.1f} {:>7} {:>7} {:>9.2f} {:>9} {:>6} {:>8} {:>7} {:>7} {:>8} {:>7} {:>9}\n",
                    run.model, run.config, run.samples_per_s, ratio_text(r.vs_fp32), ratio_text(r.vs_tf32), run.step_ms,
                    or_dash(run.peak_mib, "{:.0f}"), ratio_text(r.peak_vs_fp32), or_dash(run.final_loss, "{:.4f}"),
                    accuracy_text(run.accuracy), or_dash(as_double(run.skipped_steps), "{:.0f}"),
                    or_dash(run.final_scale, "{:g}"), ratio_text(r.vs_loop), ratio_text(r.vs_torch_amp));
  }
  return out;
}

void write_json_and_csv(const std::string& dir, const RunContext& context, const std::vector<RunResult>& runs) {
  std::filesystem::create_directories(dir);
  // Built in memory, each file written whole (temporary file, fsync, rename): a killed run leaves the previous
  // results, never half of new ones.
  ddp::Json json = {{"benchmark", "amp_vs_fp32"},         {"date", context.date},      {"machine", context.machine},
                    {"device", context.device},           {"mode", context.mode},      {"torch", context.torch_version},
                    {"tasks", context.task_descriptions}, {"runs", ddp::Json::array()}};
  for (const RunResult& run : runs) {
    const RunRatios r = ratios_of(run, runs);
    ddp::Json losses = ddp::Json::array();
    for (const float loss : run.losses) losses.push_back(json_number(static_cast<double>(loss)));
    json["runs"].push_back({{"model", run.model},
                            {"config", run.config},
                            {"kind", run.kind},
                            {"dtype", run.dtype},
                            {"ok", run.ok()},
                            {"error", run.error},
                            {"samples_per_s", json_number(run.samples_per_s)},
                            {"step_ms", json_number(run.step_ms)},
                            {"peak_mib", json_number(run.peak_mib)},
                            {"final_loss", json_number(run.final_loss)},
                            {"accuracy", json_number(run.accuracy)},
                            {"skipped_steps", json_number(run.skipped_steps)},
                            {"final_scale", json_number(run.final_scale)},
                            {"x_fp32", json_number(r.vs_fp32)},
                            {"x_tf32", json_number(r.vs_tf32)},
                            {"peak_x_fp32", json_number(r.peak_vs_fp32)},
                            {"accuracy_delta_points", json_number(r.accuracy_delta_points)},
                            {"x_loop", json_number(r.vs_loop)},
                            {"x_torch_amp", json_number(r.vs_torch_amp)},
                            {"losses", std::move(losses)}});
  }

  std::ostringstream csv;
  csv << "model,config,kind,dtype,status,samples_per_s,x_fp32,x_tf32,step_ms,peak_mib,peak_x_fp32,final_loss,"
         "accuracy,accuracy_delta_points,skipped_steps,final_scale,x_loop,x_torch_amp,error\n";
  for (const auto& run : runs) {
    const RunRatios r = ratios_of(run, runs);
    const std::string sps = run.ok() ? fmt::format("{:.6g}", run.samples_per_s) : std::string();
    const std::string ms = run.ok() ? fmt::format("{:.6g}", run.step_ms) : std::string();
    csv << run.model << ',' << csv_field(run.config) << ',' << run.kind << ',' << run.dtype << ','
        << (run.ok() ? "ok" : "skipped") << ',' << sps << ',' << csv_number(r.vs_fp32, "{:.3f}") << ','
        << csv_number(r.vs_tf32, "{:.3f}") << ',' << ms << ',' << csv_number(run.peak_mib) << ','
        << csv_number(r.peak_vs_fp32, "{:.3f}") << ',' << csv_number(run.final_loss) << ',' << csv_number(run.accuracy)
        << ',' << csv_number(r.accuracy_delta_points, "{:.2f}") << ','
        << csv_number(as_double(run.skipped_steps), "{:.0f}") << ',' << csv_number(run.final_scale) << ','
        << csv_number(r.vs_loop, "{:.3f}") << ',' << csv_number(r.vs_torch_amp, "{:.3f}") << ',' << csv_field(run.error)
        << '\n';
  }
  amp::write_file_atomically(dir + "/amp_vs_fp32.json", ddp::json_text(json, 2) + "\n");
  amp::write_file_atomically(dir + "/amp_vs_fp32.csv", csv.str());
}

std::string write_plot(const std::string& dir, const RunContext& context, const std::vector<RunResult>& runs) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    return "no PNG: gnuplot is not installed (apt-get install gnuplot-nox)";
  }
  std::filesystem::create_directories(dir);
  std::vector<std::string> models;
  for (const auto& run : runs) {
    if (run.ok() && std::find(models.begin(), models.end(), run.model) == models.end()) models.push_back(run.model);
  }
  if (models.empty()) return "no PNG: no run completed";

  std::ostringstream plots;
  for (const std::string& model : models) {
    // Loss curves: one column per run that recorded them (all of ours have the same number of steps).
    std::vector<const RunResult*> curves;
    for (const auto& run : runs) {
      if (run.ok() && run.model == model && !run.losses.empty()) curves.push_back(&run);
    }
    const std::string loss_file = dir + "/amp_vs_fp32_" + model + "_loss.dat";
    {
      std::ofstream out = open_for_writing(loss_file);
      out << "step";
      for (const auto* run : curves) out << " \"" << run->config << '"';
      out << '\n';
      const size_t steps = curves.empty() ? 0 : curves.front()->losses.size();
      for (size_t s = 0; s < steps; ++s) {
        out << s;
        for (const auto* run : curves) out << ' ' << (s < run->losses.size() ? run->losses[s] : NAN);
        out << '\n';
      }
    }
    const std::string bar_file = dir + "/amp_vs_fp32_" + model + "_throughput.dat";
    {
      std::ofstream out = open_for_writing(bar_file);
      for (const auto& run : runs) {
        if (run.ok() && run.model == model) out << '"' << run.config << "\" " << run.samples_per_s << '\n';
      }
    }
    plots << "set title '" << model << ": training loss per step'\nset xlabel 'step'\nset ylabel 'loss'\n"
          << "set xtics norotate\nset autoscale y\nset key top right\n";
    if (curves.empty()) {
      plots << "plot 0 notitle\n";
    } else {
      plots << "plot for [i=2:" << curves.size() + 1 << "] '" << loss_file
            << "' using 1:i with lines lw 1.5 title columnheader(i)\n";
    }
    plots << "set title '" << model << ": throughput (samples/s, higher is better)'\nset xlabel ''\nset ylabel "
          << "'samples/s'\nset yrange [0:*]\nset style fill solid 0.7\nset boxwidth 0.7\nset xtics rotate by -35\n"
          << "plot '" << bar_file << "' using 0:2:xtic(1) with boxes notitle\nunset yrange\n";
  }
  const std::string script = dir + "/amp_vs_fp32.gp";
  const std::string png = dir + "/amp_vs_fp32.png";
  constexpr int64_t kPanelHeightPixels = 550;
  const int64_t height = kPanelHeightPixels * static_cast<int64_t>(models.size());
  // pngcairo draws better; plain png (libgd) is the fallback where gnuplot was built without cairo.
  for (const char* terminal : {"pngcairo size 1500,{} noenhanced font ',10'", "png size 1500,{} noenhanced"}) {
    {
      std::ofstream out = open_for_writing(script);
      out << "set terminal " << fmt::format(fmt::runtime(terminal), height) << "\n";
      out << "set output '" << png << ".tmp'\n";
      out << "set multiplot layout " << models.size() << ",2 title 'AMP vs FP32 on " << context.device << " ("
          << context.mode << " mode), " << context.date << "'\n";
      out << plots.str() << "unset multiplot\n";
    }
    if (std::system(("gnuplot '" + script + "' 2>'" + dir + "/amp_vs_fp32.gnuplot.log'").c_str()) == 0) {
      std::filesystem::rename(png + ".tmp", png);  // the finished picture replaces the old one at once
      return "plot: " + png;
    }
  }
  return "no PNG: gnuplot failed (see " + dir + "/amp_vs_fp32.gnuplot.log)";
}

std::string report_html(const RunContext& context, const std::vector<RunResult>& runs) {
  std::string rows;
  for (const auto& run : runs) {
    if (!run.ok()) {
      rows += fmt::format("<tr><td>{}</td><td>{}</td><td colspan=\"8\">skipped: {}</td></tr>\n",
                          run::html_escape(run.model), run::html_escape(run.config), run::html_escape(run.error));
      continue;
    }
    const RunRatios r = ratios_of(run, runs);
    rows += fmt::format(
        "<tr><td>{}</td><td>{}</td><td>{:.1f}</td><td>{}</td><td>{:.2f}</td><td>{}</td><td>{}</td><td>{}</td>"
        "<td>{}</td><td>{}</td></tr>\n",
        run::html_escape(run.model), run::html_escape(run.config), run.samples_per_s, ratio_text(r.vs_fp32),
        run.step_ms, or_dash(run.final_loss, "{:.4f}"), accuracy_text(run.accuracy),
        or_dash(as_double(run.skipped_steps), "{:.0f}"), or_dash(run.final_scale, "{:g}"), ratio_text(r.vs_torch_amp));
  }
  std::string body =
      fmt::format("<h1>AMP vs FP32</h1>\n<p>{} ({} mode), {} | {} | torch {}</p>\n", run::html_escape(context.device),
                  run::html_escape(context.mode), run::html_escape(context.date), run::html_escape(context.machine),
                  run::html_escape(context.torch_version));
  for (const std::string& task : context.task_descriptions) body += "<p>" + run::html_escape(task) + "</p>\n";
  body +=
      "<h2>Summary</h2>\n<table id=\"summary\">\n<tr><th>model</th><th>config</th><th>samples/s</th><th>x FP32</th>"
      "<th>step ms</th><th>final loss</th><th>accuracy %</th><th>skipped</th><th>scale</th><th>x "
      "torch.amp</th></tr>\n" +
      rows + "</table>\n";
  std::vector<std::string> models;
  for (const auto& run : runs) {
    if (run.ok() && std::find(models.begin(), models.end(), run.model) == models.end()) models.push_back(run.model);
  }
  for (const std::string& model : models) {
    std::vector<run::ChartSeries> curves;
    std::vector<std::pair<std::string, double>> throughput;
    for (const auto& run : runs) {
      if (!run.ok() || run.model != model) continue;
      throughput.emplace_back(run.config, run.samples_per_s);
      if (!run.losses.empty()) {
        curves.push_back({run.config, {}});
        for (size_t s = 0; s < run.losses.size(); ++s) curves.back().points.emplace_back(s + 1, run.losses[s]);
      }
    }
    const std::string name = run::html_escape(model);
    body += fmt::format(
        "<h2>{0}</h2>\n<figure>\n{1}<figcaption>Training loss per step, every run on the same weights and batches"
        "</figcaption>\n</figure>\n<figure>\n{2}<figcaption>Throughput (samples/s, higher is better; the loss scale "
        "and skipped steps of each run are in the table)</figcaption>\n</figure>\n",
        name, run::line_chart_svg("fig-loss-" + model, "loss", curves),
        run::bar_chart_svg("fig-throughput-" + model, "samples/s", throughput));
  }
  return run::html_page("AMP vs FP32", body);
}

void write_metrics_lines(const std::string& path, const std::vector<RunResult>& runs,
                         std::optional<int64_t> every_steps) {
  std::string lines;
  for (const auto& run : runs) {
    if (!run.ok()) continue;
    const int64_t every = every_steps.value_or(run::default_metrics_every(static_cast<int64_t>(run.losses.size())));
    for (size_t s = 0; s < run.losses.size(); ++s) {
      const auto step = static_cast<int64_t>(s + 1);
      if (step % every != 0 && s + 1 != run.losses.size()) continue;
      lines += ddp::json_text({{"type", "step"},
                               {"model", run.model},
                               {"config", run.config},
                               {"step", step},
                               {"loss", json_number(static_cast<double>(run.losses[s]))}}) +
               "\n";
    }
    lines += ddp::json_text({{"type", "run"},
                             {"model", run.model},
                             {"config", run.config},
                             {"samples_per_s", json_number(run.samples_per_s)},
                             {"step_ms", json_number(run.step_ms)},
                             {"final_loss", json_number(run.final_loss)},
                             {"accuracy", json_number(run.accuracy)},
                             {"skipped_steps", json_number(run.skipped_steps)},
                             {"loss_scale", json_number(run.final_scale)}}) +
             "\n";
  }
  amp::write_file_atomically(path, lines);
}

}  // namespace bench
