// The examples, as users run them: trained for a few hundred batches they must classify their
// synthetic data well, and two runs must produce bitwise-identical weights.
#include <signal.h>
#include <sys/stat.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <tuple>
#include <fstream>
#include <limits>
#include <regex>
#include <set>

#include "../support/exported_model.h"
#include "../support/metric_lines.h"
#include "../support/read_file.h"
#include "../support/same_weights.h"
#include "../support/search_log.h"
#include "../support/temp_dir.h"
#include "hpctrial/build_config.h"
#include "hpctrial/checkpoint/format.h"
#include "hpctrial/core/digest.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/core/text.h"
#include "hpctrial/comm/communicator.h"
#include "cnn_trial.h"
#include "../support/capturing_mlp.h"
#include "mlp_trial.h"
#include "synthetic_data.h"
#include "synthetic_images.h"

namespace hpctrial {
namespace {

using testing::HasSubstr;
using testing_support::comparable_metric_lines;
using testing_support::TempDir;

constexpr double kAccuracyThreshold = 0.90;  // chance is 0.10; the run reaches about 0.93

using testing_support::CapturingMlp;

class MlpExample : public testing::Test {
 protected:
  void SetUp() override {
    mlp_example::SyntheticSpec spec;
    train_ = (dir_.path() / "train.h5").string();
    validation_ = (dir_.path() / "validation.h5").string();
    mlp_example::write_synthetic_dataset(train_, spec);
    spec.samples = 2048;
    spec.seed = 2;
    mlp_example::write_synthetic_dataset(validation_, spec);
  }

  core::ConfigSources sources(int slots) const {
    return {HPCTRIAL_SOURCE_DIR "/examples/mlp/experiment.yaml", "",
            {"data.train=" + train_, "data.validation=" + validation_,
             "resources.slots_per_trial=" + std::to_string(slots)}};
  }

  trainer::LoopResult train(std::vector<torch::Tensor>* weights, const std::string& trial_dir) {
    const core::ExperimentConfig config = core::load_experiment_config(sources(1));
    comm::LocalCommunicator communicator;
    trainer::LoopOptions options;
    options.trial_dir = trial_dir;
    options.experiment_seed = *config.reproducibility.experiment_seed;
    options.progress_interval_s = 0;
    return trainer::run_training(config, [&](TrialContext& context) {
      return std::unique_ptr<Trial>(std::make_unique<CapturingMlp>(context, weights));
    }, communicator, options);
  }

  TempDir dir_;
  std::string train_, validation_;
};

TEST_F(MlpExample, LearnsAndIsBitwiseReproducible) {
  std::vector<torch::Tensor> first, second;
  const auto a = train(&first, (dir_.path() / "a").string());
  const auto b = train(&second, (dir_.path() / "b").string());
  EXPECT_EQ(a.batches_trained, 400);
  EXPECT_GT(a.last_validation.at("accuracy"), kAccuracyThreshold);
  ASSERT_EQ(first.size(), 6u);
  ASSERT_EQ(second.size(), first.size());
  for (std::size_t i = 0; i < first.size(); ++i) {
    EXPECT_TRUE(torch::equal(first[i], second[i])) << "parameter " << i << " differs between runs";
  }
  EXPECT_EQ(a.last_validation, b.last_validation);
}

// The mlp trial, paused from outside (as a signal or `hpctrial pause` would) after a batch.
class StoppingMlp : public CapturingMlp {
 public:
  StoppingMlp(TrialContext& context, std::vector<torch::Tensor>* out, std::int64_t stop_after,
              std::vector<std::int64_t>* batches_seen, std::atomic<bool>* stop)
      : CapturingMlp(context, out), stop_after_(stop_after), seen_(batches_seen), stop_(stop) {}
  Metrics train_batch(Batch& batch, std::int64_t epoch, std::int64_t batch_idx) override {
    seen_->push_back(batch_idx);
    Metrics metrics = CapturingMlp::train_batch(batch, epoch, batch_idx);
    if (batch_idx + 1 == stop_after_) stop_->store(true);
    return metrics;
  }

