// hpctrial plot JOB|EXPDIR: each trial's metrics against the batches trained, as PNG or SVG.
#include <boost/program_options.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "chart.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/search.h"
#include "hpctrial/view/ranking.h"
#include "job_verbs.h"
#include "verb.h"

namespace po = boost::program_options;

namespace hpctrial::cli {
namespace {

constexpr std::size_t kMaxDefaultPanels = 8;

// One trial's values: "kind/name" -> (batches, value), in file order.
using TrialMetrics = std::map<std::string, Series>;

TrialMetrics read_metrics(const std::string& path) {
  TrialMetrics out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      continue;  // a line cut short by a crash
    }
    const std::string kind = j.value("kind", "");
    if (!j.contains("metrics") || !j["metrics"].is_object() || !j.contains("batches")) continue;
    const double batches = j["batches"].get<double>();
    for (const auto& [name, value] : j["metrics"].items()) {
      if (!value.is_number()) continue;  // NaN and infinities are written as strings
      Series& s = out[kind + "/" + name];
      s.x.push_back(batches);
      s.y.push_back(value.get<double>());
    }
  }
  return out;
}

// The panels asked for: --metric NAME (every kind's) or KIND/NAME; by default every training and
// validation metric, training first.
std::vector<std::string> choose_metrics(const std::vector<TrialMetrics>& trials, const std::vector<std::string>& asked) {
  std::set<std::string> present;
  for (const auto& t : trials) {
    for (const auto& [key, series] : t) present.insert(key);
  }
  std::vector<std::string> chosen;
  if (asked.empty()) {
    for (const char* kind : {"training/", "validation/"}) {
      for (const auto& key : present) {
        if (key.rfind(kind, 0) == 0) chosen.push_back(key);
      }
    }
    if (chosen.size() > kMaxDefaultPanels) {
      std::cerr << "hpctrial plot: " << chosen.size() << " metrics; drawing the first " << kMaxDefaultPanels
                << " (choose with --metric)\n";
      chosen.resize(kMaxDefaultPanels);
    }
    return chosen;
  }
  for (const auto& name : asked) {
    std::size_t found = 0;
    for (const auto& key : present) {
      if (key == name || key.substr(key.find('/') + 1) == name) {
        if (std::find(chosen.begin(), chosen.end(), key) == chosen.end()) chosen.push_back(key);
        ++found;
      }
    }
    if (found == 0) {
      std::string known;
      for (const auto& key : present) known += (known.empty() ? "" : ", ") + key;
      throw ConfigError("hpctrial plot: no trial reported the metric '" + name + "'; the metrics are: " +
                        (known.empty() ? "none yet" : known));
    }
  }
  return chosen;
}

// "trial N: lr=0.1, ...": the hyperparameters that tell the trials apart (all of one trial's).
std::vector<std::string> legend(const core::ExperimentConfig& config, const std::vector<int>& trials) {
  std::vector<std::vector<std::pair<std::string, std::string>>> values;
  for (int trial : trials) values.push_back(view::hparam_values(core::trial_config(config, trial)));
  std::vector<std::string> out;
  for (std::size_t i = 0; i < trials.size(); ++i) {
    std::string text;
    for (std::size_t k = 0; k < values[i].size(); ++k) {
      bool same_in_all = values.size() > 1;
      for (const auto& other : values) same_in_all = same_in_all && other.size() == values[i].size() && other[k] == values[i][k];
      if (same_in_all) continue;
      text += (text.empty() ? "" : ", ") + values[i][k].first + "=" + values[i][k].second;
    }
    out.push_back("trial " + std::to_string(trials[i]) + (text.empty() ? "" : ": " + text));
  }
  return out;
}

