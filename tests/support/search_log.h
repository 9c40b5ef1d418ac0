// An adaptive search's log (search-events.jsonl) as tests read it: its rung events and how many
// events of a kind it holds, parsed with nlohmann/json independently of hpctrial's reader.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace hpctrial::testing_support {

// The rung events of a search log, in order: (trial, rung, metric).
inline std::vector<std::tuple<int, int, double>> rungs_of(const std::string& log) {
  std::vector<std::tuple<int, int, double>> out;
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    const auto e = nlohmann::json::parse(line);
    if (e["event"] == "rung") out.emplace_back(e["trial"].get<int>(), e["rung"].get<int>(), e["metric"].get<double>());
  }
  return out;
}

// How many events of `kind` ("created", "promoted", ...) the log holds; 0 without a log.
// Whether each start (or promotion) of `trial` reached its rung in the hands of the worker that
// made it: the trial's chief records the rung in its worker's name as its ranks end, so a worker
// killed after that left nothing to take over.
inline bool each_start_reached_its_rung(const std::string& log, int trial) {
  std::ifstream in(log);
  std::string starter;
  for (std::string line; std::getline(in, line);) {
    const auto e = nlohmann::json::parse(line);
    if (e.value("trial", -1) != trial) continue;
    const std::string kind = e.value("event", "");
    if (kind == "started" || kind == "promoted") {
      if (!starter.empty()) return false;  // started again before its rung: taken over
      starter = e.value("worker", "");
    } else if (kind == "rung") {
      if (e.value("worker", "") != starter) return false;
      starter.clear();
    }
  }
  return starter.empty();
}

inline std::size_t events_in(const std::string& log, const std::string& kind) {
  std::ifstream in(log);
  std::size_t n = 0;
  for (std::string line; std::getline(in, line);) n += nlohmann::json::parse(line)["event"] == kind;
  return n;
}

// The config at `path` as a random search of the same trials (trial N samples what trial N of the
// adaptive search does), each trained to max_length and validated every `period` batches, on
// this machine: the uninterrupted reference of an adaptive search. Written beside it; returns
// its path.
inline std::string reference_config(const std::string& path, int period = 8) {
  std::ifstream in(path);
  std::string text, line;
  while (std::getline(in, line)) {
    if (line.rfind("searcher:", 0) == 0) {
      const auto keep = [&](const std::string& key) {
        const std::size_t at = line.find(key + ": ");
        if (at == std::string::npos) return std::string();
        std::size_t end = line.find_first_of(",}", at);
        if (line.compare(at, key.size() + 3, key + ": {") == 0) end = line.find('}', at) + 1;
        return line.substr(at, end - at) + ", ";
      };
      line = "searcher: {name: random, " + keep("metric") + keep("max_length") + keep("max_trials");
      line = line.substr(0, line.size() - 2) + "}";
    } else if (line.rfind("min_validation_period:", 0) == 0) {
      line = "min_validation_period: {batches: " + std::to_string(period) + "}";
    } else if (line.rfind("scheduler:", 0) == 0) {
      line = "scheduler: {type: local}";
    }
    text += line + "\n";
  }
  const std::string out = path.substr(0, path.rfind('.')) + "-reference.yaml";
  std::ofstream(out) << text;
  return out;
}

// The search both schedulers' tests submit: adaptive_asha over the mlp example (`mlp`, its data
// in `data`), `trials` trials, 2 workers, rungs of 8, 32 and 128 batches; `scheduler` is the
// config's scheduler line.
inline std::string mlp_search_yaml(const std::string& name, const std::string& mlp, int trials,
                                   const std::string& data, const std::string& scheduler) {
  return "name: " + name + "\nentrypoint: " + mlp + "\n"
         "hyperparameters: {global_batch_size: 64, classes: 10, learning_rate: {type: log, base: 10, minval: -4, "
         "maxval: -0.5}, hidden: {type: categorical, vals: [16, 32, 64]}}\n"
         "searcher: {name: adaptive_asha, metric: validation_loss, max_length: {batches: 128}, max_trials: " +
         std::to_string(trials) + ", max_concurrent_trials: 2, mode: standard, divisor: 4, max_rungs: 3}\n"
         "min_validation_period: {batches: 1000}\nresources: {slots_per_trial: 1, slots_per_node: 1}\n"
         "reproducibility: {experiment_seed: 5}\n"
         "data: {train: " + data + "/train.h5, validation: " + data + "/validation.h5, x_dataset: x, y_dataset: y}\n" +
         scheduler + "\n";
}