 private:
  std::int64_t stop_after_;
  std::vector<std::int64_t>* seen_;
  std::atomic<bool>* stop_;
};

// Every metrics line but the timings, as text.
class ExactResume : public MlpExample {
 protected:
  // Trains in `dir`, stopping after each of `stops` and resuming, to the end.
  std::vector<torch::Tensor> train_with_stops(const std::string& dir, const std::vector<std::int64_t>& stops,
                                              const std::vector<std::string>& overrides = {},
                                              std::int64_t first_batch = 0) {
    auto src = sources(1);
    src.overrides.insert(src.overrides.end(), overrides.begin(), overrides.end());
    const core::ExperimentConfig config = core::load_experiment_config(src);
    std::vector<torch::Tensor> weights;
    std::vector<std::int64_t> plan = stops;
    plan.push_back(-1);  // the last run goes to the end
    std::int64_t start = first_batch;
    const std::int64_t group = config.optimizations.aggregation_frequency;
    for (std::int64_t stop : plan) {
      weights.clear();
      std::vector<std::int64_t> seen;
      std::atomic<bool> stop_flag{false};
      comm::LocalCommunicator communicator;
      trainer::LoopOptions options;
      options.trial_dir = dir;
      options.experiment_seed = *config.reproducibility.experiment_seed;
      options.progress_interval_s = 0;
      options.external_stop = &stop_flag;
      const auto result = trainer::run_training(config, [&](TrialContext& context) {
        return std::unique_ptr<Trial>(std::make_unique<StoppingMlp>(context, &weights, stop, &seen, &stop_flag));
      }, communicator, options);
      EXPECT_EQ(result.stopped_early, stop >= 0);
      // Each run resumes where the previous one stopped.
      EXPECT_FALSE(seen.empty());
      if (seen.empty()) return weights;
      EXPECT_EQ(seen.front(), start) << "a run did not resume from the checkpoint";
      // A stop asked part way through an aggregation group takes effect at its end.
      const std::int64_t stopped = (stop + group - 1) / group * group;
      start = stopped;
      if (stop >= 0) {
        EXPECT_EQ(result.batches_trained, stopped);
        EXPECT_EQ(result.checkpoint_path, dir + "/checkpoints/ckpt-" + std::to_string(stopped) + ".h5");
      }
    }
    return weights;
  }
};

TEST_F(ExactResume, StoppedAndResumedEqualsUninterruptedBitwise) {
  const std::string straight = (dir_.path() / "straight").string();
  const auto reference = train_with_stops(straight, {});
  // 128 batches an epoch: mid-epoch, at an epoch boundary, and three times in one epoch.
  for (const auto& stops : std::vector<std::vector<std::int64_t>>{{150}, {128}, {140, 170, 230}}) {
    std::string name = "stops";
    for (auto k : stops) name += "-" + std::to_string(k);
    const std::string dir = (dir_.path() / name).string();
    const auto resumed = train_with_stops(dir, stops);
    ASSERT_EQ(resumed.size(), reference.size());
    for (std::size_t i = 0; i < reference.size(); ++i) {
      EXPECT_TRUE(torch::equal(resumed[i], reference[i])) << name << ": parameter " << i << " differs";
    }
    EXPECT_EQ(comparable_metric_lines(dir + "/metrics.jsonl"), comparable_metric_lines(straight + "/metrics.jsonl")) << name;
  }
}

// With gradients aggregated over 3 batches, a pause at any batch of a group ends bitwise where
// an uninterrupted run does: the stop waits for the group's optimizer step, so that no partly
// accumulated gradient is lost.
TEST_F(ExactResume, APauseInsideAnAggregationGroupLosesNothing) {
  const std::vector<std::string> aggregate = {"optimizations.aggregation_frequency=3"};
  const std::string straight = (dir_.path() / "aggregated").string();
  const auto reference = train_with_stops(straight, {}, aggregate);
  for (std::int64_t stop : {148, 149, 150}) {  // each batch of the group that ends at 150
    const std::string dir = (dir_.path() / ("aggregated-stop-" + std::to_string(stop))).string();
    const auto resumed = train_with_stops(dir, {stop}, aggregate);
    ASSERT_EQ(resumed.size(), reference.size());
    for (std::size_t i = 0; i < reference.size(); ++i) {
      EXPECT_TRUE(torch::equal(resumed[i], reference[i])) << "stop at " << stop << ": parameter " << i << " differs";
    }
    EXPECT_EQ(comparable_metric_lines(dir + "/metrics.jsonl"), comparable_metric_lines(straight + "/metrics.jsonl")) << stop;
  }
}

// Periodic checkpoints are written while training goes on, their parameters and optimizer
// state copied by the writer thread: each must hold exactly the state of its own batch.
TEST_F(ExactResume, PeriodicAsyncCheckpointsHoldTheStateOfTheirBatch) {
  const auto reference = train_with_stops((dir_.path() / "reference").string(), {});
  const std::string dir = (dir_.path() / "periodic").string();
  const std::vector<std::string> periodic = {"min_checkpoint_period.batches=50",
                                             "checkpoint_storage.save_trial_latest=20"};
  const auto straight = train_with_stops(dir, {}, periodic);
  for (std::size_t i = 0; i < reference.size(); ++i) EXPECT_TRUE(torch::equal(straight[i], reference[i])) << i;
  const std::string checkpoints = dir + "/checkpoints";
  for (int batches = 50; batches <= 400; batches += 50) {
    EXPECT_TRUE(std::filesystem::exists(checkpoints + "/ckpt-" + std::to_string(batches) + ".h5")) << batches;
  }
  // Resume from the one at 150, as if the run had crashed just after it.
  for (int batches = 200; batches <= 400; batches += 50) {
    std::filesystem::remove(checkpoints + "/ckpt-" + std::to_string(batches) + ".h5");
  }
  std::ofstream(checkpoints + "/latest") << "ckpt-150.h5\n";
  const auto resumed = train_with_stops(dir, {}, periodic, /*first_batch=*/150);
  // The lines the first run wrote after batch 150 were dropped and written again.
  EXPECT_EQ(comparable_metric_lines(dir + "/metrics.jsonl"), comparable_metric_lines((dir_.path() / "reference").string() + "/metrics.jsonl"));
  ASSERT_EQ(resumed.size(), reference.size());
  for (std::size_t i = 0; i < reference.size(); ++i) {
    EXPECT_TRUE(torch::equal(resumed[i], reference[i])) << "parameter " << i << " differs after resuming at 150";
  }
}

// A run that failed before its first checkpoint: the next starts afresh, and the lines the
// first wrote are dropped and written again (as a search's worker killed early in a trial
// leaves them for the worker that takes the trial over).
TEST_F(ExactResume, AFreshStartDropsWhatARunWithoutACheckpointReported) {
  const std::string reference = (dir_.path() / "reference").string(), dir = (dir_.path() / "crashed").string();
  train_with_stops(reference, {});
  train_with_stops(dir, {});  // its lines stand for those of a run that failed before a checkpoint
  std::filesystem::remove_all(dir + "/checkpoints");
  train_with_stops(dir, {});
  EXPECT_EQ(comparable_metric_lines(dir + "/metrics.jsonl"), comparable_metric_lines(reference + "/metrics.jsonl"));
}

TEST_F(ExactResume, AChangedModelOrHyperparameterIsRefused) {
  const std::string dir = (dir_.path() / "changed").string();
  train_with_stops(dir, {50});  // leaves a checkpoint at 50 and finishes
  auto run_with = [&](const std::string& override, bool allow) {
    auto src = sources(1);
    src.overrides.push_back(override);
    const core::ExperimentConfig config = core::load_experiment_config(src);
    comm::LocalCommunicator communicator;
    trainer::LoopOptions options;
    options.trial_dir = dir;
    options.experiment_seed = 1234;
    options.progress_interval_s = 0;
    options.allow_config_change = allow;
    std::vector<torch::Tensor> weights;
    try {
      trainer::run_training(config, [&](TrialContext& context) {
        return std::unique_ptr<Trial>(std::make_unique<CapturingMlp>(context, &weights));
      }, communicator, options);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_THAT(run_with("hyperparameters.learning_rate=0.1", false),
              HasSubstr("was written with other hyperparameters (learning_rate: 0.05 -> 0.1); resume with the config "
                        "that wrote it, or pass --allow-config-change"));
  EXPECT_EQ(run_with("hyperparameters.learning_rate=0.1", true), "accepted");
  EXPECT_THAT(run_with("hyperparameters.hidden=32", true),
              HasSubstr("model/0/fc1.weight is float32 [64, 32] in the checkpoint but float32 [32, 32] in the model"));
}

// Whatever the umask, the trial's files are private unless the config makes the checkpoints
// group-readable.
TEST_F(ExactResume, CheckpointModesFollowTheConfigWhateverTheUmask) {
  auto mode_of = [](const std::string& path) {
    struct stat st {};
    EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
    return st.st_mode & 0777;
  };
  const mode_t old_umask = ::umask(0);
  const std::string private_dir = (dir_.path() / "private" / "trial").string();
  train_with_stops(private_dir, {50});
  const std::string shared_dir = (dir_.path() / "shared" / "trial").string();
  train_with_stops(shared_dir, {50}, {"checkpoint_storage.group_readable=true"});
  ::umask(old_umask);

  EXPECT_EQ(mode_of(dir_.path() / "private"), 0700u) << "a parent the harness made";
  EXPECT_EQ(mode_of(private_dir), 0700u);
  EXPECT_EQ(mode_of(private_dir + "/checkpoints"), 0700u);
  EXPECT_EQ(mode_of(private_dir + "/checkpoints/ckpt-400.h5"), 0600u);
  EXPECT_EQ(mode_of(private_dir + "/checkpoints/latest"), 0600u);
  EXPECT_EQ(mode_of(private_dir + "/metrics.jsonl"), 0600u);

  EXPECT_EQ(mode_of(shared_dir), 0750u);
  EXPECT_EQ(mode_of(shared_dir + "/checkpoints"), 0750u);
  EXPECT_EQ(mode_of(shared_dir + "/checkpoints/ckpt-400.h5"), 0640u);
  EXPECT_EQ(mode_of(shared_dir + "/checkpoints/latest"), 0640u);
  EXPECT_EQ(mode_of(shared_dir + "/metrics.jsonl"), 0600u) << "only checkpoints are shared";
}

// The checkpoint read from Python (h5py, no hpctrial) into the same network defined in
// PyTorch gives the C++ model's outputs.
TEST_F(ExactResume, PythonReadsTheCheckpointIntoTheSameModel) {
  const std::string dir = (dir_.path() / "python").string();
  const auto weights = train_with_stops(dir, {});
  mlp_example::Mlp net(32, 64, 10);
  {
    torch::NoGradGuard no_grad;
    auto params = net->parameters();
    ASSERT_EQ(params.size(), weights.size());
    for (std::size_t i = 0; i < params.size(); ++i) params[i].copy_(weights[i]);
  }
  const torch::Tensor outputs = net->forward(torch::linspace(-1, 1, 4 * 32).reshape({4, 32})).flatten();
  core::RunOptions options;
  options.timeout = std::chrono::seconds(120);
  const auto r = core::run_process({"/usr/bin/python3", HPCTRIAL_SOURCE_DIR "/tests/python/mlp_outputs.py",
                                    HPCTRIAL_SOURCE_DIR "/scripts", dir + "/checkpoints/ckpt-400.h5"},
                                   options);
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.err;
  std::istringstream lines(r.out);
  std::vector<double> python;
  for (std::string line; std::getline(lines, line);) python.push_back(std::stod(line));
  ASSERT_EQ(python.size(), static_cast<std::size_t>(outputs.numel()));
  for (std::size_t i = 0; i < python.size(); ++i) {
    EXPECT_NEAR(python[i], outputs[static_cast<std::int64_t>(i)].item<double>(), 1e-5) << "output " << i;
  }
}

// The trained model exported (hpctrial checkpoint export) loads into the same network in C++ with
// torch::load, and reads in Python from the archive (torch.jit.load) and, through the Python
// reader, as a state_dict torch.load reads: each time the model's tensors, bit for bit.
TEST_F(ExactResume, TheExportedModelIsTheTrainedOneInLibTorchAndPython) {
  const std::string dir = (dir_.path() / "export").string();
  const auto weights = train_with_stops(dir, {});
  const std::string archive = dir + "/model.pt";
  const auto exported = core::run_process({HPCTRIAL_CLI, "checkpoint", "export", dir + "/checkpoints", archive});
  ASSERT_TRUE(exported.ok()) << exported.describe() << "\n" << exported.err;
  EXPECT_THAT(exported.out, testing::HasSubstr("wrote " + archive + ": 6 tensors"));
  mlp_example::Mlp net(32, 64, 10);
  torch::load(net, archive);
  const auto parameters = net->named_parameters();
  ASSERT_EQ(parameters.size(), weights.size());
  std::map<std::string, std::uint32_t> crcs;
  for (std::size_t i = 0; i < weights.size(); ++i) {
    EXPECT_TRUE(torch::equal(parameters[i].value(), weights[i])) << parameters[i].key();
    crcs[parameters[i].key()] = checkpoint::crc32c(weights[i].data_ptr(), weights[i].nbytes());
  }
  EXPECT_EQ(testing_support::exported_model_crcs(dir + "/checkpoints/ckpt-400.h5", archive, dir + "/state_dict.pt"),
            crcs);
  const auto missing = core::run_process({HPCTRIAL_CLI, "checkpoint", "export", dir + "/checkpoints", archive, "--model", "1"});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_THAT(missing.err, testing::HasSubstr("has no model 1"));
}

// The mlp trial, noting at its first batch where it starts: the batch, the weights, and whether
// its optimizer holds any state.
class FirstBatchMlp : public CapturingMlp {
 public:
  struct Start {
    std::int64_t batch = -1;
    std::vector<torch::Tensor> weights;
    bool fresh_optimizer = false;
  };
  FirstBatchMlp(TrialContext& context, std::vector<torch::Tensor>* out, Start* start)
      : CapturingMlp(context, out), context_(context), start_(start) {}
  Metrics train_batch(Batch& batch, std::int64_t epoch, std::int64_t batch_idx) override {
    if (start_->batch < 0) {
      start_->batch = batch_idx;
      for (const auto& p : model()->parameters()) start_->weights.push_back(p.detach().clone());
      start_->fresh_optimizer = context_.optimizers().at(0)->state().empty();
    }
    return CapturingMlp::train_batch(batch, epoch, batch_idx);
  }

 private:
  TrialContext& context_;
  Start* start_;
};

class FineTuning : public ExactResume {
 protected:
  // A run of 20 batches in `dir` under `overrides`: where it started.
  FirstBatchMlp::Start fine_tune(const std::string& dir, const std::vector<std::string>& overrides) {
    auto src = sources(1);
    src.overrides.push_back("searcher.max_length={batches: 20}");
    src.overrides.insert(src.overrides.end(), overrides.begin(), overrides.end());
    const core::ExperimentConfig config = core::load_experiment_config(src);
    FirstBatchMlp::Start start;
    std::vector<torch::Tensor> weights;
    comm::LocalCommunicator communicator;
    trainer::LoopOptions options;
    options.trial_dir = dir;
    options.experiment_seed = 77;  // another experiment: its own initial weights
    options.progress_interval_s = 0;
    trainer::run_training(config, [&](TrialContext& context) {
      return std::unique_ptr<Trial>(std::make_unique<FirstBatchMlp>(context, &weights, &start));
    }, communicator, options);
    return start;
  }
};

// searcher.source_checkpoint: a new experiment's trial starts from the source's weights at batch 0
// with a fresh optimizer, and its runs.jsonl names the source; an experiment directory and
// source_trial_id name the same checkpoint; a missing source or trial is a config error.
TEST_F(FineTuning, StartsFromTheSourceWeightsAtBatchZeroWithAFreshOptimizer) {
  const core::ExperimentLayout source{(dir_.path() / "source").string()};
  const core::ExperimentConfig source_config = core::load_experiment_config(sources(1));
  core::create_directories(source.dir);
  core::commit_experiment_config(source, source_config, source.dir);
  const auto trained = train_with_stops(source.trial_dir(0), {});
  const std::string file = source.trial_dir(0) + "/checkpoints/ckpt-400.h5";

  const std::string tuned = (dir_.path() / "tuned").string();
  const auto start = fine_tune(tuned, {"searcher.source_checkpoint=" + source.trial_dir(0) + "/checkpoints"});
  EXPECT_EQ(start.batch, 0);
  EXPECT_TRUE(start.fresh_optimizer);
  ASSERT_EQ(start.weights.size(), trained.size());
  for (std::size_t i = 0; i < trained.size(); ++i) EXPECT_TRUE(torch::equal(start.weights[i], trained[i])) << i;
  std::ifstream runs(tuned + "/runs.jsonl");
  std::string first;
  ASSERT_TRUE(std::getline(runs, first));
  EXPECT_EQ(nlohmann::json::parse(first).value("source_checkpoint", ""), file);

  const auto by_trial = fine_tune((dir_.path() / "by-trial").string(),
                                  {"searcher.source_checkpoint=" + source.dir, "searcher.source_trial_id=0"});
  ASSERT_EQ(by_trial.weights.size(), trained.size());
  for (std::size_t i = 0; i < trained.size(); ++i) EXPECT_TRUE(torch::equal(by_trial.weights[i], trained[i])) << i;

  const auto config_error = [&](const std::vector<std::string>& overrides) -> std::string {
    try {
      fine_tune((dir_.path() / "refused").string(), overrides);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_THAT(config_error({"searcher.source_checkpoint=" + source.dir + "/nowhere"}),
              testing::HasSubstr("searcher.source_checkpoint: " + source.dir + "/nowhere does not exist"));
  EXPECT_THAT(config_error({"searcher.source_checkpoint=" + source.dir, "searcher.source_trial_id=3"}),
              testing::HasSubstr("has no checkpoints of trial 3"));
}

std::vector<nlohmann::json> validations(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "validation") out.push_back(j);
  }
  return out;
}

using testing_support::events_in;
using testing_support::rungs_of;

// async_halving over 6 configurations of the mlp example, rungs at 8, 16 and 32 batches, the
// top half going on: `hpctrial run` is its worker. Run once straight through; run again in
// another directory, its worker killed (SIGKILL: no checkpoint, no goodbye) while it trains the
// fourth trial, then run again: the new worker takes the trial over, and the search reaches the
// same rungs with the same metrics in the same order, none twice. Then two workers at once on a
// third, and describe, --best and plot on the first.
TEST_F(MlpExample, AnAdaptiveSearchsWorkerKilledMidTrialIsTakenOverAndLosesNothing) {
  const std::string config = dir_.write("asha.yaml",
      std::string("name: asha\nentrypoint: ") + HPCTRIAL_MLP + "\nhyperparameters: {global_batch_size: 64, classes: 10, "
      "learning_rate: {type: log, base: 10, minval: -4, maxval: -1}, hidden: {type: categorical, vals: [16, 64]}}\n"
      "searcher: {name: async_halving, metric: validation_loss, max_length: {batches: 32}, num_rungs: 3, divisor: 2, "
      "max_trials: 6, max_concurrent_trials: 1}\nmin_validation_period: {batches: 1000}\n"
      "resources: {slots_per_trial: 1}\nreproducibility: {experiment_seed: 7}\ndata: {train: " + train_ +
      ", validation: " + validation_ + ", x_dataset: x, y_dataset: y}\n");
  core::RunOptions options;
  options.timeout = std::chrono::seconds(300);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  const std::string straight = (dir_.path() / "straight").string(), killed = (dir_.path() / "killed").string();
  const auto r = core::run_process({HPCTRIAL_CLI, "run", config, "--experiment", straight}, options);
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.out << r.err;
  EXPECT_THAT(r.out + r.err, HasSubstr("has nothing left for this worker"));
  const auto expected = rungs_of(straight + "/search-events.jsonl");
  EXPECT_EQ(events_in(straight + "/search-events.jsonl", "created"), 6u);
  EXPECT_GE(events_in(straight + "/search-events.jsonl", "promoted"), 3u);  // floor(6 / 2) from rung 0
  EXPECT_GE(events_in(straight + "/search-events.jsonl", "finished"), 1u);
  // A trial that arrives in the top of its rung trains on in its ranks: the chief appends the
  // rung and the promotion together, and the worker launches it no second time for that rung.
  EXPECT_THAT(r.out + r.err, HasSubstr("promoted, and trains on here"));
  std::size_t in_place = 0, launched = 0;
  {
    std::ifstream in(straight + "/search-events.jsonl");
    nlohmann::json before;
    for (std::string line; std::getline(in, line);) {
      const auto e = nlohmann::json::parse(line);
      if (e.value("event", "") == "promoted") {
        (before.value("event", "") == "rung" && before.value("trial", -1) == e.value("trial", -2) ? in_place : launched)++;
      }
      before = e;
    }
  }
  EXPECT_GE(in_place, 1u);
  const auto promoting = [](const std::string& text) {
    std::size_t n = 0;
    for (auto at = text.find("search: promoting trial"); at != std::string::npos; at = text.find("search: promoting trial", at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(promoting(r.out + r.err), launched) << "a launch for each promotion not made in place, and no other";

  // The second search's worker, killed once the fourth trial has started.
  core::SpawnOptions spawn;
  spawn.env_set = options.env_set;
  spawn.capture_output = false;
  const std::string log = killed + "/search-events.jsonl";
  const core::Child child = core::spawn_process(
      {"sh", "-c", std::string("exec '") + HPCTRIAL_CLI + "' run '" + config + "' --experiment '" + killed + "' >'" +
                       (dir_.path() / "killed.log").string() + "' 2>&1"},
      spawn);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (events_in(log, "created") < 4 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(child.pid, SIGKILL);
  int status = 0;
  ::waitpid(child.pid, &status, 0);
  ASSERT_EQ(events_in(log, "created"), 4u) << "the search did not reach its fourth trial in time";
  const auto again = core::run_process({HPCTRIAL_CLI, "run", config, "--experiment", killed}, options);
  ASSERT_TRUE(again.ok()) << again.describe() << "\n" << again.out << again.err;
  EXPECT_THAT(again.out + again.err, HasSubstr("search: taking over trial 3 to rung 0"));
  const auto resumed = rungs_of(log);
  EXPECT_EQ(resumed, expected);
  std::set<std::pair<int, int>> reached;
  for (const auto& [trial, rung, metric] : resumed) EXPECT_TRUE(reached.insert({trial, rung}).second) << trial;

  // Two workers at once on a third directory: each trial leased by one, none reaching a rung twice,
  // every trial created once and trained to its first rung.
  const std::string pair = (dir_.path() / "pair").string();
  core::SpawnOptions quiet = spawn;
  const core::Child other = core::spawn_process(
      {"sh", "-c", std::string("exec '") + HPCTRIAL_CLI + "' run '" + config + "' --experiment '" + pair + "' >'" +
                       (dir_.path() / "other.log").string() + "' 2>&1"},
      quiet);
  const auto one = core::run_process({HPCTRIAL_CLI, "run", config, "--experiment", pair}, options);
  ::waitpid(other.pid, &status, 0);
  ASSERT_TRUE(one.ok()) << one.describe() << "\n" << one.out << one.err;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the other worker: status " << status;
  EXPECT_EQ(events_in(pair + "/search-events.jsonl", "created"), 6u);
  std::set<std::pair<int, int>> paired;
  for (const auto& [trial, rung, metric] : rungs_of(pair + "/search-events.jsonl")) {
    EXPECT_TRUE(paired.insert({trial, rung}).second) << "trial " << trial << " reached rung " << rung << " twice";
  }
  for (int trial = 0; trial < 6; ++trial) EXPECT_EQ(paired.count({trial, 0}), 1u) << trial;

  // The results: the trials ranked by the metric, the best one's best checkpoint for scripts, and
  // a plot that marks the promotions and the early stops.
  core::RunOptions quick;
  const auto described = core::run_process({HPCTRIAL_CLI, "describe", straight}, quick);
  ASSERT_TRUE(described.ok()) << described.describe() << "\n" << described.err;
  EXPECT_THAT(described.out, HasSubstr("ranking by validation_loss (smaller is better):"));
  EXPECT_THAT(described.out, HasSubstr("finished"));
  EXPECT_THAT(described.out, HasSubstr(" of 3 (not promoted)"));  // the search is over
  const auto best = core::run_process({HPCTRIAL_CLI, "describe", straight, "--best"}, quick);
  ASSERT_TRUE(best.ok()) << best.describe() << "\n" << best.err;
  const std::string best_path = core::trim(best.out);
  EXPECT_TRUE(std::filesystem::exists(best_path)) << best.out;
  // The best rung metric of the search is the best trial's.
  double lowest = std::numeric_limits<double>::infinity();
  int best_trial = -1;
  for (const auto& [trial, rung, metric] : expected) {
    if (metric < lowest) lowest = metric, best_trial = trial;
  }
  EXPECT_THAT(best_path, HasSubstr("/trial-" + std::to_string(best_trial) + "/"));
  const std::string svg = (dir_.path() / "asha.svg").string();
  if (HPCTRIAL_WITH_PLOT) {
    const auto plotted = core::run_process({HPCTRIAL_CLI, "plot", straight, "-o", svg}, quick);
    ASSERT_TRUE(plotted.ok()) << plotted.describe() << "\n" << plotted.err;
    EXPECT_TRUE(std::filesystem::exists(svg));
  }
}

// A trial that throws hpctrial::InvalidHP (the mlp example, for 0 hidden units) on 2 ranks ends at
// once, is not restarted, and the search replaces it: Determined's InvalidHP. async_halving of 2
// rungs over max_trials 3, half the sample space invalid.
TEST_F(MlpExample, ATrialWithInvalidHyperparametersIsReplacedAndNotRestarted) {
  const std::string config = dir_.write("invalid.yaml",
      std::string("name: invalid\nentrypoint: ") + HPCTRIAL_MLP + "\nhyperparameters: {global_batch_size: 64, "
      "classes: 10, learning_rate: 0.01, hidden: {type: categorical, vals: [0, 16]}}\n"
      "searcher: {name: async_halving, metric: validation_loss, max_length: {batches: 8}, num_rungs: 2, divisor: 2, "
      "max_trials: 3, max_concurrent_trials: 1}\nmin_validation_period: {batches: 1000}\nmax_restarts: 3\n"
      "resources: {slots_per_trial: 2}\nreproducibility: {experiment_seed: 7}\ndata: {train: " + train_ +
      ", validation: " + validation_ + ", x_dataset: x, y_dataset: y}\n");
  core::RunOptions options;
  options.timeout = std::chrono::seconds(300);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  const std::string dir = (dir_.path() / "invalid").string();
  const auto r = core::run_process({HPCTRIAL_CLI, "run", config, "--experiment", dir}, options);
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.out << r.err;
  const std::string log = dir + "/search-events.jsonl";
  const std::size_t invalid = events_in(log, "invalid_hp");
  ASSERT_GE(invalid, 1u) << "no sample of the seed had 0 hidden units: the test tests nothing";
  // Each replaced, not counted - up to max_trials of them: with this seed 5 of the first 6
  // samples are invalid, so the last 2 are not replaced and the search ends with 6 trials.
  EXPECT_EQ(events_in(log, "created"), 3u + std::min<std::size_t>(invalid, 3));
  EXPECT_EQ(invalid, 5u) << "the seed's samples changed: the cap on replacements is no longer tested";
  EXPECT_EQ(events_in(log, "failed"), 0u);
  EXPECT_THAT(r.out + r.err, HasSubstr("the model needs at least one hidden unit"));
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    const auto e = nlohmann::json::parse(line);
    if (e.value("event", "") != "invalid_hp") continue;
    const std::string trial_dir = dir + "/trial-" + std::to_string(e.at("trial").get<int>());
    std::ifstream failures(trial_dir + "/failures.jsonl");
    std::vector<nlohmann::json> records;
    for (std::string f; std::getline(failures, f);) records.push_back(nlohmann::json::parse(f));
    ASSERT_EQ(records.size(), 1u) << trial_dir << ": restarted, though max_restarts is 3";
    EXPECT_EQ(records.front().value("exit_code", 0), core::kExitInvalidHP);
    EXPECT_THAT(records.front().value("reason", ""), HasSubstr("hyperparameters are invalid"));
  }
}

TEST_F(MlpExample, TheProgramTrainsOnTwoRanksLikeOnOne) {
  auto run = [&](int ranks, const std::string& trial_dir) {
    std::vector<std::string> argv = {HPCTRIAL_MPIRUN, "-np", std::to_string(ranks), "--oversubscribe",
                                     HPCTRIAL_MLP, "--config", HPCTRIAL_SOURCE_DIR "/examples/mlp/experiment.yaml",
                                     "--trial-dir", trial_dir, "--progress-seconds", "0"};
    for (const auto& s : sources(ranks).overrides) {
      argv.push_back("--set");
      argv.push_back(s);
    }
    core::RunOptions options;
    options.timeout = std::chrono::seconds(240);
    options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
    return core::run_process(argv, options);
  };
  const std::string one = (dir_.path() / "one").string(), two = (dir_.path() / "two").string();
  const auto r1 = run(1, one);
  ASSERT_TRUE(r1.ok()) << r1.describe() << "\n" << r1.err;
  const auto r2 = run(2, two);
  ASSERT_TRUE(r2.ok()) << r2.describe() << "\n" << r2.err;
  EXPECT_THAT(r2.err, HasSubstr("[rank 0] finished: 400 batches; metrics in " + two + "/metrics.jsonl"));

  const auto v1 = validations(one + "/metrics.jsonl");
  const auto v2 = validations(two + "/metrics.jsonl");
  ASSERT_EQ(v1.size(), 2u);
  ASSERT_EQ(v2.size(), 2u);
  EXPECT_GT(v2.back()["metrics"]["accuracy"].get<double>(), kAccuracyThreshold);
  // Same global batches in the same order: two ranks differ from one only by the rounding of
  // gradients summed in another order, which 400 momentum steps amplify to well under 2 %.
  const double loss1 = v1.back()["metrics"]["validation_loss"].get<double>();
  const double loss2 = v2.back()["metrics"]["validation_loss"].get<double>();
  EXPECT_NEAR(loss2, loss1, 0.02 * loss1);
  EXPECT_NEAR(v1.front()["metrics"]["validation_loss"].get<double>(),
              v2.front()["metrics"]["validation_loss"].get<double>(),
              0.01 * v1.front()["metrics"]["validation_loss"].get<double>());
  std::ifstream effective(two + "/effective-config.yaml");
  std::stringstream text;
  text << effective.rdbuf();
  EXPECT_THAT(text.str(), HasSubstr("experiment_seed: 1234"));
  EXPECT_THAT(text.str(), HasSubstr("slots_per_trial: 2"));
}

// experiment-adaptive.yaml under `hpctrial run` on 2 ranks: the batch grows from the base batch,
// the gain and the noise scale land in metrics.jsonl, and the model learns.
TEST_F(MlpExample, TheAdaptiveConfigGrowsTheBatchAndLearns) {
  const std::string experiment = (dir_.path() / "adaptive").string();
  core::RunOptions options;
  options.timeout = std::chrono::seconds(300);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  const auto r = core::run_process({HPCTRIAL_CLI, "run", HPCTRIAL_SOURCE_DIR "/examples/mlp/experiment-adaptive.yaml",
                                    "--set", std::string("entrypoint=") + HPCTRIAL_MLP, "--set", "data.train=" + train_,
                                    "--set", "data.validation=" + validation_, "--experiment", experiment,
                                    "--oversubscribe"},
                                   options);
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.out << r.err;
  std::ifstream in(experiment + "/trial-0/metrics.jsonl");
  double largest = 0, gain = 0, accuracy = 0;
  bool noise = false;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] == "validation") accuracy = j["metrics"]["accuracy"].get<double>();
    if (j["kind"] != "training") continue;
    largest = std::max(largest, j["metrics"]["adaptive_batch_size"].get<double>());
    gain = std::max(gain, j["metrics"]["adaptive_gain"].get<double>());
    noise = noise || j["metrics"].contains("adaptive_noise_scale");
  }
  // Every decision the chief logs: the first one, once the gradient noise is measured, always
  // tries a larger batch; later ones follow the measured step times, and on a loaded machine may
  // return to the base batch before the next training report.
  const std::string log = r.out + r.err;
  const std::regex decision(R"(adaptive batch: (\d+) records a step .*; gain ([0-9.]+))");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), decision); it != std::sregex_iterator(); ++it) {
    largest = std::max(largest, std::stod((*it)[1]));
    gain = std::max(gain, std::stod((*it)[2]));
  }
  std::printf("[ measured ] adaptive mlp: largest batch %.0f, largest gain %.3f, final accuracy %.4f\n", largest, gain,
              accuracy);
  EXPECT_GT(largest, 64.0) << "the batch never grew";
  EXPECT_GT(gain, 1.0);
  EXPECT_TRUE(noise);
  EXPECT_GT(accuracy, kAccuracyThreshold);
  std::ifstream runs(experiment + "/trial-0/runs.jsonl");
  std::string first;
  ASSERT_TRUE(std::getline(runs, first));
  EXPECT_EQ(nlohmann::json::parse(first)["ranks"], 2);
}

TEST_F(MlpExample, AWrongDataPathIsAClearErrorFromTheProgram) {
  core::RunOptions options;
  options.timeout = std::chrono::seconds(60);
  const auto r = core::run_process({HPCTRIAL_MLP, "--config", HPCTRIAL_SOURCE_DIR "/examples/mlp/experiment.yaml",
                                    "--set", "data.train=/nonexistent/train.h5", "--trial-dir",
                                    (dir_.path() / "bad").string()},
                                   options);
  EXPECT_EQ(r.exit_code, 2) << r.describe();
  EXPECT_THAT(r.err, HasSubstr("data file /nonexistent/train.h5 cannot be opened as HDF5"));
}

TEST_F(MlpExample, SigusrToMpirunStopsEveryRankAfterTheSameBatch) {
  // The signal goes to mpirun once the chief has written its first metrics, which it does after a
  // collective with the other rank: both are training, their stop handlers in place. (A fixed
  // delay raced with start-up on a slow machine: a rank not yet started dies of the signal.)
  const std::string trial_dir = (dir_.path() / "stopped").string();
  std::string command = "\"$0\" \"$@\" & job=$!; for _ in $(seq 600); do [ -s '" + trial_dir +
                        "/metrics.jsonl' ] && break; sleep 0.1; done; kill -USR2 $job; wait $job";
  std::vector<std::string> argv = {"bash", "-c", command, HPCTRIAL_MPIRUN, "-np", "2",
                                   HPCTRIAL_MLP, "--config", HPCTRIAL_SOURCE_DIR "/examples/mlp/experiment.yaml",
                                   "--trial-dir", trial_dir, "--progress-seconds", "0",
                                   "--set", "searcher.max_length.batches=10000000"};
  for (const auto& s : sources(2).overrides) {
    argv.push_back("--set");
    argv.push_back(s);
  }
  core::RunOptions options;
  options.timeout = std::chrono::seconds(120);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  const auto r = core::run_process(argv, options);
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 75) << r.describe() << "\n" << r.err;
  const std::regex stopped(R"(\[rank ([01])\] stop requested: stopping after batch ([0-9]+) of 10000000)");
  std::set<std::string> batches;
  int ranks = 0;
  for (std::sregex_iterator it(r.err.begin(), r.err.end(), stopped), end; it != end; ++it, ++ranks) {
    batches.insert((*it)[2]);
  }
  EXPECT_EQ(ranks, 2) << r.err;
  EXPECT_EQ(batches.size(), 1u) << "the ranks stopped after different batches:\n" << r.err;
  EXPECT_THAT(r.err, HasSubstr("[rank 0] stopped after " + *batches.begin() + " batches; checkpoint "));
  EXPECT_THAT(r.err, HasSubstr("/stopped/checkpoints/ckpt-" + *batches.begin() + ".h5 is durable"));
}

