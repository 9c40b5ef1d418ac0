// The read model of an experiment directory: a grid search of three trials, one of which never
// started and one whose metric is NaN, read as every view reads it (ranking, trials, the JSON).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/layout.h"
#include "hpctrial/view/experiment_view.h"
#include "../../support/temp_dir.h"

namespace hpctrial::view {
namespace {

using testing::ElementsAre;
using testing::Pair;
using testing_support::TempDir;

class ExperimentViewTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_.write("exp/experiment.yaml", R"(name: grid
entrypoint: /opt/trial
searcher: {name: grid, metric: loss, smaller_is_better: true, max_length: {batches: 64}}
hyperparameters:
  lr: {type: categorical, vals: [0.1, 0.01, 0.001]}
  hidden: 64
)");
    // Trial 0 validated twice, trial 1 once with NaN; trial 2 never started.
    dir_.write("exp/trial-0/metrics.jsonl",
               "{\"kind\": \"validation\", \"batches\": 32, \"metrics\": {\"loss\": 0.5}}\n"
               "{\"kind\": \"training\", \"batches\": 64, \"metrics\": {\"loss\": 0.1}}\n"
               "{\"kind\": \"validation\", \"batches\": 64, \"metrics\": {\"loss\": 0.25}}\n");
    dir_.write("exp/trial-1/metrics.jsonl",
               "{\"kind\": \"validation\", \"batches\": 32, \"metrics\": {\"loss\": \"NaN\"}}\n");
    config_ = core::load_experiment_config({layout_.config(), "", {}});
  }
  TempDir dir_;
  core::ExperimentLayout layout_{(dir_.path() / "exp").string()};
  core::ExperimentConfig config_;
};

TEST_F(ExperimentViewTest, EveryTrialIsReadAndTheRankingPutsNaNLast) {
  ASSERT_EQ(layout_.trial(0).metrics_file(), (dir_.path() / "exp/trial-0/metrics.jsonl").string());
  const ExperimentView v = read_experiment(layout_, config_, nullptr);
  EXPECT_EQ(v.directory, layout_.dir);
  EXPECT_EQ(v.scheduler, "");
  ASSERT_EQ(v.ranking.size(), 2u) << "trial 2 never started: not ranked";
  EXPECT_EQ(v.ranking[0].trial, 0);
  EXPECT_EQ(v.ranking[0].best, 0.25);
  EXPECT_EQ(v.ranking[0].best_batches, 64);
  EXPECT_EQ(v.ranking[0].hparams, "lr=0.1") << "only what differs between the trials";
  EXPECT_EQ(v.ranking[1].trial, 1);
  ASSERT_TRUE(v.ranking[1].best.has_value());
  EXPECT_TRUE(std::isnan(*v.ranking[1].best));
  ASSERT_EQ(v.trials.size(), 3u);
  EXPECT_THAT(v.trials[2].hparams, ElementsAre(Pair("lr", "0.001"), Pair("hidden", "64")));
  EXPECT_FALSE(v.trials[0].job.has_value()) << "no scheduler asked";
  EXPECT_FALSE(v.trials[0].batches.has_value()) << "no checkpoint, no heartbeat";
  EXPECT_FALSE(v.trials[0].checkpoint.has_value());
  EXPECT_FALSE(v.trials[0].inference.has_value());
}

TEST_F(ExperimentViewTest, TheJsonSaysWhatTheModelSays) {
  const ExperimentView v = read_experiment(layout_, config_, nullptr);
  const nlohmann::json j = to_json(v);
  EXPECT_EQ(j["experiment"], "grid");
  EXPECT_EQ(j["searcher"], "grid");
  EXPECT_EQ(j["max_length"]["value"], 64);
  ASSERT_EQ(j["ranking"].size(), v.ranking.size());
  EXPECT_EQ(j["ranking"][0]["best"], 0.25);
  EXPECT_EQ(j["ranking"][1]["best"], "NaN") << "as metrics.jsonl writes it";
  EXPECT_EQ(j["ranking"][0]["state"], v.ranking[0].state);
  ASSERT_EQ(j["trials"].size(), 3u);
  EXPECT_EQ(j["trials"][1]["directory"], layout_.trial_dir(1));
  EXPECT_EQ(j["trials"][1]["hparams"], (nlohmann::json{{"lr", "0.01"}, {"hidden", "64"}}));
  EXPECT_TRUE(j["trials"][0]["job"].is_null());
  EXPECT_TRUE(j["trials"][0]["batches"].is_null());
  EXPECT_TRUE(j["trials"][0]["checkpoint"].is_null());
  EXPECT_EQ(j["trials"][0]["runs"], nlohmann::json::array());
  EXPECT_FALSE(j["trials"][0].contains("inference"));
}

}  // namespace
}  // namespace hpctrial::view
