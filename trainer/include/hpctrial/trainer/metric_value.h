// A reported metric's value (metric_value.cpp): no LibTorch, so that what writes and reads
// metrics builds without it.
#pragma once

#include <nlohmann/json.hpp>

#include <iosfwd>
#include <map>
#include <string>
#include <type_traits>

namespace hpctrial::trainer {

// A reported metric's value once reduced: a number, or any JSON value (a per-class vector, a
// confusion matrix, a string) from a tensor metric, a reducer or evaluate_full_dataset. Reads as
// a double where one is wanted (`double loss = metrics.at("loss");`); reading a value that is
// not a number that way throws a ConfigError naming it.
class MetricValue {
 public:
  MetricValue() = default;
  MetricValue(double value) : number_(value) {}  // NOLINT(google-explicit-constructor)
  // Anything JSON holds (a json, a std::vector<double>, a map): a number (or one of "NaN",
  // "Infinity", "-Infinity", as metrics.jsonl writes them) is a number; anything else is kept.
  template <typename T,
            std::enable_if_t<!std::is_arithmetic_v<T> && !std::is_same_v<T, MetricValue> &&
                                 std::is_constructible_v<nlohmann::json, const T&>,
                             int> = 0>
  MetricValue(const T& value) {  // NOLINT(google-explicit-constructor)
    set(nlohmann::json(value));
  }

  bool is_number() const { return value_.is_null(); }
  double number() const;
  operator double() const { return number(); }  // NOLINT(google-explicit-constructor)
  // The value as JSON, as metrics.jsonl writes it: a number that is not finite, also inside an
  // array or object, is the string "NaN", "Infinity" or "-Infinity" (core::json_number).
  nlohmann::json to_json() const;
  // The value itself: doubles as they are (NaN included), for exchanges in memory.
  nlohmann::json value() const { return is_number() ? nlohmann::json(number_) : value_; }

 private:
  void set(const nlohmann::json& value);
  double number_ = 0;
  nlohmann::json value_;  // null for a number
};

// `json j = metrics.at("x")` and printing: the value as metrics.jsonl writes it.
inline void to_json(nlohmann::json& out, const MetricValue& value) { out = value.to_json(); }
std::ostream& operator<<(std::ostream& out, const MetricValue& value);

// Reported metrics, once reduced.
using MetricValues = std::map<std::string, MetricValue>;

}  // namespace hpctrial::trainer