TEST(TrialProgram, CommandLineHelpAndMistakes) {
  core::RunOptions options;
  options.timeout = std::chrono::seconds(60);
  const auto help = core::run_process({HPCTRIAL_MLP, "--help"}, options);
  EXPECT_EQ(help.exit_code, 0) << help.err;
  EXPECT_THAT(help.out, HasSubstr("--config EXP.yaml"));
  EXPECT_THAT(help.out, HasSubstr("--trial-dir"));
  const auto unknown = core::run_process({HPCTRIAL_MLP, "--frobnicate"}, options);
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_THAT(unknown.err, HasSubstr("unrecognised option '--frobnicate' (see --help)"));
  const auto no_config = core::run_process({HPCTRIAL_MLP}, options);
  EXPECT_EQ(no_config.exit_code, 2);
  EXPECT_THAT(no_config.err, HasSubstr("no experiment config: give --config EXP.yaml"));
}

core::RunResult run_worker(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {HPCTRIAL_WORKER};
  argv.insert(argv.end(), args.begin(), args.end());
  core::RunOptions options;
  options.timeout = std::chrono::seconds(120);
  options.working_dir = HPCTRIAL_MLP_LIBRARY_DIR;  // where libmlp_trial.so is
  return core::run_process(argv, options);
}

TEST_F(MlpExample, TheWorkerRunsTheTrialFromItsLibrary) {
  const std::string trial_dir = (dir_.path() / "library").string();
  const auto r = run_worker({"--config", HPCTRIAL_SOURCE_DIR "/examples/mlp/experiment-library.yaml", "--set",
                             "data.train=" + train_, "--set", "data.validation=" + validation_, "--trial-dir",
                             trial_dir, "--progress-seconds", "0"});
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.err;
  const auto v = validations(trial_dir + "/metrics.jsonl");
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v.back()["batches"], 200);
  EXPECT_GT(v.back()["metrics"]["accuracy"].get<double>(), kAccuracyThreshold);
}

