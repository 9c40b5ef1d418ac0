// Batch inference as users run it: `hpctrial run` of an experiment with `inference:` over the mlp
// example's validation set, with the weights of a trained mlp experiment, on 2 ranks. A stop
// (SIGUSR2 to one rank) or a killed rank, on the chief and on the last rank, ends in the same
// result file, bitwise, as an uninterrupted run, each record predicted by exactly one run.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "../support/inference_files.h"
#include "../support/read_file.h"
#include "../support/temp_dir.h"
#include "hpctrial/checkpoint/format.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/trainer.h"
#include "mlp_trial.h"
#include "synthetic_data.h"

namespace hpctrial {
namespace {

using testing::HasSubstr;
using testing_support::TempDir;

constexpr std::int64_t kRecords = 2048;  // the validation set's

class BatchInference : public testing::Test {
 protected:
  // One trained mlp experiment and one uninterrupted inference over it, for every test.
  static void SetUpTestSuite() {
    shared_ = std::make_unique<TempDir>();
    mlp_example::SyntheticSpec spec;
    mlp_example::write_synthetic_dataset((shared_->path() / "train.h5").string(), spec);
    spec.samples = kRecords;
    spec.seed = 2;
    mlp_example::write_synthetic_dataset((shared_->path() / "validation.h5").string(), spec);
    const std::string train = shared_->write(
        "train.yaml", "name: mlp\nentrypoint: " HPCTRIAL_MLP "\n"
                      "hyperparameters: {global_batch_size: 64, learning_rate: 0.05, hidden: 64, classes: 10}\n"
                      "searcher: {name: single, metric: validation_loss, max_length: {batches: 300}}\n"
                      "resources: {slots_per_trial: 2}\nreproducibility: {experiment_seed: 1234}\n" +
                          data_section());
    const auto trained = hpctrial_run(train, source_dir());
    ASSERT_EQ(trained.exit_code, 0) << trained.err;
    const auto reference = hpctrial_run(inference_config(*shared_, "reference"), reference_dir());
    ASSERT_EQ(reference.exit_code, 0) << reference.err;
  }
  static void TearDownTestSuite() { shared_.reset(); }

  static std::string data_section() {
    return "data: {train: " + (shared_->path() / "train.h5").string() +
           ", validation: " + (shared_->path() / "validation.h5").string() + "}\n";
  }
  static std::string source_dir() { return (shared_->path() / "mlp").string(); }
  static std::string reference_dir() { return (shared_->path() / "reference").string(); }
  static std::string inference_config(const TempDir& dir, const std::string& name, const std::string& extra = "") {
    return dir.write(name + ".yaml", "name: " + name + "\nentrypoint: " HPCTRIAL_MLP "\n"
                                     "inference: {checkpoint: " + source_dir() + ", trial_id: 0, batch_size: 64" +
                                         extra + "}\nresources: {slots_per_trial: 2}\n" + data_section());
  }
  static core::RunResult hpctrial_run(const std::string& config, const std::string& experiment,
                                      const std::string& fault = "") {
    core::RunOptions options;
    options.timeout = std::chrono::seconds(240);
    options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
    if (!fault.empty()) options.env_set.emplace_back("HPCTRIAL_FAULT", fault);
    return core::run_process({HPCTRIAL_CLI, "run", config, "--experiment", experiment, "--oversubscribe"}, options);
  }

  static std::string predictions(const std::string& experiment) { return experiment + "/trial-0/predictions.h5"; }
  static nlohmann::json progress(const std::string& experiment) {
    return nlohmann::json::parse(testing_support::read_file(experiment + "/trial-0/inference-progress.json"));
  }
  // Where each run of the trial started: its first record.
  static std::vector<std::int64_t> run_starts(const std::string& experiment) {
    std::vector<std::int64_t> starts;
    std::ifstream in(experiment + "/trial-0/runs.jsonl");
    for (std::string line; std::getline(in, line);) {
      starts.push_back(nlohmann::json::parse(line).at("inference").at("from_record").get<std::int64_t>());
    }
    return starts;
  }
  // The result file equals the uninterrupted run's, dataset by dataset, byte by byte (and reads
  // whole: every CRC checked).
  static void expect_same_as_reference(const std::string& experiment) {
    testing_support::expect_same_predictions(predictions(experiment), predictions(reference_dir()));
  }

