// hpctrial report EXPDIR: the experiment on one page - one self-contained HTML file (no script,
// no server, nothing fetched), which opens from a shared filesystem or as a copied file: the
// trials ranked, each trial's metrics as charts, its runs and failures, the search's rungs and
// promotions, and the effective config. It renders the read model's JSON (hpctrial::view), as
// `describe --json` prints it, so that the page and describe cannot disagree.
#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/text.h"
#include "hpctrial/view/experiment_view.h"
#include "job_verbs.h"
#include "verb.h"
#include "verb_args.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;
using nlohmann::json;

namespace hpctrial::cli {
namespace {

std::string escape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// A JSON value as a table cell: a string as it is, null as "-", anything else as JSON.
std::string cell(const json& value) {
  if (value.is_null()) return "-";
  return escape(value.is_string() ? value.get<std::string>() : value.dump());
}

std::string number(double value) {
  std::ostringstream out;
  out.precision(4);
  out << value;
  return out.str();
}

// Every line of a JSON-lines file that parses (a last line cut short by a killed job is skipped).
std::vector<json> json_lines(const std::string& path) {
  std::vector<json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (core::trim(line).empty()) continue;
    const json parsed = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_object()) out.push_back(parsed);
  }
  return out;
}

using Series = std::vector<std::pair<double, double>>;

// One metric against the batches trained, as an SVG line chart with its range written out.
std::string chart(const std::string& title, const Series& points) {
  constexpr double kWidth = 360, kHeight = 180, kLeft = 56, kBottom = 28, kTop = 22, kRight = 10;
  double x0 = points.front().first, x1 = x0, y0 = points.front().second, y1 = y0;
  for (const auto& [x, y] : points) {
    x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
  }
  // One batch, or one value: the point in the middle of a range around it.
  if (x1 == x0) x0 -= 1, x1 += 1;
  if (y1 == y0) {
    const double pad = y0 == 0 ? 1 : std::abs(y0) * 0.05;
    y0 -= pad, y1 += pad;
  }
  const auto px = [&](double x) { return kLeft + (x - x0) / (x1 - x0) * (kWidth - kLeft - kRight); };
  const auto py = [&](double y) { return kTop + (y1 - y) / (y1 - y0) * (kHeight - kTop - kBottom); };
  std::ostringstream out;
  out << "<svg class=\"chart\" role=\"img\" width=\"" << kWidth << "\" height=\"" << kHeight << "\" viewBox=\"0 0 "
      << kWidth << " " << kHeight << "\" xmlns=\"http://www.w3.org/2000/svg\"><title>" << escape(title)
      << "</title><text x=\"" << kLeft << "\" y=\"14\" class=\"t\">" << escape(title) << "</text>"
      << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << kWidth - kLeft - kRight << "\" height=\""
      << kHeight - kTop - kBottom << "\" class=\"frame\"/><polyline class=\"line\" points=\"";
  for (const auto& [x, y] : points) out << px(x) << "," << py(y) << " ";
  out << "\"/>";
  if (points.size() == 1) out << "<circle class=\"dot\" cx=\"" << px(points[0].first) << "\" cy=\"" << py(points[0].second) << "\" r=\"3\"/>";
  out << "<text x=\"" << kLeft - 4 << "\" y=\"" << kTop + 10 << "\" class=\"a\" text-anchor=\"end\">" << number(y1)
      << "</text><text x=\"" << kLeft - 4 << "\" y=\"" << kHeight - kBottom << "\" class=\"a\" text-anchor=\"end\">"
      << number(y0) << "</text><text x=\"" << kLeft << "\" y=\"" << kHeight - 8 << "\" class=\"a\">" << number(x0)
      << "</text><text x=\"" << kWidth - kRight << "\" y=\"" << kHeight - 8 << "\" class=\"a\" text-anchor=\"end\">"
      << number(x1) << " batches</text></svg>";
  return out.str();
}