// A trial library is frozen as a program is: hpctrial-worker loads the experiment's copy.
TEST_F(MlpExample, ATrialLibraryIsFrozenAndTheWorkerLoadsTheCopy) {
  const std::string experiment = (dir_.path() / "frozen-library").string();
  core::RunOptions options;
  options.timeout = std::chrono::seconds(300);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  const auto r = core::run_process(
      {HPCTRIAL_CLI, "run", HPCTRIAL_SOURCE_DIR "/examples/mlp/experiment-library.yaml", "--experiment", experiment,
       "--set", "entrypoint=" HPCTRIAL_MLP_LIBRARY_DIR "/libmlp_trial.so:mlp_example::MlpTrial", "--set",
       "data.train=" + train_, "--set", "data.validation=" + validation_, "--set", "searcher.max_length={batches: 50}"},
      options);
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.out << r.err;
  const auto state = nlohmann::json::parse(testing_support::read_file(experiment + "/experiment.json"));
  const std::string digest = state["code"]["digest"];
  EXPECT_EQ(state["code"]["source"], HPCTRIAL_MLP_LIBRARY_DIR "/libmlp_trial.so");
  EXPECT_EQ(state["code"]["path"], experiment + "/code/" + digest + "/libmlp_trial.so");
  EXPECT_EQ(digest, core::file_sha256(HPCTRIAL_MLP_LIBRARY_DIR "/libmlp_trial.so"));
  EXPECT_THAT(testing_support::read_file(experiment + "/experiment.yaml"),
              HasSubstr(experiment + "/code/" + digest + "/libmlp_trial.so:mlp_example::MlpTrial"));
  EXPECT_THAT(testing_support::read_file(experiment + "/trial-0/runs.jsonl"), HasSubstr("\"code\":\"" + digest));
}

