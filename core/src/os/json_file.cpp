#include "hpctrial/core/json_file.h"

#include <cmath>
#include <fstream>
#include <limits>

#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"

namespace hpctrial::core {
using json = nlohmann::json;

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return json::object();
  try {
    json j = json::parse(in);
    if (!j.is_object()) {
      throw IoError(path + " holds " + std::string(j.type_name()) + " " + j.dump().substr(0, 40) +
                    " where hpctrial keeps a JSON object; restore it from a backup, or remove it");
    }
    return j;
  } catch (const json::exception& e) {
    throw IoError(path + " is not valid JSON (" + e.what() + "); remove it or restore it from a backup");
  }
}

void write_json_file(const std::string& path, const json& value) {
  write_file_atomic(path, value.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
}

json json_number(double value) {
  if (std::isfinite(value)) return value;
  return std::isnan(value) ? "NaN" : (value > 0 ? "Infinity" : "-Infinity");
}

std::optional<double> number_of(const json& value) {
  if (value.is_number()) return value.get<double>();
  if (value.is_null()) return std::numeric_limits<double>::quiet_NaN();
  if (value.is_string()) {
    const auto& text = value.get_ref<const std::string&>();
    if (text == "NaN") return std::numeric_limits<double>::quiet_NaN();
    if (text == "Infinity") return std::numeric_limits<double>::infinity();
    if (text == "-Infinity") return -std::numeric_limits<double>::infinity();
  }
  return std::nullopt;
}

std::map<std::string, double> numbers_of(const json& object, const std::string& what) {
  std::map<std::string, double> out;
  if (object.is_null()) return out;
  if (!object.is_object()) throw IoError(what + " is not a map of numbers: " + object.dump());
  for (auto it = object.begin(); it != object.end(); ++it) {
    const auto number = number_of(it.value());
    if (!number) throw IoError(what + ": \"" + it.key() + "\" is not a number: " + it.value().dump());
    out[it.key()] = *number;
  }
  return out;
}

json json_numbers(const std::map<std::string, double>& values) {
  json out = json::object();
  for (const auto& [name, value] : values) out[name] = json_number(value);
  return out;
}

namespace {

json map_numbers(const json& value, bool encode) {
  if (value.is_array() || value.is_object()) {
    json out = value;
    for (auto& element : out) element = map_numbers(element, encode);
    return out;
  }
  if (encode && value.is_number_float()) return json_number(value.get<double>());
  if (!encode && value.is_string()) {
    if (const auto number = number_of(value)) return *number;
  }
  return value;
}

}  // namespace

json json_numbers_within(const json& value) { return map_numbers(value, true); }

json numbers_within(const json& value) { return map_numbers(value, false); }

}  // namespace hpctrial::core
