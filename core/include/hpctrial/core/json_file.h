// JSON records of the experiment directory (experiment.json, launcher-state.json), read whole
// and published atomically.
#pragma once

#include <nlohmann/json.hpp>

#include <map>
#include <optional>
#include <string>
#include <type_traits>

#include "hpctrial/core/error.h"

namespace hpctrial::core {

template <typename T>
const char* json_type_name() {
  if constexpr (std::is_same_v<T, std::string>) return "string";
  else if constexpr (std::is_same_v<T, bool>) return "boolean";
  else if constexpr (std::is_integral_v<T>) return "whole number";
  else if constexpr (std::is_floating_point_v<T>) return "number";
  else return "value of the expected kind";
}

// The object in `path`; an empty object when the file does not exist. IoError naming the file
// when it is not JSON, or JSON of another kind than an object (a state file that was damaged or
// replaced is never read as an empty one).
nlohmann::json read_json_file(const std::string& path);
// Publishes `value` at `path` atomically (write_file_atomic); text that is not UTF-8 is written
// with replacement characters.
void write_json_file(const std::string& path, const nlohmann::json& value);

// A double as JSON, any value it can take: a number when finite, else the string "NaN",
// "Infinity" or "-Infinity" (JSON has no literal for them; Python's json and JavaScript read the
// same names). metrics.jsonl and checkpoints write metrics this way.
nlohmann::json json_number(double value);
// The double `value` holds: a number, one of json_number's strings, or null (how non-finite
// values were once written: NaN). std::nullopt for anything else.
std::optional<double> number_of(const nlohmann::json& value);
// Every value of a JSON object of numbers, as json_number wrote them; IoError naming `what`
// and the key when one is not a number.
std::map<std::string, double> numbers_of(const nlohmann::json& object, const std::string& what);
nlohmann::json json_numbers(const std::map<std::string, double>& values);
// Any JSON value with every number in it (arrays and objects walked) as json_number writes it,
// and back: every string json_number writes read as its double.
nlohmann::json json_numbers_within(const nlohmann::json& value);
nlohmann::json numbers_within(const nlohmann::json& value);

// `object[key]` as a T, or `fallback` when the key is absent or null. IoError naming the file,
// the key and what it holds when the value has another type (a record edited by hand, or
// written by something else): the file is to be fixed or removed, never a crash.
template <typename T>
T json_field(const nlohmann::json& object, const std::string& key, T fallback, const std::string& path) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  try {
    return it->template get<T>();
  } catch (const nlohmann::json::exception&) {
    throw IoError(path + ": \"" + key + "\" holds " + it->dump() + ", which is not a " + json_type_name<T>() +
                  "; fix the file or remove it");
  }
}

}  // namespace hpctrial::core