TEST_F(MlpExample, TheWorkerExplainsWhatItCannotRun) {
  const std::string config = HPCTRIAL_SOURCE_DIR "/examples/mlp/experiment-library.yaml";
  const std::string dir = (dir_.path() / "bad").string();
  const auto unknown = run_worker({"--config", config, "--set", "entrypoint=./libmlp_trial.so:Nope", "--trial-dir", dir});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_THAT(unknown.err, HasSubstr("libmlp_trial.so has no trial 'Nope' (it has: mlp_example::MlpTrial)"));
  const auto missing = run_worker({"--config", config, "--set", "entrypoint=./libnothere.so:T", "--trial-dir", dir});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_THAT(missing.err, HasSubstr("cannot load the trial library "));
  EXPECT_THAT(missing.err, HasSubstr("libnothere.so: cannot open shared object file"));
  const auto program = run_worker({"--config", HPCTRIAL_SOURCE_DIR "/examples/mlp/experiment.yaml", "--trial-dir", dir});
  EXPECT_EQ(program.exit_code, 2);
  EXPECT_THAT(program.err, HasSubstr("entrypoint: './mlp' is a program; run it directly"));
  const auto plain = run_worker({"--config", config, "--set", "entrypoint=" HPCTRIAL_PLAIN_LIBRARY ":T", "--trial-dir", dir});
  EXPECT_EQ(plain.exit_code, 2);
  EXPECT_THAT(plain.err, HasSubstr("exports no trials; add HPCTRIAL_EXPORT_TRIAL(T) to its source"));
}

