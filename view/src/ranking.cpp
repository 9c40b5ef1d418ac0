// The ranking of an experiment's trials and each one's hyperparameters, from its directory.
#include "hpctrial/view/ranking.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>

#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/text.h"
#include "hpctrial/search/event_log.h"

namespace fs = std::filesystem;

namespace hpctrial::view {
namespace {

bool better(double a, double b, bool smaller_is_better) {
  if (std::isnan(a) || std::isnan(b)) return !std::isnan(a) && std::isnan(b);
  return smaller_is_better ? a < b : a > b;
}

// The best validation of `metric` in the trial's metrics.jsonl, and its batch.
void best_validation(const core::TrialLayout& trial, const core::Searcher& searcher, TrialStanding& s) {
  std::ifstream in(trial.metrics_file());
  for (std::string line; std::getline(in, line);) {
    try {
      const auto record = nlohmann::json::parse(line);
      if (record.value("kind", "") != "validation" || !record.contains("metrics")) continue;
      const auto& metrics = record.at("metrics");
      if (!metrics.contains(searcher.metric)) continue;
      const auto value = core::number_of(metrics.at(searcher.metric));
      if (!value) continue;
      if (!s.best || better(*value, *s.best, searcher.smaller_is_better)) {
        s.best = value;
        s.best_batches = record.value("batches", std::int64_t{0});
      }
    } catch (const nlohmann::json::exception&) {
      // a line cut short: the others stand
    }
  }
}

// The trial's checkpoint with the best metric, else its latest; and the latest's batches.
std::string best_checkpoint(const core::ExperimentLayout& layout, const core::ExperimentConfig& config, int trial,
                            std::int64_t& latest_batches) {
  const core::TrialLayout t = layout.trial(trial);
  const std::string dir = core::checkpoint_dir(config, t, trial, core::experiment_identity(layout));
  if (!fs::is_directory(dir)) return "";
  const checkpoint::CheckpointStore store(dir, {});
  std::optional<checkpoint::CheckpointInfo> best;
  std::string latest;
  for (const auto& info : store.list(/*verify=*/false)) {
    if (!info.valid) continue;
    if (info.latest) {
      latest = info.file;
      latest_batches = info.batches;
    }
    if (info.metric && (!best || better(*info.metric, *best->metric, config.searcher.smaller_is_better))) best = info;
  }
  const std::string file = best ? best->file : latest;
  return file.empty() ? "" : (fs::path(dir) / file).string();
}

}  // namespace

std::map<int, SearchPlace> search_places(const core::ExperimentLayout& layout, const core::ExperimentConfig& config) {
  std::map<int, SearchPlace> out;
  const auto identity = core::experiment_identity(layout);
  if (!config.searcher.adaptive() || !identity || !fs::exists(layout.search_log())) return out;
  const search::AshaOptions options = search::options_of(config);
  const search::EventLog log(layout.search_log(), layout.search_lock(), identity->id, search::settings_of(options));
  const search::Asha asha = search::replay(options, log.read_only(), log.path());
  // Every trial created and none training: the search is over, and a trial still waiting for a
  // promotion will not get one.
  int total = 0;
  for (const auto& bracket : asha.brackets()) total += bracket.max_trials;
  bool over = asha.created() == total;
  for (const auto& [id, t] : asha.trials()) over = over && !t.training;
  for (const auto& [id, t] : asha.trials()) {
    const int rungs = asha.brackets().at(static_cast<std::size_t>(t.bracket)).rungs;
    const std::string rung = "rung " + std::to_string(t.rung) + " of " + std::to_string(rungs);
    SearchPlace& place = out[id];
    place.text = t.finished ? "finished"
                 : t.failed ? "failed at " + rung
                 : t.stopped || t.stop_pending ? "stopped at " + rung
                 : t.training ? "training toward " + rung
                 : over       ? "stopped at " + rung + " (not promoted)"
                              : "waits at " + rung + " for a promotion";
    place.stopped = t.stopped || t.stop_pending || t.failed || (over && !t.finished && !t.training);
  }
  return out;
}

std::vector<TrialStanding> rank_trials(const core::ExperimentLayout& layout, const core::ExperimentConfig& config) {
  const int trials = core::trial_ids(config);
  const auto places = search_places(layout, config);
  std::vector<std::vector<std::pair<std::string, std::string>>> values;
  std::vector<TrialStanding> out;
  for (int trial = 0; trial < trials; ++trial) {
    if (!fs::is_directory(layout.trial_dir(trial))) continue;
    TrialStanding s;
    s.trial = trial;
    best_validation(layout.trial(trial), config.searcher, s);
    std::int64_t batches = 0;
    s.checkpoint = best_checkpoint(layout, config, trial, batches);
    const auto it = places.find(trial);
    s.state = it != places.end() ? it->second.text
                                 : "trained " + std::to_string(batches) + " batches (max_length " +
                                       std::to_string(config.searcher.max_length.value) + " " +
                                       std::string(core::to_string(config.searcher.max_length.unit)) + ")";
    values.push_back(hparam_values(core::trial_config(config, trial)));
    out.push_back(s);
  }
  // Only the hyperparameters in which the trials differ.
  for (std::size_t i = 0; i < out.size(); ++i) {
    for (std::size_t k = 0; k < values[i].size(); ++k) {
      bool differs = false;
      for (const auto& other : values) differs = differs || other.at(k).second != values[i][k].second;
      if (differs || out.size() == 1) {
        out[i].hparams += (out[i].hparams.empty() ? "" : ", ") + values[i][k].first + "=" + values[i][k].second;
      }
    }
  }
  const bool smaller = config.searcher.smaller_is_better;
  std::stable_sort(out.begin(), out.end(), [smaller](const TrialStanding& a, const TrialStanding& b) {
    if (a.best.has_value() != b.best.has_value()) return a.best.has_value();
    return a.best && better(*a.best, *b.best, smaller);
  });
  return out;
}

// A trial's hyperparameters: nested ones as dotted names, a constant list or map as its YAML.
std::vector<std::pair<std::string, std::string>> hparam_values(const core::ExperimentConfig& resolved) {
  std::vector<std::pair<std::string, std::string>> values;
  std::function<void(const std::vector<std::pair<std::string, core::Hyperparameter>>&, const std::string&)> list =
      [&](const auto& hps, const std::string& prefix) {
        for (const auto& [name, hp] : hps) {
          if (hp.type == core::Hyperparameter::Type::kNested) {
            list(hp.nested, prefix + name + ".");
          } else {
            values.emplace_back(prefix + name, hp.value.is_scalar() ? hp.value.text() : core::trim(hp.value.to_yaml()));
          }
        }
      };
  list(resolved.hyperparameters, "");
  return values;
}

std::string hparams_text(const core::ExperimentConfig& resolved) {
  std::string text;
  for (const auto& [name, value] : hparam_values(resolved)) text += (text.empty() ? "" : ", ") + name + "=" + value;
  return text;
}

}  // namespace hpctrial::view
