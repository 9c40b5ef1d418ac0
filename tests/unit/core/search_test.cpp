// The searcher's trials: how many, and each one's values, deterministic from the config and
// the experiment seed alone.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <set>

#include "hpctrial/core/config_node.h"
#include "hpctrial/core/diagnostics.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/search.h"

namespace hpctrial::core {
namespace {

using testing::HasSubstr;

ExperimentConfig parse_text(const std::string& yaml) {
  Diagnostics d;
  const ConfigNode root = parse_config_text(yaml, "exp.yaml", d);
  ExperimentConfig config = parse_experiment_config(root, d);
  EXPECT_TRUE(d.empty()) << d.to_string();
  config.source_path = "exp.yaml";
  return config;
}

ExperimentConfig parse(const std::string& searcher, const std::string& hparams, const std::string& extra = "") {
  return parse_text("name: s\nentrypoint: ./t\nsearcher: " + searcher + "\nhyperparameters: " + hparams + "\n" + extra);
}

// name -> value text of trial `id`, for the top-level hyperparameters.
std::map<std::string, std::string> values(const ExperimentConfig& c, int id) {
  std::map<std::string, std::string> out;
  for (const auto& [name, hp] : trial_config(c, id).hyperparameters) {
    EXPECT_EQ(hp.type, Hyperparameter::Type::kConst) << name;
    out[name] = hp.value.text();
  }
  return out;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

const char* kGrid = "{name: grid, metric: loss, max_length: {batches: 10}}";

TEST(Search, GridIsTheProductWithTheFirstHyperparameterSlowest) {
  const auto c = parse(kGrid, "{a: {type: int, minval: 0, maxval: 2, count: 3}, b: {type: categorical, vals: [x, y]}, "
                              "c: 7}");
  ASSERT_EQ(trial_count(c), 6);
  const std::vector<std::pair<std::string, std::string>> expected = {{"0", "x"}, {"0", "y"}, {"1", "x"},
                                                                     {"1", "y"}, {"2", "x"}, {"2", "y"}};
  for (int id = 0; id < 6; ++id) {
    const auto v = values(c, id);
    EXPECT_EQ(v.at("a"), expected[id].first) << id;
    EXPECT_EQ(v.at("b"), expected[id].second) << id;
    EXPECT_EQ(v.at("c"), "7");
  }
}

TEST(Search, GridPointsOfEachKindOfRange) {
  const auto c = parse(kGrid, "{lr: {type: log, minval: -3, maxval: -1, count: 3}, "
                              "d: {type: double, minval: 0, maxval: 1, count: 5}, "
                              "n: {type: int, minval: 1, maxval: 4, count: 10}, "
                              "m: {type: int, minval: 0, maxval: 10, count: 3}}");
  auto texts = [](const Hyperparameter& hp) {
    std::vector<std::string> out;
    for (const auto& p : grid_points(hp)) out.push_back(p.text());
    return out;
  };
  const auto& h = c.hyperparameters;
  EXPECT_EQ(texts(h[0].second), (std::vector<std::string>{"0.001", "0.01", "0.1"}));
  EXPECT_EQ(texts(h[1].second), (std::vector<std::string>{"0", "0.25", "0.5", "0.75", "1"}));
  EXPECT_EQ(texts(h[2].second), (std::vector<std::string>{"1", "2", "3", "4"})) << "count above the range: every int";
  EXPECT_EQ(texts(h[3].second), (std::vector<std::string>{"0", "5", "10"}));
  EXPECT_EQ(trial_count(c), 3 * 5 * 4 * 3);
}

TEST(Search, NestedRangesAreSearchedToo) {
  const auto c = parse(kGrid, "{opt: {name: sgd, lr: {type: categorical, vals: [0.1, 0.2]}}}");
  ASSERT_EQ(trial_count(c), 2);
  const auto t = trial_config(c, 1);
  EXPECT_EQ(t.hyperparameters[0].second.nested[1].second.type, Hyperparameter::Type::kConst);
  EXPECT_EQ(t.hyperparameters[0].second.nested[1].second.value.text(), "0.2");
}

// hyperparameters.engine (overwrite_deepspeed_config): a search over engine.* keys, each trial's
// engine section taking its values; the trial's hparams keep them. A key the engine section has
// not, a value it refuses, or no engine section at all, is a ConfigError naming the trial.
TEST(Search, EngineHyperparametersOverrideTheEngineSectionPerTrial) {
  const std::string engine = "engine: {train_micro_batch_size_per_gpu: 4, zero_optimization: {stage: 0}}\n";
  const auto c = parse(kGrid, "{global_batch_size: 8, engine: {zero_optimization: {stage: {type: categorical, "
                              "vals: [1, 2]}}, gradient_clipping: 0.5}}", engine);
  ASSERT_EQ(trial_count(c), 2);
  const auto first = trial_config(c, 0);
  const auto second = trial_config(c, 1);
  ASSERT_TRUE(first.engine && second.engine);
  EXPECT_EQ(first.engine->zero_stage, 1);
  EXPECT_EQ(second.engine->zero_stage, 2);
  EXPECT_EQ(second.engine->gradient_clipping, 0.5);
  EXPECT_EQ(second.engine->train_micro_batch_size_per_gpu, 4);  // the section's own keys stay
  EXPECT_EQ(second.hyperparameters[1].first, "engine");
  EXPECT_EQ(c.engine->zero_stage, 0);  // the experiment's config is untouched

  const char* kSingle = "{name: single, metric: loss, max_length: {batches: 10}}";
  EXPECT_THAT(error_of([&] { trial_config(parse(kSingle, "{engine: {zero_optimization: {stages: 2}}}", engine), 0); }),
              HasSubstr("hyperparameters.engine of trial 0: "));
  EXPECT_THAT(error_of([&] { trial_config(parse(kSingle, "{engine: {zero_optimization: {stages: 2}}}", engine), 0); }),
              HasSubstr("engine.zero_optimization.stages"));
  EXPECT_THAT(error_of([&] { trial_config(parse(kSingle, "{engine: {zero_optimization: {stage: 7}}}", engine), 0); }),
              HasSubstr("engine.zero_optimization.stage"));
  EXPECT_THAT(error_of([&] { trial_config(parse(kSingle, "{engine: {zero_optimization: {stage: 2}}}"), 0); }),
              HasSubstr("sets keys of the engine section, which this config has not"));
}

TEST(Search, RandomIsDeterministicPerSeedAndTrialAndInRange) {
  const std::string hp = "{n: {type: int, minval: 3, maxval: 5}, x: {type: double, minval: -1, maxval: 1}, "
                         "lr: {type: log, minval: -4, maxval: -2}, k: {type: categorical, vals: [a, b, c]}}";
  const auto c = parse("{name: random, metric: loss, max_length: {batches: 10}, max_trials: 50}", hp,
                       "reproducibility: {experiment_seed: 42}\n");
  ASSERT_EQ(trial_count(c), 50);
  std::set<std::string> ns, ks;
  std::set<std::string> distinct;
  for (int id = 0; id < 50; ++id) {
    const auto v = values(c, id);
    EXPECT_EQ(v, values(c, id)) << "the same trial, the same values";
    const int n = std::stoi(v.at("n"));
    EXPECT_TRUE(n >= 3 && n <= 5) << n;
    const double x = std::stod(v.at("x")), lr = std::stod(v.at("lr"));
    EXPECT_TRUE(x >= -1 && x < 1) << x;
    EXPECT_TRUE(lr >= 1e-4 && lr < 1e-2) << lr;
    ns.insert(v.at("n"));
    ks.insert(v.at("k"));
    distinct.insert(v.at("x"));
  }
  EXPECT_EQ(ns.size(), 3u);
  EXPECT_EQ(ks.size(), 3u);
  EXPECT_EQ(distinct.size(), 50u);
  const auto other = parse("{name: random, metric: loss, max_length: {batches: 10}, max_trials: 50}", hp,
                           "reproducibility: {experiment_seed: 43}\n");
  EXPECT_NE(values(c, 0), values(other, 0)) << "another seed, other values";
}

TEST(Search, MistakesNameTheTrialOrTheKey) {
  const auto grid = parse(kGrid, "{a: {type: int, minval: 0, maxval: 2, count: 3}}");
  EXPECT_THAT(error_of([&] { trial_config(grid, 3); }),
              HasSubstr("trial 3 does not exist: the grid searcher of exp.yaml makes 3 trial(s), numbered 0 to 2"));
  const auto single = parse("{name: single, metric: loss, max_length: {batches: 10}}",
                            "{a: {type: double, minval: 0, maxval: 1}}");
  EXPECT_EQ(trial_count(single), 1);
  EXPECT_THAT(error_of([&] { trial_config(single, 0); }),
              HasSubstr("hyperparameters.a is a range (type: double), but the single searcher of exp.yaml runs one "
                        "trial with constant values"));
  const auto unseeded = parse("{name: random, metric: loss, max_length: {batches: 10}, max_trials: 2}",
                              "{a: {type: double, minval: 0, maxval: 1}}");
  EXPECT_THAT(error_of([&] { trial_config(unseeded, 1); }), HasSubstr("needs reproducibility.experiment_seed"));
}

TEST(Search, MaxConcurrentTrialsIsReadAndWritten) {
  const auto c = parse("{name: grid, metric: loss, max_length: {batches: 10}, max_concurrent_trials: 4}", "{a: 1}");
  EXPECT_EQ(c.searcher.max_concurrent_trials, 4);
  EXPECT_EQ(parse(kGrid, "{a: 1}").searcher.max_concurrent_trials, 16);
  EXPECT_EQ(parse_text(to_yaml(c)).searcher.max_concurrent_trials, 4);
}

}  // namespace
}  // namespace hpctrial::core