TEST(CnnExample, TheProgramLearnsOnTwoRanks) {
  TempDir dir;
  cnn_example::ImageSpec spec;
  const std::string train = (dir.path() / "train.h5").string();
  const std::string validation = (dir.path() / "validation.h5").string();
  cnn_example::write_synthetic_images(train, spec);
  spec.samples = 1024;
  spec.seed = 2;
  cnn_example::write_synthetic_images(validation, spec);
  const std::string trial_dir = (dir.path() / "run").string();
  core::RunOptions options;
  options.timeout = std::chrono::seconds(240);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  const auto r = core::run_process({HPCTRIAL_MPIRUN, "-np", "2", "--oversubscribe", HPCTRIAL_CNN, "--config",
                                    HPCTRIAL_SOURCE_DIR "/examples/cnn/experiment.yaml", "--trial-dir", trial_dir,
                                    "--set", "data.train=" + train, "--set", "data.validation=" + validation,
                                    "--progress-seconds", "0"},
                                   options);
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.err;
  const auto v = validations(trial_dir + "/metrics.jsonl");
  ASSERT_EQ(v.size(), 2u);
  EXPECT_GT(v.back()["metrics"]["accuracy"].get<double>(), 0.95);  // chance is 1/8
}

// The engine example on 2 ranks: a ModelEngine accumulating 2 micro-batches of 16 a step learns
// the mlp example's data with ZeRO-2 and bf16; its checkpoint resumes on 1 rank; a ZeRO stage that does not exist
// and batch sizes that do not divide are refused before training.
TEST_F(MlpExample, TheEngineExampleLearnsOnTwoRanks) {
  auto run = [&](const std::string& trial_dir, const std::vector<std::string>& more, int ranks = 2) {
    std::vector<std::string> argv = {HPCTRIAL_MPIRUN, "-np", std::to_string(ranks), "--oversubscribe", HPCTRIAL_ENGINE, "--config",
                                     HPCTRIAL_SOURCE_DIR "/examples/engine/experiment.yaml", "--trial-dir", trial_dir,
                                     "--set", "data.train=" + train_, "--set", "data.validation=" + validation_,
                                     "--progress-seconds", "0"};
    argv.insert(argv.end(), more.begin(), more.end());
    core::RunOptions options;
    options.timeout = std::chrono::seconds(240);
    options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
    return core::run_process(argv, options);
  };
  const std::string trial_dir = (dir_.path() / "engine").string();
  const auto r = run(trial_dir, {});
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.err;
  EXPECT_THAT(r.err, HasSubstr("engine: train_batch_size 64 = micro-batch 16 x 2 accumulation step(s) x 2 rank(s)"));
  const auto v = validations(trial_dir + "/metrics.jsonl");
  ASSERT_EQ(v.size(), 2u);
  EXPECT_GT(v.back()["metrics"]["accuracy"].get<double>(), kAccuracyThreshold);

  // ZeRO-2 (the example's stage) on 2 ranks for 100 steps, resumed on 1 rank from its checkpoint
  // (the whole optimizer state, resharded), compared within 1e-5 with a run on 2 ranks that was
  // never stopped. The resumed run keeps the micro-batch of 16 and accumulates 4 of them, as
  // DeepSpeed does on fewer ranks: it computes the same micro-batches (under bf16, each one's
  // gradient is rounded where it is computed, so the micro-batches must be the same ones) and
  // only sums them, in float32, in another order.
  // In float32 the resumed run goes on to step 200 and is compared with a stage-0 run: sharding,
  // resharding and the sum order move the weights by a few float32 ulps.
  // In bf16 it is compared one step after the resume, with a ZeRO-2 run: from then on, a weight
  // that differs by one float32 ulp rounds to another bfloat16 (2^-8 apart) once in a while, and
  // a hundred steps amplify that to 1e-4 of the weights and 1e-2 of Adam's moments, by a measure
  // that depends on the learning rate and on the CPU's bf16 kernels (AMX, AVX512-BF16 or none):
  // bf16 promises agreement until such a rounding, which one step keeps out of reach. The
  // resumed run then trains on to step 200 and must still learn.
  // `optimizer`: the Adam moments are compared too.
  const auto resume_on_one_rank = [&](const std::string& name, const std::vector<std::string>& more, int compare_at,
                                      const std::string& reference_stage, bool optimizer) {
    SCOPED_TRACE(name);
    const auto with = [&](std::vector<std::string> args) {
      args.insert(args.end(), more.begin(), more.end());
      return args;
    };
    const auto batches = [](int n) { return "searcher.max_length.batches=" + std::to_string(n); };
    const std::vector<std::string> one_rank = {"--set", "resources.slots_per_trial=1", "--set",
                                               "engine.gradient_accumulation_steps=4"};
    const std::string zero_dir = (dir_.path() / (name + "-zero")).string();
    const auto z1 = run(zero_dir, with({"--set", batches(100)}));
    ASSERT_TRUE(z1.ok()) << z1.describe() << "\n" << z1.err;
    std::vector<std::string> resumed_args = {"--set", batches(compare_at)};
    resumed_args.insert(resumed_args.end(), one_rank.begin(), one_rank.end());
    const auto z2 = run(zero_dir, with(resumed_args), 1);
    ASSERT_TRUE(z2.ok()) << z2.describe() << "\n" << z2.err;
    EXPECT_THAT(z2.err, HasSubstr("after 100 batches"));
    EXPECT_THAT(z2.err, HasSubstr("engine: train_batch_size 64 = micro-batch 16 x 4 accumulation step(s) x 1 rank(s)"));
    const std::string straight_dir = (dir_.path() / (name + "-straight")).string();
    const auto straight = run(straight_dir, with({"--set", batches(compare_at), "--set",
                                                  "engine.zero_optimization.stage=" + reference_stage}));
    ASSERT_TRUE(straight.ok()) << straight.describe() << "\n" << straight.err;
    const std::string at = "/checkpoints/ckpt-" + std::to_string(compare_at) + ".h5";
    const auto resumed = checkpoint::read_checkpoint(zero_dir + at);
    const auto reference = checkpoint::read_checkpoint(straight_dir + at);
    int compared = 0;
    for (const auto& d : reference.datasets) {
      const bool moment = optimizer && d.name.rfind("optimizer/0/state/", 0) == 0;
      if (d.name.rfind("model/", 0) != 0 && !moment) continue;
      if (d.dtype != checkpoint::DType::kFloat32) continue;
      const auto* other = resumed.find(d.name);
      ASSERT_NE(other, nullptr) << d.name;
      const auto count = static_cast<std::int64_t>(d.nbytes() / 4);
      const auto a = torch::from_blob(const_cast<void*>(d.data->data()), {count}, torch::kFloat32);
      const auto b = torch::from_blob(const_cast<void*>(other->data->data()), {count}, torch::kFloat32);
      const double scale = std::max(1e-12, a.abs().max().item<double>());
      const double difference = (a - b).abs().max().item<double>() / scale;
      std::printf("[ measured ] %s: %s resumed on 1 rank, max relative difference %.3g at step %d\n", name.c_str(),
                  d.name.c_str(), difference, compare_at);
      EXPECT_LE(difference, 1e-5) << d.name;
      ++compared;
    }
    EXPECT_EQ(compared, optimizer ? 6 + 12 : 6);  // 3 layers' weights and biases (and their two moments)
    if (compare_at < 200) {
      std::vector<std::string> on = {"--set", batches(200)};
      on.insert(on.end(), one_rank.begin(), one_rank.end());
      const auto z3 = run(zero_dir, with(on), 1);
      ASSERT_TRUE(z3.ok()) << z3.describe() << "\n" << z3.err;
      const auto v = validations(zero_dir + "/metrics.jsonl");
      ASSERT_FALSE(v.empty());
      EXPECT_EQ(v.back()["batches"].get<int>(), 200);
      EXPECT_GT(v.back()["metrics"]["accuracy"].get<double>(), kAccuracyThreshold);
    }
  };
  resume_on_one_rank("float32", {"--set", "engine.bf16.enabled=false"}, 200, "0", true);
  resume_on_one_rank("bf16", {}, 101, "2", true);

  const auto refused = run((dir_.path() / "stage4").string(), {"--set", "engine.zero_optimization.stage=4"});
  EXPECT_EQ(refused.exit_code, 2) << refused.describe();
  EXPECT_THAT(refused.err, HasSubstr("engine.zero_optimization.stage: must be at most 3, got \"4\""));
  const auto uneven = run((dir_.path() / "uneven").string(), {"--set", "hyperparameters.global_batch_size=60",
                                                              "--set", "engine.gradient_accumulation_steps=4"});
  EXPECT_EQ(uneven.exit_code, 2) << uneven.describe();
  EXPECT_THAT(uneven.err, HasSubstr("is not a multiple of gradient_accumulation_steps (4) x ranks (2) = 8"));
}