// Each metric of a trial's metrics.jsonl (training ones, then validation ones), finite values only.
std::map<std::string, Series> trial_series(const core::TrialLayout& trial) {
  std::map<std::string, Series> series;
  for (const json& record : json_lines(trial.metrics_file())) {
    const std::string kind = record.value("kind", "");
    if ((kind != "training" && kind != "validation") || !record.contains("metrics") || !record["batches"].is_number()) {
      continue;
    }
    for (const auto& [name, value] : record["metrics"].items()) {
      const auto v = core::number_of(value);
      if (v && std::isfinite(*v)) series[kind + ": " + name].emplace_back(record["batches"].get<double>(), *v);
    }
  }
  return series;
}

void table(std::ostream& out, const std::string& id, const std::vector<std::string>& head,
           const std::vector<std::vector<std::string>>& rows) {
  out << "<table id=\"" << id << "\"><thead><tr>";
  for (const auto& h : head) out << "<th>" << escape(h) << "</th>";
  out << "</tr></thead><tbody>";
  for (const auto& row : rows) {
    out << "<tr>";
    for (const auto& c : row) out << "<td>" << c << "</td>";
    out << "</tr>";
  }
  out << "</tbody></table>\n";
}

// The search's events that say how the trials went: rungs, promotions, ends.
void search_section(std::ostream& out, const core::ExperimentLayout& layout) {
  std::vector<std::vector<std::string>> rows;
  for (const json& e : json_lines(layout.search_log())) {
    const std::string event = e.value("event", "");
    if (event == "search" || event == "created" || event == "started") continue;
    rows.push_back({cell(e.value("time", json())), cell(e.value("trial", json())), escape(event),
                    cell(e.value("rung", json())), cell(e.value("metric", json()))});
  }
  if (rows.empty()) return;
  out << "<h2>Search</h2><p>Each rung a trial reached, each promotion and end, as the search log records them.</p>\n";
  table(out, "search", {"time", "trial", "event", "rung", "metric"}, rows);
}

void trial_section(std::ostream& out, const json& trial) {
  const int id = trial["trial"];
  const core::TrialLayout dir{trial["directory"].get<std::string>()};
  out << "<section class=\"trial\" id=\"t-" << id << "\"><h2>Trial " << id << "</h2><dl>";
  std::string hparams;
  for (const auto& [name, value] : trial["hparams"].items()) hparams += (hparams.empty() ? "" : ", ") + name + "=" + value.get<std::string>();
  const json& job = trial["job"];
  out << "<dt>hyperparameters</dt><dd>" << escape(hparams.empty() ? "-" : hparams) << "</dd>"
      << "<dt>batches</dt><dd>" << cell(trial["batches"]) << "</dd><dt>checkpoint</dt><dd>" << cell(trial["checkpoint"])
      << "</dd><dt>job</dt><dd>"
      << (job.is_null() ? "-" : escape(job["scheduler"].get<std::string>() + " " + job["id"].get<std::string>()) + " " + cell(job["native_state"]))
      << "</dd><dt>starts, failures</dt><dd>" << trial["starts"] << ", " << trial["failures"] << "</dd></dl>\n<div class=\"charts\">";
  for (const auto& [name, points] : trial_series(dir)) out << chart(name, points);
  out << "</div>\n";
  std::vector<std::vector<std::string>> runs;
  for (const json& run : trial["runs"]) {
    runs.push_back({cell(run["started"]), cell(run["ranks"]), cell(run["batch"]), cell(run["from_batches"]),
                    cell(run["launcher"]), cell(run["image"])});
  }
  if (!runs.empty()) table(out, "runs-" + std::to_string(id), {"started", "ranks", "batch", "from batch", "launcher", "image"}, runs);
  std::vector<std::vector<std::string>> failures;
  for (const json& f : json_lines(dir.failures_file())) {
    failures.push_back({cell(f.value("time", json())), cell(f.value("rank", json())), cell(f.value("reason", json())),
                        cell(f.value("message", json()))});
  }
  if (!failures.empty()) {
    out << "<h3>Failures</h3>";
    table(out, "failures-" + std::to_string(id), {"time", "rank", "reason", "message"}, failures);
  }
  out << "</section>\n";
}

