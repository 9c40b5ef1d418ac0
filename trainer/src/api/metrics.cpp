#include "hpctrial/trainer/metrics.h"

#include "hpctrial/core/error.h"

namespace hpctrial::trainer {

Metric::Metric(torch::Tensor value) : value_(value.detach()) {
  if (value_.numel() != 1) {
    throw ConfigError("a metric must be a single number, got a tensor of shape " +
                      c10::str(value_.sizes()) + "; reduce it first (e.g. .mean())");
  }
  if (value_.dim() != 0) value_ = value_.reshape({});
}

Metric::Metric(double value) : value_(torch::tensor(value, torch::kFloat64)) {}

Metrics::Metrics(torch::Tensor loss) : std::map<std::string, Metric>{{"loss", Metric(std::move(loss))}} {}

double Metric::item() const { return value_.item<double>(); }

Reducer ReducerSpec::reducer_for(const std::string& metric) const {
  if (per_metric.empty()) return all;
  auto it = per_metric.find(metric);
  return it == per_metric.end() ? Reducer::kAvg : it->second;
}

double FunctionReducer::cross_slot_reduce(const std::vector<std::vector<double>>& per_slot) {
  std::vector<double> all;
  for (const auto& values : per_slot) all.insert(all.end(), values.begin(), values.end());
  return function_(all);
}

}  // namespace hpctrial::trainer
