// What the trial directory says about a trial's runs and its next size.
#include "hpctrial/core/experiment_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <filesystem>
#include <limits>

#include "../../support/read_file.h"
#include "../../support/temp_dir.h"
#include "hpctrial/core/config_compare.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/metric_order.h"

namespace hpctrial::core {
namespace {

using testing::HasSubstr;
using testing_support::read_file;
using testing_support::TempDir;

// An identity is made once and kept; two experiments of one name differ by it; an experiment
// made before identities, whose config used a host_path, keeps its checkpoints where they are.
TEST(ExperimentIdentity, IsMadeOnceAndNamesTheExperimentsOwnFolder) {
  TempDir dir;
  const ExperimentLayout a{(dir.path() / "a").string()};
  const ExperimentLayout b{(dir.path() / "b").string()};
  EXPECT_FALSE(experiment_identity(a).has_value());
  const ExperimentIdentity made = ensure_experiment_identity(a, "mlp");
  EXPECT_THAT(made.id, testing::MatchesRegex("[0-9a-f]{16}"));
  EXPECT_EQ(made.name, "mlp");
  EXPECT_EQ(made.host_folder, "mlp-" + made.id);
  EXPECT_EQ(ensure_experiment_identity(a, "renamed").id, made.id);
  EXPECT_EQ(experiment_identity(a)->host_folder, made.host_folder);
  EXPECT_NE(ensure_experiment_identity(b, "mlp").id, made.id);

  ExperimentConfig config;
  config.name = "mlp";
  EXPECT_EQ(checkpoint_dir(config, a.trial(3), 3, made), a.trial_dir(3) + "/checkpoints");
  config.checkpoint_storage.host_path = "/scratch/ckpt";
  EXPECT_EQ(checkpoint_dir(config, a.trial(3), 3, made), "/scratch/ckpt/mlp-" + made.id + "/trial-3");
  EXPECT_EQ(checkpoint_dir(config, a.trial(3), 3, std::nullopt), "/scratch/ckpt/mlp/trial-3");

  // A config written by a creation that went no further: the experiment has not begun.
  const ExperimentLayout unborn{(dir.path() / "unborn").string()};
  dir.write("unborn/experiment.yaml", "name: mlp\nentrypoint: ./t\n"
                                      "searcher: {name: single, metric: l, max_length: {batches: 1}}\n"
                                      "checkpoint_storage: {host_path: /scratch/ckpt}\n");
  const ExperimentIdentity fresh = ensure_experiment_identity(unborn, "mlp");
  EXPECT_EQ(fresh.host_folder, "mlp-" + fresh.id);
}

// An identity is never made twice: an experiment that has begun (a trial launched, a search log)
// and whose record is missing, damaged, of another kind or without an id is an error naming the
// file and the repair; restore_experiment_identity records the one the checkpoints name.
TEST(ExperimentIdentity, IsNeverMadeAgainForAnExperimentThatHasBegun) {
  TempDir dir;
  const ExperimentLayout e{(dir.path() / "e").string()};
  const ExperimentIdentity made = ensure_experiment_identity(e, "mlp");
  EXPECT_FALSE(experiment_started(e));
  dir.write("e/trial-0/launcher-state.json", "{\"starts\": 1}\n");
  EXPECT_TRUE(experiment_started(e));
  for (const std::string damage : {"", "[]", "{}", "{\"jobs\": []}", "not json", "(removed)"}) {
    SCOPED_TRACE(damage);
    if (damage == "(removed)") {
      std::filesystem::remove(e.state());
    } else {
      dir.write("e/experiment.json", damage);
    }
    for (const auto& call : std::vector<std::function<void()>>{[&] { experiment_identity(e); },
                                                                [&] { ensure_experiment_identity(e, "mlp"); },
                                                                [&] { require_experiment_identity(e); }}) {
      try {
        call();
        ADD_FAILURE() << "an identity was made or read";
      } catch (const IoError& error) {
        EXPECT_THAT(error.what(), HasSubstr(e.state()));
        EXPECT_THAT(error.what(), HasSubstr("hpctrial experiment repair " + e.dir));
      }
    }
    EXPECT_EQ(restore_experiment_identity(e, made).id, made.id);
    EXPECT_EQ(experiment_identity(e)->host_folder, made.host_folder);
  }
  const ExperimentIdentity other{"0123456789abcdef", "other", "other-0123456789abcdef"};
  EXPECT_THROW(restore_experiment_identity(e, other), IoError);
}

ExperimentConfig parsed(const std::string& text) {
  Diagnostics diagnostics;
  const ExperimentConfig c = parse_experiment_config(parse_config_text(text, "exp.yaml", diagnostics), diagnostics);
  diagnostics.throw_if_any();
  return c;
}

// The experiment's config has one owner: what it trains is fixed, its run settings may change
// and are recorded; nothing is written when a config is refused.
TEST(ExperimentConfigOwner, RefusesAnotherExperimentsConfigAndRecordsRunSettings) {
  TempDir dir;
  const ExperimentLayout e{(dir.path() / "e").string()};
  const std::string base = "name: mlp\nentrypoint: /bin/t\nreproducibility: {experiment_seed: 3}\n";
  const std::string single = "searcher: {name: single, metric: l, max_length: {batches: 10}}\n";
  const ExperimentConfig made = parsed(base + single + "hyperparameters: {lr: 0.1}\n");
  check_experiment_config(e, made);  // nothing there yet
  EXPECT_FALSE(std::filesystem::exists(e.dir));
  const ExperimentIdentity identity = commit_experiment_config(e, made, "/work");
  EXPECT_EQ(commit_experiment_config(e, made, "/work").id, identity.id);

  // Until it has begun, a config that could not start may be corrected.
  const ExperimentConfig other = parsed(base + single + "hyperparameters: {lr: 0.2, momentum: 0.9}\n");
  EXPECT_EQ(commit_experiment_config(e, other, "/work").id, identity.id);
  EXPECT_THAT(read_file(e.config()), HasSubstr("momentum: 0.9"));
  commit_experiment_config(e, made, "/work");
  const std::string written = read_file(e.config());
  dir.write("e/trial-0/launcher-state.json", "{\"starts\": 1}\n");

  for (const auto& call : std::vector<std::function<void()>>{[&] { check_experiment_config(e, other); },
                                                              [&] { commit_experiment_config(e, other, "/w"); }}) {
    try {
      call();
      ADD_FAILURE() << "another experiment's config was taken";
    } catch (const ConfigError& error) {
      EXPECT_THAT(error.what(), HasSubstr(e.config() + " is the config of experiment mlp (" + identity.id + ")"));
      EXPECT_THAT(error.what(), HasSubstr("\n  hyperparameters.lr: 0.1 -> 0.2"));
      EXPECT_THAT(error.what(), HasSubstr("\n  hyperparameters.momentum: (none) -> 0.9"));
      EXPECT_THAT(error.what(), HasSubstr("(--experiment DIR)"));
    }
  }
  EXPECT_EQ(read_file(e.config()), written);

  // Run settings, and a longer single trial.
  const ExperimentConfig resumed = parsed(base + "searcher: {name: single, metric: l, max_length: {batches: 20}}\n" +
                                          "hyperparameters: {lr: 0.1}\nresources: {slots_per_trial: 4}\n"
                                          "max_restarts: 1\n");
  EXPECT_EQ(commit_experiment_config(e, resumed, "/elsewhere").id, identity.id);
  EXPECT_THAT(read_file(e.config()), HasSubstr("slots_per_trial: 4"));
  EXPECT_EQ(nlohmann::json::parse(read_file(e.state())).at("workdir"), "/elsewhere");

  std::vector<std::string> keys;
  for (const auto& d : config_differences(made, resumed)) keys.push_back(d.key);
  EXPECT_THAT(keys, testing::UnorderedElementsAre("searcher.max_length.batches", "resources.slots_per_trial",
                                                  "resources.slots_per_node", "max_restarts"));
  // An adaptive search's rungs are cut from max_length: another length is another search.
  const ExperimentConfig asha = parsed(base + "searcher: {name: async_halving, metric: l, max_length: {batches: 64}, "
                                              "max_trials: 4, num_rungs: 2}\nhyperparameters: {lr: {type: double, minval: 0.1, "
                                              "maxval: 1}}\n");
  EXPECT_FALSE(is_run_setting("searcher.max_length.batches", asha));
  EXPECT_TRUE(is_run_setting("searcher.max_length.batches", made));
  EXPECT_TRUE(is_run_setting("engine.pipeline.partition_method", made));
  EXPECT_FALSE(is_run_setting("engine.train_batch_size", made));
  EXPECT_FALSE(is_run_setting("checkpoint_storage.host_path", made));
  EXPECT_FALSE(is_run_setting("data.train", made));
  EXPECT_TRUE(is_run_setting("data.stage.to", made));
  EXPECT_FALSE(is_run_setting("resourcesx", made));
}

// An experiment made before experiments had folders keeps its checkpoints in the shared
// host_path/trial-<id>, where another's retention could act on them: refused until they are moved
// and the folder recorded.
TEST(ExperimentConfigOwner, AnExperimentInTheSharedLayoutWritesNothingThere) {
  TempDir dir;
  const ExperimentLayout e{(dir.path() / "e").string()};
  const ExperimentConfig made = parsed("name: mlp\nentrypoint: /bin/t\n"
                                       "searcher: {name: single, metric: l, max_length: {batches: 10}}\n"
                                       "checkpoint_storage: {host_path: /scratch/ckpt}\n");
  const ExperimentIdentity identity = commit_experiment_config(e, made, "/work");
  dir.write("e/experiment.json", "{\"experiment_id\": \"" + identity.id + "\", \"experiment_name\": \"mlp\", "
                                 "\"host_folder\": \"\"}\n");
  try {
    commit_experiment_config(e, made, "/work");
    ADD_FAILURE() << "the shared layout was taken";
  } catch (const ConfigError& error) {
    EXPECT_THAT(error.what(), HasSubstr("was made before experiments had a folder of their own"));
    EXPECT_THAT(error.what(), HasSubstr("/scratch/ckpt/mlp-" + identity.id + "/"));
    EXPECT_THAT(error.what(), HasSubstr("hpctrial experiment repair " + e.dir));
  }
  EXPECT_EQ(restore_experiment_identity(e, {identity.id, "mlp", "mlp-" + identity.id}).host_folder,
            "mlp-" + identity.id);
  EXPECT_EQ(commit_experiment_config(e, made, "/work").host_folder, "mlp-" + identity.id);
}

// A config lost from an experiment that has begun is never replaced by the one given.
TEST(ExperimentConfigOwner, ALostConfigOfAnExperimentThatHasBegunIsAnError) {
  TempDir dir;
  const ExperimentLayout e{(dir.path() / "e").string()};
  const ExperimentConfig made = parsed("name: mlp\nentrypoint: /bin/t\n"
                                       "searcher: {name: single, metric: l, max_length: {batches: 10}}\n");
  commit_experiment_config(e, made, "/work");
  dir.write("e/trial-0/runs.jsonl", "{}\n");
  std::filesystem::remove(e.config());
  try {
    commit_experiment_config(e, made, "/work");
    ADD_FAILURE() << "a lost config was replaced";
  } catch (const IoError& error) {
    EXPECT_THAT(error.what(), HasSubstr(e.config() + " is missing: the config of experiment mlp"));
  }
  EXPECT_FALSE(std::filesystem::exists(e.config()));
}

// The names of the experiment and trial directories, as docs/ and existing experiments know them.
TEST(Layout, NamesTheFilesOfAnExperimentAndItsTrials) {
  const ExperimentLayout e{"/e"};
  EXPECT_EQ(e.config(), "/e/experiment.yaml");
  EXPECT_EQ(e.state(), "/e/experiment.json");
  EXPECT_EQ(e.lock_file(), "/e/.experiment.lock");
  EXPECT_EQ(e.plot(), "/e/plot.png");
  EXPECT_EQ(e.job_file("job.sbatch"), "/e/job.sbatch");
  EXPECT_EQ(e.job_stop_file("12_1"), "/e/stop-request.12_1");
  EXPECT_EQ(e.worker_file("12_1"), "/e/worker.12_1.json");
  EXPECT_EQ(e.trial_dir(2), "/e/trial-2");
  const TrialLayout t = e.trial(2);
  EXPECT_EQ(t.dir, "/e/trial-2");
  EXPECT_EQ(t.metrics_file(), "/e/trial-2/metrics.jsonl");
  EXPECT_EQ(t.tensorboard_dir(), "/e/trial-2/tensorboard");
  EXPECT_EQ(t.profiler_trace(1, 10, 19), "/e/trial-2/tensorboard/traces/rank-1.batches-10-19.json");
  EXPECT_EQ(t.effective_config(), "/e/trial-2/effective-config.yaml");
  EXPECT_EQ(t.core_state_file(), "/e/trial-2/core-state.json");
  EXPECT_EQ(t.runs_file(), "/e/trial-2/runs.jsonl");
  EXPECT_EQ(t.elastic_file(), "/e/trial-2/elastic.json");
  EXPECT_EQ(t.default_checkpoint_dir(), "/e/trial-2/checkpoints");
  EXPECT_EQ(t.launcher_state_file(), "/e/trial-2/launcher-state.json");
  EXPECT_EQ(t.launcher_lock(), "/e/trial-2/.launcher.lock");
  EXPECT_EQ(t.failures_file(), "/e/trial-2/failures.jsonl");
  EXPECT_EQ(t.rank_log(3), "/e/trial-2/logs/rank-3.log");
  EXPECT_EQ(t.mpirun_log(), "/e/trial-2/logs/mpirun.log");
  EXPECT_EQ(t.hostfile(), "/e/trial-2/launch/hostfile");
  EXPECT_EQ(t.launch_config(), "/e/trial-2/launcher-config.yaml");
  EXPECT_EQ(t.search_record(), "/e/trial-2/search-trial.json");
  EXPECT_EQ(TrialLayout::trial_of("trial-12"), 12);
  EXPECT_FALSE(TrialLayout::trial_of("trial-").has_value());
  EXPECT_FALSE(TrialLayout::trial_of("trial-1x").has_value());
  EXPECT_FALSE(TrialLayout::trial_of("trials").has_value());
  EXPECT_EQ(default_experiment_dir("mlp"), "runs/mlp");
}

// A stop request for a whole job holds for the run it was made for: a later run of the same job
// (requeued, its restart count one more) finds it spent; a request for any run holds for each.
// A worker's record says which trial it trains, and nothing between trials.
TEST(JobStopRequest, HoldsForTheRunOfTheJobItWasMadeFor) {
  TempDir dir;
  const ExperimentLayout e{dir.path().string()};
  Allocation job;
  job.scheduler = "slurm";
  job.job_id = "12_1";
  job.restart_count = 2;
  EXPECT_EQ(job_stop_reason(e, job), "");
  request_job_stop(e, "12_1", 2, "pause");
  EXPECT_EQ(job_stop_reason(e, job), "pause");
  Allocation later = job;
  later.restart_count = 3;
  EXPECT_EQ(job_stop_reason(e, later), "") << "a request for an earlier run is spent";
  Allocation other = job;
  other.job_id = "12_0";
  EXPECT_EQ(job_stop_reason(e, other), "");
  request_job_stop(e, "12_1", -1, "pause");
  EXPECT_EQ(job_stop_reason(e, later), "pause");
  Allocation local;
  EXPECT_EQ(job_stop_reason(e, local), "") << "outside a job there is no job to stop";
  EXPECT_THROW(request_job_stop(e, "../x", 0, "pause"), Error);

  EXPECT_EQ(worker_trial(e, "12_1"), std::nullopt);
  record_worker_trial(e, "12_1", 7);
  EXPECT_EQ(worker_trial(e, "12_1"), 7);
  EXPECT_EQ(worker_trial(e, "12_0"), std::nullopt);
  record_worker_trial(e, "12_1", -1);
  EXPECT_EQ(worker_trial(e, "12_1"), -1) << "a worker between trials";
  clear_job_stop(e, "12_1");
  EXPECT_EQ(job_stop_reason(e, later), "");
}

// Loading a config makes host_path absolute; a relative one left in a config made in code is
// checked and taken from the working directory, never from the directory of config.source_path.
TEST(CheckpointDir, ARelativeHostPathOfAConfigMadeInCodeIsTheWorkingDirectorys) {
  ExperimentConfig config;
  config.name = "mlp";
  config.source_path = "/elsewhere/experiment.yaml";
  config.checkpoint_storage.host_path = "ckpt/../store";
  EXPECT_EQ(checkpoint_dir(config, TrialLayout{"/e/trial-1"}, 1, std::nullopt),
            (std::filesystem::current_path() / "store" / "mlp" / "trial-1").lexically_normal().string());
  config.checkpoint_storage.host_path = "~/ckpt";
  EXPECT_THROW(checkpoint_dir(config, TrialLayout{"/e/trial-1"}, 1, std::nullopt), ConfigError);
}

TEST(JsonFile, EveryValueOfADoubleRoundTrips) {
  const double values[] = {0.25, -3.5e300, std::numeric_limits<double>::quiet_NaN(),
                           std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()};
  for (const double v : values) {
    const auto back = number_of(nlohmann::json::parse(json_number(v).dump()));
    ASSERT_TRUE(back.has_value());
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(*back));
    } else {
      EXPECT_EQ(*back, v);
    }
  }
  EXPECT_EQ(json_number(std::nan("")), "NaN");
  EXPECT_TRUE(std::isnan(*number_of(nlohmann::json())));  // how NaN was once written
  EXPECT_FALSE(number_of("nan").has_value());
  const auto metrics = numbers_of(nlohmann::json::parse(R"({"a": 1.5, "b": "-Infinity", "c": null})"), "m");
  EXPECT_EQ(metrics.at("a"), 1.5);
  EXPECT_EQ(metrics.at("b"), -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(metrics.at("c")));
  try {
    numbers_of(nlohmann::json::parse(R"({"a": [1]})"), "f.json: meta/validation");
    ADD_FAILURE() << "a list was taken for a number";
  } catch (const IoError& e) {
    EXPECT_STREQ(e.what(), "f.json: meta/validation: \"a\" is not a number: [1]");
  }
}