constexpr const char* kStyle = R"(body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:.5em 0 1.5em}th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f2f2f2}dl{display:grid;grid-template-columns:max-content auto;gap:2px 12px}dt{color:#666}
.charts{display:flex;flex-wrap:wrap;gap:8px}.frame{fill:none;stroke:#bbb}.line{fill:none;stroke:#1f6fb4;stroke-width:1.5}
.dot{fill:#1f6fb4}.t{font-size:12px}.a{font-size:10px;fill:#555}pre{background:#f7f7f7;padding:1em;overflow:auto}
section.trial{border-top:1px solid #ddd;margin-top:1.5em})";

void render(std::ostream& out, const core::ExperimentLayout& layout, const json& model, const std::string& config) {
  out << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>" << escape(model["experiment"])
      << " - hpctrial report</title><style>" << kStyle << "</style></head><body>\n<h1>" << escape(model["experiment"])
      << "</h1><dl><dt>directory</dt><dd>" << escape(model["directory"]) << "</dd><dt>searcher</dt><dd>"
      << escape(model["searcher"]) << ", metric " << escape(model["metric"]) << " ("
      << (model["smaller_is_better"].get<bool>() ? "smaller" : "larger") << " is better)</dd><dt>trials</dt><dd>"
      << model["trials"].size() << "</dd><dt>written</dt><dd>" << core::utc_now_iso() << "</dd></dl>\n";
  std::vector<std::vector<std::string>> jobs;
  for (const json& job : model["jobs"]) jobs.push_back({cell(job["scheduler"]), cell(job["id"]), cell(job["submitted"])});
  if (!jobs.empty()) table(out, "jobs", {"scheduler", "job", "submitted"}, jobs);
  std::vector<std::vector<std::string>> ranking;
  for (const json& s : model["ranking"]) {
    const std::string link = "<a href=\"#t-" + std::to_string(s["trial"].get<int>()) + "\">" + cell(s["trial"]) + "</a>";
    ranking.push_back({std::to_string(ranking.size() + 1), link, cell(s["best"]), cell(s["best_batches"]),
                       cell(s["state"]), cell(s["checkpoint"]), cell(s["hparams"])});
  }
  out << "<h2>Trials ranked by " << escape(model["metric"]) << "</h2>\n";
  table(out, "ranking", {"#", "trial", model["metric"].get<std::string>(), "at batch", "state", "checkpoint", "hyperparameters"},
        ranking);
  search_section(out, layout);
  for (const json& trial : model["trials"]) trial_section(out, trial);
  out << "<h2>Effective config</h2><pre id=\"config\">" << escape(config) << "</pre>\n</body></html>\n";
}

int run_report(const std::vector<std::string>& args) {
  std::string output;
  po::options_description options;
  options.add_options()("output,o", po::value(&output)->value_name("FILE.html"),
                        "where to write it (default EXPDIR/report.html)");
  po::variables_map vm;
  const std::string what = target_argument(args, "report", R"(usage: hpctrial report JOB|EXPDIR [-o FILE.html]

Writes the experiment on one page: one self-contained HTML file (no script, nothing fetched;
it opens from a shared filesystem, or copied to a laptop) with the trials ranked by the
searcher's metric, each trial's metrics as charts against the batches trained, its runs and
failures, an adaptive search's rungs and promotions, and the effective config. It shows what
`hpctrial describe --json` says, the charts from each trial's metrics.jsonl. Private (0600).
)", &options, &vm);
  if (what.empty()) return kExitOk;
  const Target t = experiment_target(what);
  const core::ExperimentLayout layout{t.jobs.experiment_dir};
  const core::ExperimentConfig config = core::load_experiment_config({layout.config(), "", {}});
  std::ostringstream page;
  render(page, layout, view::to_json(view::read_experiment(layout, config, t.scheduler)), core::to_yaml(config));
  if (output.empty()) output = layout.report();
  core::write_file_atomic(output, page.str());
  std::cout << "wrote " << output << "\n";
  return kExitOk;
}

}  // namespace

Verb report_verb() { return {"report", "write the experiment on one self-contained HTML page", run_report}; }

}  // namespace hpctrial::cli
