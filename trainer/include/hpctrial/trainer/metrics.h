// Metrics a trial reports, and how they are reduced across batches and ranks.
//
// train_batch and evaluate_batch return Metrics: names to values, given as tensors
// (`{"loss", loss}`: kept on their device and summed there, so a step never waits for the GPU
// to report a number) or as plain numbers (`{"accuracy", 0.93}`); or a bare loss tensor.
// Training metrics are single numbers; an evaluation metric may be a tensor of any shape (a
// per-class accuracy), reduced element by element.
//
// Evaluation metrics are reduced over the batches of every rank by a Reducer (Determined's
// AVG, SUM, MAX, MIN), chosen for all metrics or per metric by Trial::evaluation_reducer().
// Anything else is a MetricReducer (Determined's custom reducer), registered with
// TrialContext::wrap_reducer(): it exchanges any JSON value between the ranks and reports any
// JSON value (a number, a vector, a confusion matrix), or several metrics at once.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "hpctrial/trainer/metric_value.h"

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace hpctrial::trainer {

class Metric {
 public:
  // A tensor, detached from the autograd graph; one element is a number (its shape dropped).
  Metric(torch::Tensor value);  // NOLINT(google-explicit-constructor): {"loss", loss}
  Metric(double value);         // NOLINT(google-explicit-constructor): {"accuracy", 0.93}
  Metric(float value) : Metric(static_cast<double>(value)) {}  // NOLINT
  Metric(int value) : Metric(static_cast<double>(value)) {}    // NOLINT
  Metric(std::int64_t value) : Metric(static_cast<double>(value)) {}  // NOLINT

  const torch::Tensor& tensor() const { return value_; }
  // The value as a number (waits for the device); ConfigError for a tensor of several elements.
  double item() const;
  bool is_scalar() const { return value_.dim() == 0; }

 private:
  torch::Tensor value_;
};

// A batch's metrics, by name. A bare tensor is the loss: `return loss;` reports {"loss", loss},
// as the reference's train_batch may return a loss tensor alone.
class Metrics : public std::map<std::string, Metric> {
 public:
  using std::map<std::string, Metric>::map;
  Metrics() = default;
  Metrics(torch::Tensor loss);  // NOLINT(google-explicit-constructor): return loss;
};

// A tensor's values as JSON: nested arrays of its shape (a number for one element), to pass to
// a reducer's update() or return from evaluate_full_dataset.
nlohmann::json tensor_json(const torch::Tensor& values);

enum class Reducer { kAvg, kSum, kMax, kMin };

// Which Reducer applies to which evaluation metric: one for all, or per metric (metrics not
// named use kAvg). Converts from either, so evaluation_reducer() can return Reducer::kSum or
// {{"errors", Reducer::kSum}}.
struct ReducerSpec {
  ReducerSpec(Reducer all) : all(all) {}  // NOLINT(google-explicit-constructor)
  ReducerSpec(std::map<std::string, Reducer> per_metric)  // NOLINT(google-explicit-constructor)
      : per_metric(std::move(per_metric)) {}
  Reducer reducer_for(const std::string& metric) const;

  Reducer all = Reducer::kAvg;
  std::map<std::string, Reducer> per_metric;
};

// A custom metric that needs more than one number per batch (Determined's MetricReducer):
// accumulate with your own update() calls in evaluate_batch or train_batch, summarise this
// rank's share in per_slot_reduce() (any JSON value: numbers, arrays, objects; doubles travel
// exactly, NaN included), and combine every rank's summary in cross_slot_reduce(), which runs on
// the chief. Registered with a name, its result is that metric (any value but a JSON object);
// registered without one (Determined's name=None), its result is a JSON object of metrics.
class MetricReducer {
 public:
  virtual ~MetricReducer() = default;
  // Called before each validation (or training reporting period).
  virtual void reset() = 0;
  // This rank's partial result.
  virtual nlohmann::json per_slot_reduce() = 0;
  // The metric (or, registered without a name, the object of metrics) from every rank's partial
  // result, in rank order. A rank whose model-parallel unit reports no metrics has no entry.
  virtual MetricValue cross_slot_reduce(const std::vector<nlohmann::json>& per_slot) = 0;
  // What it has accumulated part way through a training reporting period, saved with each
  // checkpoint so that the first report after a resume covers the batches before it too. The
  // default, null, saves nothing: that report then covers only the batches after the resume.
  virtual nlohmann::json state_dict() const { return nullptr; }
  virtual void load_state_dict(const nlohmann::json& /*state*/) {}
};

// The reducer wrap_reducer() makes from a function: update() collects values on each rank (any
// JSON value: `roc.update({y_true, y_score})` with tensor_json), and the function gets every
// rank's values at once, as one flat list in rank order (Determined's function form).
class FunctionReducer final : public MetricReducer {
 public:
  using Function = std::function<MetricValue(const std::vector<nlohmann::json>& values)>;
  explicit FunctionReducer(Function function) : function_(std::move(function)) {}
  void update(nlohmann::json value) { values_.push_back(std::move(value)); }
  void reset() override { values_.clear(); }
  nlohmann::json per_slot_reduce() override { return values_; }
  MetricValue cross_slot_reduce(const std::vector<nlohmann::json>& per_slot) override;
  nlohmann::json state_dict() const override;
  void load_state_dict(const nlohmann::json& state) override;

 private:
  Function function_;
  std::vector<nlohmann::json> values_;
};

}  // namespace hpctrial::trainer