  static std::unique_ptr<TempDir> shared_;
  TempDir dir_;
};

std::unique_ptr<TempDir> BatchInference::shared_;

// The result: a row per record of every output, each what the trained model gives the record
// (the trial loaded in this process, its forward over the whole set), the class right for most.
TEST_F(BatchInference, WritesTheTrainedModelsOutputForEveryRecord) {
  const checkpoint::Contents result = checkpoint::read_checkpoint(predictions(reference_dir()));
  EXPECT_EQ(result.attributes.at("kind"), "predictions");
  EXPECT_EQ(result.attributes.at("records"), std::to_string(kRecords));
  EXPECT_EQ(result.attributes.at("source_checkpoint"), source_dir() + "/trial-0/checkpoints/ckpt-300.h5");
  const checkpoint::Dataset& classes = result.at("class", "predictions");
  const checkpoint::Dataset& log_probabilities = result.at("log_probabilities", "predictions");
  EXPECT_EQ(classes.shape, (std::vector<std::int64_t>{kRecords}));
  EXPECT_EQ(log_probabilities.shape, (std::vector<std::int64_t>{kRecords, 10}));

  LoadedTrial loaded = load_trial_from_checkpoint<mlp_example::MlpTrial>(source_dir() + "/trial-0/checkpoints");
  Hdf5Dataset validation((shared_->path() / "validation.h5").string());
  std::vector<std::int64_t> all(kRecords);
  std::iota(all.begin(), all.end(), 0);
  const Batch batch = validation.get_batch(all);
  const torch::NoGradGuard no_grad;
  const torch::Tensor expected = loaded.trial<mlp_example::MlpTrial>().model()->forward(batch.data);
  const torch::Tensor written =
      torch::from_blob(const_cast<void*>(log_probabilities.data->data()), {kRecords, 10}, torch::kFloat32).clone();
  EXPECT_TRUE(torch::allclose(written, expected, 1e-5, 1e-6));
  const torch::Tensor predicted = torch::from_blob(const_cast<void*>(classes.data->data()), {kRecords}, torch::kInt64).clone();
  EXPECT_GT(predicted.eq(batch.target).to(torch::kFloat64).mean().item<double>(), 0.85);
  EXPECT_EQ(run_starts(reference_dir()), (std::vector<std::int64_t>{0}));
  EXPECT_TRUE(progress(reference_dir()).at("complete").get<bool>());

  // Started again, the complete experiment writes nothing.
  const auto again = hpctrial_run(inference_config(*shared_, "reference"), reference_dir());
  EXPECT_EQ(again.exit_code, 0) << again.err;
  EXPECT_THAT(again.err, HasSubstr("is complete already"));
  expect_same_as_reference(reference_dir());
}

class StoppedInference : public BatchInference, public testing::WithParamInterface<int> {};

// SIGUSR2 to one rank (the chief, the last rank): every rank stops at the same round with its
// rows durable (exit 75); the next run starts at the first record not predicted, and the result
// equals the uninterrupted run's.
TEST_P(StoppedInference, ResumesAtTheFirstUnpredictedRecordAndWritesEveryRowOnce) {
  const std::string experiment = (dir_.path() / "stopped").string();
  const std::string config = inference_config(dir_, "stopped", ", progress_period: {seconds: 3600}");
  const auto stopped = hpctrial_run(config, experiment, "rank" + std::to_string(GetParam()) + ":step3:usr2");
  ASSERT_EQ(stopped.exit_code, 75) << stopped.err;
  EXPECT_THAT(stopped.err, HasSubstr("injected fault"));
  const std::int64_t done = progress(experiment).at("done").get<std::int64_t>();
  EXPECT_EQ(done, 4 * 2 * 64);  // the rounds up to the one the signal came before, whole
  EXPECT_FALSE(progress(experiment).at("complete").get<bool>());
  EXPECT_FALSE(std::filesystem::exists(predictions(experiment)));

  const auto resumed = hpctrial_run(config, experiment);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_EQ(run_starts(experiment), (std::vector<std::int64_t>{0, done}));
  EXPECT_THAT(resumed.err, HasSubstr(std::to_string(kRecords - done) + " records predicted in this run"));
  expect_same_as_reference(experiment);
  const auto described = core::run_process({HPCTRIAL_CLI, "describe", experiment});
  ASSERT_TRUE(described.ok()) << described.err;
  EXPECT_THAT(described.out, HasSubstr("inference:   the weights of " + source_dir() + " (trial 0), 64 records a batch"));
  EXPECT_THAT(described.out, HasSubstr("records:     2048 of 2048 predicted, complete"));
  EXPECT_THAT(described.out, HasSubstr("predictions: " + predictions(experiment)));
  EXPECT_THAT(described.out, HasSubstr("from record " + std::to_string(done)));
  EXPECT_THAT(described.out, testing::Not(HasSubstr("ranking by")));
}

// A rank killed between progress points (the chief, the last rank): the launcher restarts the
// trial, which goes on from the last progress recorded and writes the rows after it again.
TEST_P(StoppedInference, AKilledRankRestartsFromTheLastProgress) {
  const std::string experiment = (dir_.path() / "killed").string();
  const std::string config = inference_config(dir_, "killed", ", progress_period: {batches: 2}");
  const auto run = hpctrial_run(config, experiment, "rank" + std::to_string(GetParam()) + ":step5:restart0:sigkill");
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run_starts(experiment), (std::vector<std::int64_t>{0, 4 * 2 * 64}));
  expect_same_as_reference(experiment);
}

INSTANTIATE_TEST_SUITE_P(ChiefAndLastRank, StoppedInference, testing::Values(0, 1),
                         [](const testing::TestParamInfo<int>& info) {
                           return info.param == 0 ? std::string("Chief") : std::string("LastRank");
                         });

// A damaged or lost progress record is an error naming the file, never a fresh start; the
// temporary it counts on, gone, is one too.
TEST_F(BatchInference, ADamagedOrLostProgressRecordIsAnErrorNotAFreshStart) {
  const std::string experiment = (dir_.path() / "damaged").string();
  const std::string config = inference_config(dir_, "damaged", ", progress_period: {seconds: 3600}");
  ASSERT_EQ(hpctrial_run(config, experiment, "rank1:step2:usr2").exit_code, 75);
  const std::string record = experiment + "/trial-0/inference-progress.json";
  const std::string text = testing_support::read_file(record);
  std::ofstream(record) << text.substr(0, text.size() / 2);
  const auto damaged = hpctrial_run(config, experiment);
  EXPECT_EQ(damaged.exit_code, 2);
  EXPECT_THAT(damaged.err, HasSubstr(record));

  std::ofstream(record) << text;
  const std::string temporary = nlohmann::json::parse(text).at("temporary").get<std::string>();
  std::filesystem::rename(temporary, temporary + ".moved");
  const auto lost = hpctrial_run(config, experiment);
  EXPECT_EQ(lost.exit_code, 2);
  EXPECT_THAT(lost.err, HasSubstr(temporary + ", are gone"));
  std::filesystem::rename(temporary + ".moved", temporary);
  ASSERT_EQ(hpctrial_run(config, experiment).exit_code, 0);
  expect_same_as_reference(experiment);
}

// Mistakes in the config, named where they are.
TEST_F(BatchInference, ConfigMistakesAreNamed) {
  const std::string both = dir_.write(
      "both.yaml", "name: both\nentrypoint: " HPCTRIAL_MLP "\ninference: {checkpoint: " + source_dir() +
                       "}\nsearcher: {name: single, metric: loss, max_length: {batches: 1}}\n");
  const auto refused = core::run_process({HPCTRIAL_CLI, "config", "validate", both});
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_THAT(refused.err, HasSubstr("searcher: an inference experiment (inference:) runs one trial"));
  const std::string config = dir_.write(
      "missing.yaml", "name: missing\nentrypoint: " HPCTRIAL_MLP "\ninference: {checkpoint: " + source_dir() +
                          "/nowhere}\nresources: {slots_per_trial: 2}\n" + data_section());
  const auto missing = hpctrial_run(config, (dir_.path() / "missing").string());
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_THAT(missing.err, HasSubstr("inference.checkpoint: " + source_dir() + "/nowhere does not exist"));
}

}  // namespace
}  // namespace hpctrial
