#include "hpctrial/trainer/metric_value.h"

#include <limits>
#include <ostream>

#include "hpctrial/core/error.h"
#include "hpctrial/core/json_file.h"

namespace hpctrial::trainer {

using json = nlohmann::json;

void MetricValue::set(const json& value) {
  const auto number = core::number_of(value);
  if (number && !value.is_null()) {
    number_ = *number;
    value_ = nullptr;
  } else {
    value_ = core::numbers_within(value);
    if (value_.is_null()) number_ = std::numeric_limits<double>::quiet_NaN();  // null: how NaN was once written
  }
}

double MetricValue::number() const {
  if (!is_number()) {
    throw ConfigError("the metric value " + to_json().dump() + " is not a single number; read it with .value()");
  }
  return number_;
}

json MetricValue::to_json() const { return is_number() ? core::json_number(number_) : core::json_numbers_within(value_); }

std::ostream& operator<<(std::ostream& out, const MetricValue& value) { return out << value.to_json().dump(); }

}  // namespace hpctrial::trainer