TEST(JsonFile, AFieldOfTheWrongTypeNamesTheFileAndTheKey) {
  const auto state = nlohmann::json::parse(R"({"starts": "3", "failures": 2})");
  EXPECT_EQ(json_field(state, "failures", 0, "s.json"), 2);
  EXPECT_EQ(json_field(state, "missing", 7, "s.json"), 7);
  try {
    json_field(state, "starts", 0, "/x/launcher-state.json");
    ADD_FAILURE() << "a string was taken for a number";
  } catch (const IoError& e) {
    EXPECT_STREQ(e.what(), "/x/launcher-state.json: \"starts\" holds \"3\", which is not a whole number; fix the "
                           "file or remove it");
  }
}

TEST(MetricOrder, NonFiniteValuesRankLastEitherWay) {
  const double nan = std::nan("");
  const double inf = std::numeric_limits<double>::infinity();
  for (const bool smaller : {true, false}) {
    EXPECT_TRUE(metric_better(0.5, nan, smaller));
    EXPECT_FALSE(metric_better(nan, 0.5, smaller));
    EXPECT_TRUE(metric_better(1e300, inf, smaller));
    EXPECT_TRUE(metric_better(-1e300, -inf, smaller));
    EXPECT_FALSE(metric_better(-inf, 0.0, smaller));
    EXPECT_FALSE(metric_better(nan, nan, smaller));
  }
  EXPECT_TRUE(metric_better(0.1, 0.2, true));
  EXPECT_TRUE(metric_better(0.2, 0.1, false));
}