// (trial, batches) -> the validation loss of the trial at that batch.
using Validations = std::map<std::pair<int, std::int64_t>, double>;

// Every validation_loss in the trials' metrics.jsonl of `experiment`.
inline Validations validation_losses(const std::string& experiment, int trials) {
  Validations out;
  for (int trial = 0; trial < trials; ++trial) {
    std::ifstream in(experiment + "/trial-" + std::to_string(trial) + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.value("kind", "") != "validation" || !j["metrics"]["validation_loss"].is_number()) continue;
      out[{trial, j["batches"].get<std::int64_t>()}] = j["metrics"]["validation_loss"].get<double>();
    }
  }
  return out;
}

// The search in `experiment` ran to its end and lost nothing: every one of its `trials` created
// once and trained to its first rung, no rung reached twice, each promotion followed by its
// rung, no trial failed, each trial's training reports count every batch once (a trial trained
// twice at once, or twice over, reports batches again), and each validation of a trial the same
// as `expected` (the same search run uninterrupted) has at that batch, to the last bits that
// another number of threads may change. (Which bracket, so which rungs, a trial gets depends on
// how many workers ran, so rungs are not compared by number.)
inline void expect_search_complete(const std::string& experiment, int trials, const Validations& expected) {
  const std::string log = experiment + "/search-events.jsonl";
  ASSERT_FALSE(expected.empty());
  EXPECT_EQ(events_in(log, "created"), static_cast<std::size_t>(trials));
  EXPECT_EQ(events_in(log, "failed"), 0u);
  EXPECT_GE(events_in(log, "finished"), 1u);
  std::map<std::pair<int, int>, double> reached;
  for (const auto& [trial, rung, metric] : rungs_of(log)) {
    EXPECT_TRUE(reached.emplace(std::make_pair(trial, rung), metric).second)
        << "trial " << trial << " reached rung " << rung << " twice";
  }
  std::size_t compared = 0;
  for (const auto& [at, loss] : validation_losses(experiment, trials)) {
    const auto it = expected.find(at);
    if (it == expected.end()) continue;
    ++compared;
    EXPECT_NEAR(loss, it->second, 1e-6 * std::abs(it->second)) << "trial " << at.first << " at batch " << at.second;
  }
  EXPECT_GE(compared, static_cast<std::size_t>(trials)) << "too few validations in common with the uninterrupted search";
  for (int trial = 0; trial < trials; ++trial) EXPECT_EQ(reached.count({trial, 0}), 1u) << "trial " << trial;
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    const auto e = nlohmann::json::parse(line);
    if (e["event"] != "promoted") continue;
    EXPECT_EQ(reached.count({e["trial"].get<int>(), e["rung"].get<int>()}), 1u)
        << "trial " << e["trial"] << " was promoted to rung " << e["rung"] << " and never reached it";
  }
  for (int trial = 0; trial < trials; ++trial) {
    std::ifstream metrics(experiment + "/trial-" + std::to_string(trial) + "/metrics.jsonl");
    std::int64_t previous = 0;
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j["kind"] != "training") continue;
      EXPECT_GT(j["batches"].get<std::int64_t>(), previous) << "trial " << trial << " reported a batch again";
      previous = j["batches"].get<std::int64_t>();
    }
  }
}

}  // namespace hpctrial::testing_support