// The pipeline example: its classifier in 2 stages on 2 ranks learns the mlp example's data; under
// `hpctrial run`, a rank of either stage killed in the middle of the schedule ends the run at once
// with the record of that rank.
TEST_F(MlpExample, ThePipelineExampleLearnsAndAKilledStageEndsTheRunNamingIt) {
  core::RunOptions options;
  options.timeout = std::chrono::seconds(240);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  const std::string trial_dir = (dir_.path() / "pipeline").string();
  const auto r = core::run_process({HPCTRIAL_MPIRUN, "-np", "2", "--oversubscribe", HPCTRIAL_PIPELINE, "--config",
                                    HPCTRIAL_SOURCE_DIR "/examples/pipeline/experiment.yaml", "--trial-dir", trial_dir,
                                    "--set", "data.train=" + train_, "--set", "data.validation=" + validation_,
                                    "--progress-seconds", "0"},
                                   options);
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.err;
  EXPECT_THAT(r.err, HasSubstr("engine: train_batch_size 64 = micro-batch 16 x 4 accumulation step(s) x 1 replica(s) "
                               "of 2 pipeline stages"));
  const auto v = validations(trial_dir + "/metrics.jsonl");
  ASSERT_EQ(v.size(), 2u);
  // Chance is ln(10) = 2.3.
  EXPECT_LT(v.back()["metrics"]["validation_loss"].get<double>(), 0.5);

  for (const int rank : {0, 1}) {
    const std::string fault = "rank" + std::to_string(rank) + ":step40:batch:sigkill";
    const std::string experiment = (dir_.path() / ("killed-" + std::to_string(rank))).string();
    core::RunOptions killing = options;
    killing.env_set.emplace_back("HPCTRIAL_FAULT", fault);
    const auto k = core::run_process({HPCTRIAL_CLI, "run", HPCTRIAL_SOURCE_DIR "/examples/pipeline/experiment.yaml",
                                      "--set", std::string("entrypoint=") + HPCTRIAL_PIPELINE, "--set",
                                      "data.train=" + train_, "--set", "data.validation=" + validation_, "--set",
                                      "max_restarts=0", "--experiment", experiment, "--oversubscribe"},
                                     killing);
    const std::string out = k.out + k.err;
    EXPECT_NE(k.exit_code, 0) << out;
    EXPECT_FALSE(k.timed_out) << out;
    EXPECT_THAT(out, HasSubstr("trial 0 failed: rank " + std::to_string(rank) + " ")) << out;
    std::ifstream in(experiment + "/trial-0/failures.jsonl");
    std::string line;
    ASSERT_TRUE(std::getline(in, line)) << out;
    const auto record = nlohmann::json::parse(line);
    EXPECT_EQ(record.value("rank", -1), rank) << line;
    EXPECT_EQ(record.value("signal", 0), SIGKILL) << line;
    EXPECT_THAT(record.value("reason", ""), HasSubstr("was killed by signal 9")) << line;
  }
}

// The engine example (ZeRO-2) under `hpctrial run`, its periodic checkpoints written by every
// rank while training goes on: rank 1 is killed half way through writing its shard of the
// checkpoint at batch 100, then the chief half way through its shard at batch 150 of the next
// attempt. Each half-written file is never taken for a checkpoint: the trial restarts from the
// one before (batch 50, then 100) and ends bitwise equal to an uninterrupted run.
TEST_F(MlpExample, TheEngineExampleKilledWhileWritingShardsResumesFromTheCheckpointBefore) {
  core::RunOptions options;
  options.timeout = std::chrono::seconds(400);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  auto run = [&](const std::string& experiment) {
    return core::run_process({HPCTRIAL_CLI, "run", HPCTRIAL_SOURCE_DIR "/examples/engine/experiment.yaml", "--set",
                              std::string("entrypoint=") + HPCTRIAL_ENGINE, "--set", "data.train=" + train_, "--set",
                              "data.validation=" + validation_, "--set", "engine.bf16.enabled=false", "--set",
                              "searcher.max_length.batches=200", "--set", "min_checkpoint_period.batches=50", "--set",
                              "checkpoint_storage.save_trial_latest=2", "--experiment", experiment, "--oversubscribe"},
                             options);
  };
  const std::string straight = (dir_.path() / "straight").string();
  const auto r = run(straight);
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.out << r.err;
  options.env_set.emplace_back("HPCTRIAL_FAULT", "rank1:step100:restart0:shards:sigkill,rank0:step150:restart1:shards:sigkill");
  const std::string killed = (dir_.path() / "killed").string();
  const auto k = run(killed);
  const std::string out = k.out + k.err;
  ASSERT_TRUE(k.ok()) << k.describe() << "\n" << out;
  EXPECT_THAT(out, HasSubstr("injected fault rank1:step100:restart0:shards:sigkill on rank 1 at step 100"));
  EXPECT_THAT(out, HasSubstr("injected fault rank0:step150:restart1:shards:sigkill on rank 0 at step 150"));
  EXPECT_THAT(out, HasSubstr("resumed from " + killed + "/trial-0/checkpoints/ckpt-50.h5 after 50 batches (restart 1)"));
  EXPECT_THAT(out, HasSubstr("resumed from " + killed + "/trial-0/checkpoints/ckpt-100.h5 after 100 batches (restart 2)"));
  testing_support::expect_same_weights(straight + "/trial-0/checkpoints/ckpt-200.h5",
                                       killed + "/trial-0/checkpoints/ckpt-200.h5");
  for (const auto& entry : std::filesystem::directory_iterator(killed + "/trial-0/checkpoints")) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
  }
}