TEST(TrialProgress, ListsEachRunOfTheTrialAndSkipsALineCutShort) {
  TempDir dir;
  const ExperimentLayout layout{dir.path().string()};
  dir.write("trial-0/runs.jsonl",
            "{\"started\":\"2026-11-25T10:00:00Z\",\"ranks\":2,\"batch\":16,\"local_batch\":8,\"accumulation\":1,"
            "\"batches\":0}\n"
            "{\"started\":\"2026-11-25T11:00:00Z\",\"ranks\":1,\"batch\":32,\"local_batch\":16,\"accumulation\":2,"
            "\"batches\":1200,\"launcher\":\"srun\",\"container\":{\"runtime\":\"podman\",\"image\":\"x/y:1\"}}\n"
            "{\"started\":\"2026-11-25T12:0");
  const TrialProgress p = trial_progress(layout, 0);
  ASSERT_EQ(p.runs.size(), 2u);
  EXPECT_EQ(p.runs[0].ranks, 2);
  EXPECT_EQ(p.runs[0].started, "2026-11-25T10:00:00Z");
  EXPECT_EQ(p.runs[1].ranks, 1);
  EXPECT_EQ(p.runs[1].batch, 32);
  EXPECT_EQ(p.runs[1].local_batch, 16);
  EXPECT_EQ(p.runs[1].accumulation, 2);
  EXPECT_EQ(p.runs[1].batches, 1200);
  EXPECT_EQ(p.runs[0].launcher, "") << "a record from before the key says nothing";
  EXPECT_EQ(p.runs[0].image, "");
  EXPECT_EQ(p.runs[1].launcher, "srun");
  EXPECT_EQ(p.runs[1].runtime, "podman");
  EXPECT_EQ(p.runs[1].image, "x/y:1");
}