// Where the trial was resumed (each run after its first, from its first batch) and, in an adaptive
// search, where the search stopped it (its last batch).
std::vector<Mark> marks_of(const core::ExperimentLayout& layout, int trial, const std::map<int, view::SearchPlace>& places,
                           const TrialMetrics& values) {
  std::vector<Mark> marks;
  for (const core::TrialRun& run : core::trial_progress(layout, trial).runs) {
    if (run.batches > 0) marks.push_back({Mark::Kind::kResumed, static_cast<double>(run.batches)});
  }
  const auto place = places.find(trial);
  if (place != places.end() && place->second.stopped) {
    double last = 0;
    for (const auto& [key, series] : values) {
      if (!series.x.empty()) last = std::max(last, series.x.back());
    }
    marks.push_back({Mark::Kind::kStopped, last});
  }
  return marks;
}

int run_plot(const std::vector<std::string>& args) {
  std::vector<std::string> outputs, metrics;
  std::vector<int> only_trials;
  po::options_description options;
  options.add_options()
      ("output,o", po::value(&outputs)->composing(), "FILE.png or FILE.svg (again for both); default EXPDIR/plot.png")
      ("metric", po::value(&metrics)->composing(), "a metric: NAME, or KIND/NAME (training/loss); again for more")
      ("trial", po::value(&only_trials)->composing(), "only trial N; again for more");
  po::variables_map vm;
  const std::string what = target_argument(args, "plot", R"(usage: hpctrial plot JOB|EXPDIR [-o FILE.png|FILE.svg] [--metric NAME] [--trial N]

Draws the training and validation metrics of each trial against the batches trained, from the
trials' metrics.jsonl: a panel per metric, a curve per trial (a search's trials overlaid, the
legend giving the hyperparameters that tell them apart). A triangle marks where a trial was
resumed (promoted by an adaptive search, or run again after a stop), an x where an adaptive
search stopped it. Works while the experiment runs.
)", &options, &vm);
  if (what.empty()) return kExitOk;
  const Target t = experiment_target(what);
  const core::ExperimentLayout layout{t.jobs.experiment_dir};
  const core::ExperimentConfig config = core::load_experiment_config({layout.config(), "", {}});
  const int count = core::trial_ids(config);
  std::vector<int> trials;
  for (int trial : only_trials) {
    if (trial < 0 || trial >= count) {
      throw ConfigError("hpctrial plot: the experiment in " + layout.dir + " has " + std::to_string(count) +
                        " trial(s), numbered from 0; --trial " + std::to_string(trial) + " does not exist");
    }
    trials.push_back(trial);
  }
  if (trials.empty()) {
    for (int trial = 0; trial < count; ++trial) trials.push_back(trial);
  }

  Chart chart;
  chart.title = config.name + "  (" + layout.dir + ")";
  std::vector<TrialMetrics> values;
  for (int trial : trials) values.push_back(read_metrics(layout.trial(trial).metrics_file()));
  chart.legend = legend(config, trials);
  const auto places = view::search_places(layout, config);
  for (std::size_t i = 0; i < trials.size(); ++i) chart.marks.push_back(marks_of(layout, trials[i], places, values[i]));
  for (const auto& key : choose_metrics(values, metrics)) {
    Panel panel;
    const auto slash = key.find('/');
    panel.title = key.substr(slash + 1) + " (" + key.substr(0, slash) + ")";
    panel.markers = key.rfind("training/", 0) != 0;
    for (const auto& trial : values) {
      const auto it = trial.find(key);
      panel.series.push_back(it == trial.end() ? Series{} : it->second);
    }
    chart.panels.push_back(std::move(panel));
  }
  if (chart.panels.empty()) {
    throw ConfigError("hpctrial plot: no trial of " + layout.dir + " has reported a metric yet");
  }
  if (outputs.empty()) outputs.push_back(layout.plot());
  for (const auto& path : outputs) {
    draw_chart(chart, path);
    std::cout << path << "\n";
  }
  return kExitOk;
}

}  // namespace

Verb plot_verb() { return {"plot", "draw each trial's metrics against the batches trained (PNG, SVG)", run_plot}; }

}  // namespace hpctrial::cli