// A rank whose shard write never ends (a hung filesystem) cannot hang the job: training goes on
// while the shard is in flight, the next checkpoint waits for it, and the others' watchdog ends
// the run within the collective timeout, naming the rank; the checkpoint it was writing is never
// published.
TEST_F(MlpExample, AShardWriteThatNeverEndsEndsTheRunNamingTheRank) {
  core::RunOptions options;
  options.timeout = std::chrono::seconds(300);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
                     {"HPCTRIAL_FAULT", "rank1:step100:shards:hang"}};
  const std::string experiment = (dir_.path() / "hung").string();
  const auto started = std::chrono::steady_clock::now();
  const auto r = core::run_process(
      {HPCTRIAL_CLI, "run", HPCTRIAL_SOURCE_DIR "/examples/engine/experiment.yaml", "--set",
       std::string("entrypoint=") + HPCTRIAL_ENGINE, "--set", "data.train=" + train_, "--set",
       "data.validation=" + validation_, "--set", "engine.bf16.enabled=false", "--set",
       "searcher.max_length.batches=200", "--set", "min_checkpoint_period.batches=50", "--set",
       "optimizations.collective_timeout=3s", "--set", "max_restarts=0", "--experiment", experiment,
       "--oversubscribe"},
      options);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const std::string out = r.out + r.err;
  std::printf("[ measured ] a shard write hung on rank 1: hpctrial run ended after %.1f s\n", seconds);
  EXPECT_NE(r.exit_code, 0) << out;
  EXPECT_FALSE(r.timed_out) << out;
  EXPECT_THAT(out, HasSubstr("injected fault rank1:step100:shards:hang on rank 1 at step 100"));
  EXPECT_THAT(out, testing::ContainsRegex("rank 1[^\n]*(stopped answering|did not arrive|not arrive)")) << out;
  const std::string checkpoints = experiment + "/trial-0/checkpoints";
  EXPECT_TRUE(std::filesystem::exists(checkpoints + "/ckpt-50.h5"));
  EXPECT_FALSE(std::filesystem::exists(checkpoints + "/ckpt-100.h5"));
}

// The sequence example's grid under `hpctrial run`: trial 0 reaches its target accuracy and ends
// itself (set_stop_requested) before max_length, complete; the grid goes on with trial 1, which
// trains its full length. Both learn from padded, named batches.
TEST(SequenceExample, AGridGoesOnAfterATrialEndsItself) {
  TempDir dir;
  const std::string experiment = (dir.path() / "exp").string();
  core::RunOptions options;
  options.timeout = std::chrono::seconds(400);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  const auto r = core::run_process({HPCTRIAL_CLI, "run", HPCTRIAL_SOURCE_DIR "/examples/sequence/experiment-grid.yaml",
                                    "--set", std::string("entrypoint=") + HPCTRIAL_SEQUENCE, "--experiment", experiment,
                                    "--oversubscribe"},
                                   options);
  const std::string out = r.out + r.err;
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << out;
  EXPECT_THAT(out, HasSubstr("sequence: trial 0 of experiment sequence-grid (" + experiment + ")"));
  EXPECT_THAT(out, HasSubstr("the trial asked to stop (set_stop_requested)"));
  EXPECT_THAT(out, HasSubstr("trial 0 finished"));
  EXPECT_THAT(out, HasSubstr("trial 1 finished"));
  const auto first = validations(experiment + "/trial-0/metrics.jsonl");
  const auto second = validations(experiment + "/trial-1/metrics.jsonl");
  ASSERT_FALSE(first.empty());
  ASSERT_FALSE(second.empty());
  EXPECT_GE(first.back()["metrics"]["accuracy"].get<double>(), 0.9);
  EXPECT_LT(first.back()["batches"].get<std::int64_t>(), 200) << "trial 0 did not end itself";
  EXPECT_EQ(second.back()["batches"].get<std::int64_t>(), 200);
  EXPECT_GE(second.back()["metrics"]["accuracy"].get<double>(), 0.9);  // chance is 0.5
  // Ended complete: running the grid again trains nothing more in either trial.
  const auto again = core::run_process({HPCTRIAL_CLI, "run", HPCTRIAL_SOURCE_DIR "/examples/sequence/experiment-grid.yaml",
                                        "--set", std::string("entrypoint=") + HPCTRIAL_SEQUENCE, "--experiment",
                                        experiment, "--oversubscribe"},
                                       options);
  ASSERT_TRUE(again.ok()) << again.describe() << "\n" << again.out << again.err;
  EXPECT_EQ(validations(experiment + "/trial-0/metrics.jsonl").size(), first.size());
}

// The training data as a stream on 2 ranks: rank 1 is killed at batch 130, then the chief at
// batch 170 of the next attempt; each time the trial restarts from the checkpoint at batch 100 -
// each rank's stream part way through a pass - and it ends with the metrics of an uninterrupted
// run.
TEST(SequenceExample, AStreamRestartedFromACheckpointTrainsAsOneRun) {
  TempDir dir;
  core::RunOptions options;
  options.timeout = std::chrono::seconds(400);
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  auto run = [&](const std::string& experiment) {
    return core::run_process({HPCTRIAL_CLI, "run", HPCTRIAL_SOURCE_DIR "/examples/sequence/experiment-stream.yaml",
                              "--set", std::string("entrypoint=") + HPCTRIAL_SEQUENCE, "--set",
                              "min_checkpoint_period.batches=100", "--set", "checkpoint_storage.save_trial_latest=2",
                              "--set", "reproducibility.experiment_seed=5", "--experiment", experiment, "--oversubscribe"},
                             options);
  };
  const std::string straight = (dir.path() / "straight").string();
  const auto r = run(straight);
  ASSERT_TRUE(r.ok()) << r.describe() << "\n" << r.out << r.err;
  options.env_set.emplace_back("HPCTRIAL_FAULT", "rank1:step130:restart0:sigkill,rank0:step170:restart1:sigkill");
  const std::string killed = (dir.path() / "killed").string();
  const auto k = run(killed);
  ASSERT_TRUE(k.ok()) << k.describe() << "\n" << k.out << k.err;
  EXPECT_THAT(k.out + k.err, HasSubstr("resumed from " + killed + "/trial-0/checkpoints/ckpt-100.h5 after 100 batches (restart 2)"));
  // 100 batches of 32 samples a rank, from passes of 1024: pass 3, 128 samples in.
  const auto contents = checkpoint::read_checkpoint(killed + "/trial-0/checkpoints/ckpt-100.h5");
  EXPECT_EQ(nlohmann::json::parse(contents.at("progress", "ckpt-100.h5").text())["stream_positions"],
            nlohmann::json::parse(R"([{"pass": 3, "offset": 128}, {"pass": 3, "offset": 128}])"));
  const auto expected = comparable_metric_lines(straight + "/trial-0/metrics.jsonl");
  EXPECT_FALSE(expected.empty());
  EXPECT_EQ(comparable_metric_lines(killed + "/trial-0/metrics.jsonl"), expected);
  EXPECT_GE(validations(straight + "/trial-0/metrics.jsonl").back()["metrics"]["accuracy"].get<double>(), 0.9);
}

}  // namespace
}  // namespace hpctrial