TEST(PreferredSlots, AreWholeNodesWithinTheElasticRange) {
  TempDir dir;
  Resources elastic;
  elastic.slots_per_trial = 8;
  elastic.slots_per_node = 2;
  elastic.min_slots_per_trial = 2;
  const std::string trial = dir.path().string();
  EXPECT_EQ(preferred_slots(trial, elastic), std::nullopt) << "no preference yet";
  dir.write("elastic.json", "{\"preferred_slots\": 5}\n");
  EXPECT_EQ(preferred_slots(trial, elastic), 4);
  dir.write("elastic.json", "{\"preferred_slots\": 64}\n");
  EXPECT_EQ(preferred_slots(trial, elastic), 8);
  dir.write("elastic.json", "{\"preferred_slots\": 1}\n");
  EXPECT_EQ(preferred_slots(trial, elastic), 2);
  dir.write("elastic.json", "{\"preferred_sl");
  EXPECT_EQ(preferred_slots(trial, elastic), std::nullopt) << "a file cut short is no preference";
  Resources fixed;
  fixed.slots_per_trial = 8;
  dir.write("elastic.json", "{\"preferred_slots\": 4}\n");
  EXPECT_EQ(preferred_slots(trial, fixed), std::nullopt) << "a trial that is not elastic keeps its size";
}

}  // namespace
}  // namespace hpctrial::core

namespace hpctrial::core {
namespace {

// An entry of the launcher state of the wrong type is an error naming the file, not a bare
// "type must be string".
TEST(TrialProgress, AnExcludedNodeOfTheWrongTypeNamesTheFile) {
  testing_support::TempDir dir;
  const ExperimentLayout e{(dir.path() / "e").string()};
  dir.write("e/trial-0/launcher-state.json", "{\"starts\": 2, \"excluded_nodes\": [{\"node\": 3, \"job\": \"7\"}]}\n");
  try {
    trial_progress(e, 0);
    ADD_FAILURE() << "read";
  } catch (const IoError& error) {
    EXPECT_THAT(error.what(), testing::HasSubstr(e.trial(0).launcher_state_file() + ": \"node\" holds 3"));
  }
}

}  // namespace
}  // namespace hpctrial::core
