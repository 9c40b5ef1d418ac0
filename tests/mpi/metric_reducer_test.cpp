// The reference's custom reducers on 2 and 4 ranks: its ROC AUC example, a reducer without a
// name that reports several metrics, and evaluation metrics of any shape, in metrics.jsonl and
// TensorBoard.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "../support/event_files.h"
#include "linear_trial_ranks.h"
#include "mpi_test_env.h"

namespace hpctrial::trainer {
namespace metric_reducer_test {  // named: the target compiles its sources together (UNITY_BUILD)

using testing_mpi::env;
using namespace testing_trial;
using json = nlohmann::json;

std::string shared_dir(const std::string& name) { return testing_mpi::shared_dir("hpctrial-reducers", name); }

// The reducer's ROC AUC, as scikit-learn's roc_auc_score computes it: the area under the curve
// of (false positive rate, true positive rate) over the distinct thresholds, by trapezoids.
double roc_auc_by_thresholds(std::vector<std::pair<double, double>> scored) {  // (score, label)
  std::sort(scored.begin(), scored.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  double positives = 0, negatives = 0;
  for (const auto& [score, label] : scored) (label > 0.5 ? positives : negatives) += 1;
  double tp = 0, fp = 0, last_tp = 0, last_fp = 0, area = 0;
  for (std::size_t i = 0; i < scored.size(); ++i) {
    (scored[i].second > 0.5 ? tp : fp) += 1;
    if (i + 1 == scored.size() || scored[i + 1].first != scored[i].first) {  // a threshold's end
      area += (fp - last_fp) / negatives * (tp + last_tp) / 2 / positives;
      last_tp = tp;
      last_fp = fp;
    }
  }
  return area;
}

// The same area counted another way, for the test: the share of (positive, negative) pairs that
// the scores order rightly, a tie counting half (the Mann-Whitney statistic).
double roc_auc_by_pairs(const std::vector<double>& scores, const std::vector<double>& labels) {
  double right = 0, pairs = 0;
  for (std::size_t p = 0; p < scores.size(); ++p) {
    if (labels[p] < 0.5) continue;
    for (std::size_t n = 0; n < scores.size(); ++n) {
      if (labels[n] > 0.5) continue;
      pairs += 1;
      right += scores[p] > scores[n] ? 1.0 : (scores[p] == scores[n] ? 0.5 : 0.0);
    }
  }
  return right / pairs;
}

// The records' labels: the sign of the third feature, which the regression weighs least, so that
// the AUC is neither 0.5 nor 1.
torch::Tensor labels_of(const torch::Tensor& x) { return (x.select(1, 2) > 0).to(torch::kFloat64); }

// Counts of each label, as a MetricReducer reporting several metrics without a name: the counts as
// a vector, the positives' share, and how many records every rank saw.
class LabelCounts : public MetricReducer {
 public:
  void update(const torch::Tensor& labels) {
    positives_ += labels.sum().item<double>();
    records_ += static_cast<double>(labels.size(0));
  }
  void reset() override { positives_ = records_ = 0; }
  json per_slot_reduce() override { return {{"positives", positives_}, {"records", records_}}; }
  MetricValue cross_slot_reduce(const std::vector<json>& per_slot) override {
    double positives = 0, records = 0;
    json per_rank = json::array();
    for (const auto& slot : per_slot) {
      positives += slot.at("positives").get<double>();
      records += slot.at("records").get<double>();
      per_rank.push_back(slot.at("records"));
    }
    return json{{"label_counts", {records - positives, positives}},
                {"positive_share", positives / records},
                {"records_by_rank", per_rank}};
  }

 private:
  double positives_ = 0, records_ = 0;
};

// The reference's example (wrap_reducer with roc_auc_score over every rank's (y_true, y_score)),
// in C++: the AUC over the whole validation set, equal to one counted independently from the
// final weights; a reducer without a name adds its metrics; metrics of several elements are
// JSON arrays in metrics.jsonl and one scalar an element in TensorBoard.
TEST(MetricReducers, TheReferencesRocAucExampleGivesTheAucOfTheWholeValidationSet) {
  const std::string dir = shared_dir("roc-auc");
  std::shared_ptr<FunctionReducer> roc_auc;
  auto counts = std::make_shared<LabelCounts>();
  LinearTrial::Options options;
  options.samples = 60;  // validation batches of 4 on 2 ranks, 2 on 4: the ranks' shares differ
  options.setup = [&](LinearTrial& trial) {
    roc_auc = trial.context_.wrap_reducer(
        [](const std::vector<json>& values) {  // every update(), on every rank: [y_true, y_score]
          std::vector<std::pair<double, double>> scored;
          for (const auto& value : values) {
            for (std::size_t i = 0; i < value[0].size(); ++i) scored.emplace_back(value[1][i], value[0][i]);
          }
          return roc_auc_by_thresholds(std::move(scored));
        },
        "roc_auc", /*for_training=*/false);
    trial.context_.wrap_reducer(counts, std::nullopt, /*for_training=*/false);
  };
  options.reducer = ReducerSpec({{"feature_max", Reducer::kMax}, {"label_counts_by_batch", Reducer::kSum}});
  options.evaluate = [&](LinearTrial& trial, Batch& batch) -> Metrics {
    const torch::Tensor y_true = labels_of(batch.data);
    const torch::Tensor y_score = trial.model->forward(batch.data).squeeze(1);
    roc_auc->update({tensor_json(y_true), tensor_json(y_score)});
    counts->update(y_true);
    const torch::Tensor positives = y_true.sum();
    return {{"validation_loss", torch::mse_loss(trial.model->forward(batch.data), batch.target)},
            {"feature_max", std::get<0>(batch.data.max(0))},                         // shape [3]
            {"label_counts_by_batch", torch::stack({y_true.numel() - positives, positives})},  // shape [2]
            {"weight", trial.model->weight}};                                          // shape [1, 3]
  };
  std::vector<torch::Tensor> parameters;
  options.parameters_out = &parameters;
  const LoopResult result = train_on_ranks(base_yaml(4, 8), options, dir);
  if (!env().is_chief()) return;

  // The whole validation set, scored with the final weights (the last validation follows the last batch).
  torch::manual_seed(0);  // as LinearTrial makes its data
  const torch::Tensor x = torch::randn({60, 3});
  ASSERT_EQ(parameters.size(), 2u);
  const torch::Tensor scores = torch::addmm(parameters[1], x, parameters[0].t()).squeeze(1).to(torch::kFloat64);
  const torch::Tensor labels = labels_of(x);
  const std::vector<double> score_list(scores.data_ptr<double>(), scores.data_ptr<double>() + 60);
  const std::vector<double> label_list(labels.data_ptr<double>(), labels.data_ptr<double>() + 60);
  const double expected_auc = roc_auc_by_pairs(score_list, label_list);
  const double positives = labels.sum().item<double>();
  ASSERT_GT(expected_auc, 0.55);
  ASSERT_LT(expected_auc, 0.95);

  const MetricValues& m = result.last_validation;
  EXPECT_NEAR(m.at("roc_auc"), expected_auc, 1e-12);
  EXPECT_EQ(m.at("label_counts").value(), (json{60 - positives, positives}));
  EXPECT_DOUBLE_EQ(m.at("positive_share"), positives / 60);
  EXPECT_EQ(m.at("records_by_rank").value().size(), static_cast<std::size_t>(env().size()));
  EXPECT_EQ(m.at("label_counts_by_batch").value(), m.at("label_counts").value()) << "summed element by element";
  const torch::Tensor feature_max = std::get<0>(x.max(0)).to(torch::kFloat64);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(m.at("feature_max").value()[i].get<double>(), feature_max[i].item<double>());
  for (int i = 0; i < 3; ++i) {
    EXPECT_NEAR(m.at("weight").value()[0][i].get<double>(), parameters[0][0][i].item<double>(), 1e-7) << "the mean of equal values";
  }

  // metrics.jsonl: the arrays as arrays; TensorBoard: one scalar an element.
  json line;
  std::ifstream in(dir + "/metrics.jsonl");
  for (std::string text; std::getline(in, text);) {
    const json j = json::parse(text);
    if (j["kind"] == "validation") line = j;
  }
  ASSERT_TRUE(line.is_object());
  EXPECT_EQ(line["metrics"]["label_counts"], (json{60 - positives, positives}));
  EXPECT_TRUE(line["metrics"]["weight"].is_array() && line["metrics"]["weight"][0].size() == 3u) << line.dump();
  EXPECT_NEAR(line["metrics"]["roc_auc"].get<double>(), expected_auc, 1e-12);
  const auto read = testing_support::read_events(testing_support::event_files(dir + "/tensorboard"));
  ASSERT_TRUE(read.ok) << read.error;
  const auto negatives_scalar = testing_support::scalars(read.events, "validation/label_counts/0");
  ASSERT_EQ(negatives_scalar.size(), 1u);
  EXPECT_EQ(negatives_scalar[0], std::make_pair(std::int64_t{4}, 60 - positives));
  EXPECT_EQ(testing_support::scalars(read.events, "validation/weight/0/2").size(), 1u);
  EXPECT_EQ(testing_support::scalars(read.events, "validation/records_by_rank/" + std::to_string(env().size() - 1)).size(), 1u);
  EXPECT_TRUE(testing_support::scalars(read.events, "validation/label_counts").empty()) << "no scalar for the vector itself";
  std::filesystem::remove_all(dir);
}

// What a reducer's cross_slot_reduce may not return, refused on every rank with the reducer's
// name and what to do (the chief's error reaches the others: none waits for it).
TEST(MetricReducers, AResultOfTheWrongKindIsRefusedOnEveryRank) {
  for (const bool named : {true, false}) {
    const std::string dir = shared_dir(named ? "named-object" : "unnamed-number");
    LinearTrial::Options options;
    options.setup = [&](LinearTrial& trial) {
      auto function = [named](const std::vector<json>&) -> MetricValue {
        return named ? MetricValue(json{{"a", 1.0}}) : MetricValue(0.5);
      };
      if (named) {
        trial.context_.wrap_reducer(function, "summary", /*for_training=*/false);
      } else {
        trial.context_.wrap_reducer(function, std::nullopt, /*for_training=*/false);
      }
    };
    std::string message;
    try {
      train_on_ranks(base_yaml(2, 8), options, dir);
    } catch (const ConfigError& e) {
      message = e.what();
    }
    if (named) {
      EXPECT_THAT(message, testing::HasSubstr("the reducer 'summary' returned an object ({\"a\":1.0}); a named reducer "
                                              "reports one value: register it without a name"));
    } else {
      EXPECT_THAT(message, testing::HasSubstr("the unnamed reducer 0 returned 0.5, not an object of metrics by name"));
    }
    EXPECT_THAT(message, testing::HasSubstr("a custom validation reducer failed on the chief")) << "rank " << env().rank();
    comm::MpiCommunicator(env().world()).barrier();
    if (env().is_chief()) std::filesystem::remove_all(dir);
  }
}

// A mistake on one rank only - a metric whose shape changes there, a reducer's per_slot_reduce
// that throws there - fails every rank with that rank's message, and none waits for it.
TEST(MetricReducers, AMistakeOnOneRankFailsEveryRankAlike) {
  const auto error_of = [](const std::string& name, const LinearTrial::Options& options) {
    const std::string dir = shared_dir(name);
    std::string message = "no error";
    try {
      train_on_ranks(base_yaml(2, 8), options, dir);
    } catch (const ConfigError& e) {
      message = e.what();
    }
    comm::MpiCommunicator(env().world()).barrier();
    if (env().is_chief()) std::filesystem::remove_all(dir);
    return message;
  };
  class FailingOnOneRank : public MetricReducer {
   public:
    explicit FailingOnOneRank(int failing) : failing_(failing) {}
    void reset() override {}
    json per_slot_reduce() override {
      if (env().rank() == failing_) throw std::runtime_error("out of memory");
      return 1.0;
    }
    MetricValue cross_slot_reduce(const std::vector<json>& per_slot) override { return static_cast<double>(per_slot.size()); }

   private:
    int failing_;
  };
  for (const int failing : {0, env().size() - 1}) {  // the chief, and another rank
    LinearTrial::Options growing;
    int batch = 0;
    growing.evaluate = [&](LinearTrial&, Batch&) -> Metrics {
      const bool grow = env().rank() == failing && batch++ == 1;
      return {{"validation_loss", 1.0}, {"per_class", torch::zeros({grow ? 3 : 2})}};
    };
    EXPECT_THAT(error_of("shape", growing),
                testing::HasSubstr("evaluate_batch returned the metric 'per_class' with shape [3] after [2] on rank " +
                                   std::to_string(failing)))
        << "rank " << env().rank();
    LinearTrial::Options reducing;
    reducing.setup = [&](LinearTrial& trial) {
      trial.context_.wrap_reducer(std::make_shared<FailingOnOneRank>(failing), "slots", /*for_training=*/false);
    };
    EXPECT_THAT(error_of("per-slot", reducing),
                testing::HasSubstr("per_slot_reduce of the reducer 'slots' failed on rank " + std::to_string(failing) +
                                   ": out of memory"))
        << "rank " << env().rank();
  }
}

}  // namespace metric_reducer_test
}  // namespace hpctrial::trainer
