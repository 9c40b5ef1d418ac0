#include "hpctrial/trainer/metrics.h"

#include "hpctrial/core/error.h"
#include "hpctrial/core/json_file.h"

namespace hpctrial::trainer {

using json = nlohmann::json;

Metric::Metric(torch::Tensor value) : value_(value.detach()) {
  if (value_.numel() == 1 && value_.dim() != 0) value_ = value_.reshape({});
}

Metric::Metric(double value) : value_(torch::tensor(value, torch::kFloat64)) {}

Metrics::Metrics(torch::Tensor loss) : std::map<std::string, Metric>{{"loss", Metric(std::move(loss))}} {}

double Metric::item() const {
  if (value_.dim() != 0) {
    throw ConfigError("a metric of shape " + c10::str(value_.sizes()) + " is not a single number");
  }
  return value_.item<double>();
}

namespace {

// The values from `at` on, nested by the sizes from dimension `dim` on.
json nested(const double*& at, const std::vector<std::int64_t>& sizes, std::size_t dim) {
  if (dim == sizes.size()) return *at++;
  json out = json::array();
  for (std::int64_t i = 0; i < sizes[dim]; ++i) out.push_back(nested(at, sizes, dim + 1));
  return out;
}

}  // namespace

json tensor_json(const torch::Tensor& values) {
  const torch::Tensor t = values.detach().to(torch::kCPU, torch::kFloat64).contiguous();
  const std::vector<std::int64_t> sizes(t.sizes().begin(), t.sizes().end());
  const double* at = t.data_ptr<double>();
  return nested(at, sizes, 0);
}

Reducer ReducerSpec::reducer_for(const std::string& metric) const {
  if (per_metric.empty()) return all;
  auto it = per_metric.find(metric);
  return it == per_metric.end() ? Reducer::kAvg : it->second;
}

MetricValue FunctionReducer::cross_slot_reduce(const std::vector<json>& per_slot) {
  std::vector<json> all;
  for (const auto& values : per_slot) {
    if (values.is_array()) all.insert(all.end(), values.begin(), values.end());
  }
  return function_(all);
}

json FunctionReducer::state_dict() const { return core::json_numbers_within(json(values_)); }

void FunctionReducer::load_state_dict(const json& state) {
  values_.clear();
  if (!state.is_array()) throw CheckpointError("a function reducer's saved values are not a list: " + state.dump());
  for (const auto& value : state) values_.push_back(core::numbers_within(value));
}

}  // namespace hpctrial::trainer
