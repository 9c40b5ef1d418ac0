// The readers of the experiment schema's values: lengths, durations, names, the environment,
// the entrypoint and the hyperparameters.
#include "config_schema.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <regex>
#include <tuple>

#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/paths.h"

namespace hpctrial::core::detail {

bool full_match(const std::string& text, const char* pattern) {
  return std::regex_match(text, std::regex(pattern));
}

std::optional<Length> read_length(const ConfigNode& node, const std::string& path, Diagnostics& d,
                                  const std::vector<LengthUnit>& units) {
  std::string names;
  for (std::size_t i = 0; i < units.size(); ++i) {
    names += (i == 0 ? "" : i + 1 == units.size() ? " or " : ", ") + std::string(to_string(units[i]));
  }
  const std::string example = "{" + std::string(to_string(units.front())) + ": 1000}";
  if (!node.is_map() || node.entries().size() != 1) {
    report(node, path, d,
           "must be a map with exactly one of " + names + ", e.g. " + example + "; got " +
               (node.is_map() ? std::to_string(node.entries().size()) + " keys" : describe(node)));
    return std::nullopt;
  }
  const ConfigEntry& entry = node.entries().front();
  for (LengthUnit unit : units) {
    if (entry.key == to_string(unit)) {
      const auto value = read_int(entry.value, path + "." + entry.key, d, 1, kMaxLength);
      if (!value) return std::nullopt;
      return Length{unit, *value};
    }
  }
  std::vector<std::string> candidates;
  for (LengthUnit unit : units) candidates.emplace_back(to_string(unit));
  std::string message = "unknown unit; use one of " + names;
  const std::string suggestion = closest_match(entry.key, candidates);
  if (!suggestion.empty()) message += " (did you mean '" + suggestion + "'?)";
  d.error(entry.key_where, path + "." + entry.key, message);
  return std::nullopt;
}

std::optional<std::int64_t> read_duration(const ConfigNode& node, const std::string& path,
                                          Diagnostics& d, std::int64_t min, std::int64_t max) {
  const auto text = read_string(node, path, d);
  if (!text) return std::nullopt;
  std::string reason;
  const auto seconds = parse_duration(*text, &reason);
  if (!seconds) {
    report(node, path, d, describe(node) + " " + reason);
    return std::nullopt;
  }
  if (*seconds < min || *seconds > max) {
    report(node, path, d,
           "must be between " + format_duration(min) + " and " + format_duration(max) + ", got " +
               describe(node));
    return std::nullopt;
  }
  return seconds;
}

// A name a scheduler accepts as partition, queue, account or QoS.
std::optional<std::string> read_scheduler_name(const ConfigNode& node, const std::string& path,
                                               Diagnostics& d, bool allow_at) {
  const auto text = read_string(node, path, d);
  if (!text) return std::nullopt;
  const char* pattern = allow_at ? "[A-Za-z0-9._-]+(@[A-Za-z0-9._-]+)?" : "[A-Za-z0-9._-]+";
  if (text->size() > kMaxNameLength || !full_match(*text, pattern)) {
    report(node, path, d,
           "must be a name of letters, digits, '.', '_' and '-'" +
               std::string(allow_at ? " (optionally @server)" : "") + ", got " + describe(node));
    return std::nullopt;
  }
  return text;
}

// Checks ${env:NAME} references; other text, $ included, is taken literally.
bool check_env_references(const ConfigNode& node, const std::string& value, const std::string& path,
                          Diagnostics& d) {
  std::size_t at = 0;
  while ((at = value.find("${", at)) != std::string::npos) {
    const std::size_t close = value.find('}', at);
    if (close == std::string::npos) {
      report(node, path, d, "has an unterminated \"${\"; write ${env:NAME} to use a variable of "
                            "the submitting environment");
      return false;
    }
    const std::string inner = value.substr(at + 2, close - at - 2);
    if (inner.rfind("env:", 0) != 0 || !is_valid_env_name(inner.substr(4))) {
      report(node, path, d,
             "has \"${" + inner + "}\"; the only substitution is ${env:NAME}, with NAME a "
             "variable of the submitting environment");
      return false;
    }
    at = close + 1;
  }
  return true;
}

std::vector<EnvVar> read_environment(const ConfigNode* node, const std::string& path, Diagnostics& d,
                                     const std::vector<std::string>& settings) {
  std::vector<EnvVar> out;
  if (node == nullptr || node->is_null()) return out;
  if (!detail::expect_map(*node, path, d, path + ": {OMP_NUM_THREADS: \"4\"}")) return out;
  for (const auto& entry : node->entries()) {
    const std::string key_path = path + "." + entry.key;
    if (std::find(settings.begin(), settings.end(), entry.key) != settings.end()) continue;
    if (!is_valid_env_name(entry.key)) {
      d.error(entry.key_where, key_path,
              "is not a valid variable name; use letters, digits and '_', not starting with a digit");
      continue;
    }
    if (entry.key.rfind("HPCTRIAL_", 0) == 0) {
      d.error(entry.key_where, key_path,
              "variables starting with HPCTRIAL_ are set by hpctrial itself; choose another name");
      continue;
    }
    const auto value = read_string(entry.value, key_path, d, /*allow_empty=*/true);
    if (!value) continue;
    if (!check_env_references(entry.value, *value, key_path, d)) continue;
    out.push_back({entry.key, *value});
  }
  return out;
}

std::optional<Entrypoint> read_entrypoint(const ConfigNode& node, const std::string& path,
                                          Diagnostics& d) {
  Entrypoint out;
  std::vector<std::string> words;
  if (node.is_sequence()) {
    const auto list = read_string_list(node, path, d);
    if (!list) return std::nullopt;
    if (list->empty()) {
      report(node, path, d, "must not be empty; e.g. [./my_trial, --verbose]");
      return std::nullopt;
    }
    out.argv = *list;
    return out;
  }
  const auto text = read_string(node, path, d);
  if (!text) return std::nullopt;
  if (text->find_first_of("\"'\\") != std::string::npos) {
    report(node, path, d,
           "contains quotes or backslashes; hpctrial runs the entrypoint without a shell, so "
           "write it as a list of arguments instead, e.g. [./my_trial, \"a b\"]");
    return std::nullopt;
  }
  std::size_t start = 0;
  while (start < text->size()) {
    const std::size_t space = text->find_first_of(" \t", start);
    const std::string word = text->substr(start, space == std::string::npos ? std::string::npos : space - start);
    if (!word.empty()) words.push_back(word);
    if (space == std::string::npos) break;
    start = space + 1;
  }
  if (words.empty()) {
    report(node, path, d, "must not be empty; e.g. ./my_trial or ./libmodel.so:MyTrial");
    return std::nullopt;
  }
  static const std::regex library(R"(([^:\s]+\.so(\.[0-9]+)*):([A-Za-z_][A-Za-z0-9_]*(::[A-Za-z_][A-Za-z0-9_]*)*))");
  std::smatch match;
  if (words.size() == 1 && std::regex_match(words[0], match, library)) {
    out.kind = Entrypoint::Kind::kLibrary;
    out.library = match[1];
    out.trial_class = match[3];
    return out;
  }
  if (words[0].find(".so:") != std::string::npos) {
    report(node, path, d,
           "looks like a trial library but is not LIBRARY.so:TrialClass with a C++ class name, "
           "got " + describe(node));
    return std::nullopt;
  }
  out.argv = words;
  return out;
}

std::optional<Hyperparameter> read_hyperparameter(const ConfigNode& node, const std::string& path,
                                                  Diagnostics& d, int depth);

std::vector<std::pair<std::string, Hyperparameter>> read_hyperparameters(const ConfigNode& node,
                                                                          const std::string& path,
                                                                          Diagnostics& d, int depth) {
  std::vector<std::pair<std::string, Hyperparameter>> out;
  for (const auto& entry : node.entries()) {
    const std::string key_path = path + "." + entry.key;
    if (!full_match(entry.key, "[A-Za-z0-9_-]+")) {
      d.error(entry.key_where, key_path,
              "hyperparameter names use letters, digits, '_' and '-' (so --set can address them)");
      continue;
    }
    if (auto hp = read_hyperparameter(entry.value, key_path, d, depth + 1)) {
      out.emplace_back(entry.key, std::move(*hp));
    }
  }
  return out;
}

namespace {

// The minval, maxval, count and (for log) base of an int, double or log range; false when any
// of them is missing or invalid, or minval is not below maxval.
bool read_range(MapReader& r, const ConfigNode& node, const std::string& path, Diagnostics& d,
                Hyperparameter& hp) {
  const ConfigNode* min_node = r.require("minval", "minval: 1");
  const ConfigNode* max_node = r.require("maxval", "maxval: 10");
  bool ok = min_node != nullptr && max_node != nullptr;
  for (auto [n, target, key] : {std::tuple{min_node, &hp.minval, "minval"},
                                std::tuple{max_node, &hp.maxval, "maxval"}}) {
    if (n == nullptr) continue;
    if (hp.type == Hyperparameter::Type::kInt) {
      const auto v = read_int(*n, r.path(key), d, -kMaxLength, kMaxLength);
      if (v) *target = static_cast<double>(*v);
      ok = ok && v.has_value();
    } else {
      const auto v = read_double(*n, r.path(key), d, -1e300, 1e300, false);
      if (v) *target = *v;
      ok = ok && v.has_value();
    }
  }
  if (const ConfigNode* count = r.get("count")) {
    const auto v = read_int(*count, r.path("count"), d, 1, kMaxTrials);
    if (v) hp.count = *v;
    ok = ok && v.has_value();
  }
  if (hp.type == Hyperparameter::Type::kLog) {
    if (const ConfigNode* base = r.get("base")) {
      const auto v = read_double(*base, r.path("base"), d, 0, 1e300, true);
      if (v && *v == 1.0) {
        report(*base, r.path("base"), d, "must not be 1 (every power of 1 is 1); e.g. base: 10");
      } else if (v) {
        hp.base = *v;
      }
      ok = ok && v.has_value() && *v != 1.0;
    }
  }
  if (ok && !(hp.minval < hp.maxval)) {
    report(node, path, d,
           fmt::format("minval ({}) must be less than maxval ({}); for a single value use "
                       "{{type: const, val: ...}}",
                       hp.minval, hp.maxval));
    ok = false;
  }
  return ok;
}

// The vals of a categorical hyperparameter; false when missing or not a non-empty list.
bool read_categorical_vals(MapReader& r, Diagnostics& d, Hyperparameter& hp) {
  const ConfigNode* vals = r.require("vals", "vals: [32, 64, 128]");
  if (vals == nullptr) return false;
  if (!vals->is_sequence() || vals->items().empty()) {
    report(*vals, r.path("vals"), d,
           "must be a non-empty list of choices, e.g. [32, 64, 128]; got " + describe(*vals));
    return false;
  }
  hp.vals = vals->items();
  return true;
}

}  // namespace

std::optional<Hyperparameter> read_hyperparameter(const ConfigNode& node, const std::string& path,
                                                  Diagnostics& d, int depth) {
  Hyperparameter hp;
  if (!node.is_map()) {
    if (node.is_null()) {
      report(node, path, d, "has no value; give a constant (e.g. 0.01) or a range "
                            "({type: double, minval: 0.001, maxval: 0.1})");
      return std::nullopt;
    }
    hp.value = node;
    return hp;
  }
  const ConfigNode* type_node = node.find("type");
  if (type_node == nullptr) {
    hp.type = Hyperparameter::Type::kNested;
    hp.nested = read_hyperparameters(node, path, d, depth);
    return hp;
  }
  MapReader r(&node, path, d);
  const auto type = read_choice(*r.get("type"), r.path("type"), d, "hyperparameter type",
                                kHyperparameterTypes);
  if (!type) return std::nullopt;
  hp.type = *type;
  std::optional<Hyperparameter> result;
  if (hp.type == Hyperparameter::Type::kConst) {
    if (const ConfigNode* val = r.require("val", "val: 0.01")) {
      hp.value = *val;
      result = hp;
    }
  } else if (hp.type != Hyperparameter::Type::kCategorical) {
    if (read_range(r, node, path, d, hp)) result = hp;
  } else {
    if (read_categorical_vals(r, d, hp)) result = hp;
  }
  r.finish();
  return result;
}

}  // namespace hpctrial::core::detail

namespace hpctrial::core {

using detail::choice_name;
using detail::kCompressions;
using detail::kHyperparameterTypes;
using detail::kLengthUnits;
using detail::kSearcherNames;
using detail::kSearcherModes;

std::string_view to_string(LengthUnit unit) { return choice_name(kLengthUnits, unit); }

std::string_view to_string(Hyperparameter::Type type) {
  if (type == Hyperparameter::Type::kNested) return "nested";
  return choice_name(kHyperparameterTypes, type);
}

std::string_view to_string(Searcher::Name name) { return choice_name(kSearcherNames, name); }
std::string_view to_string(Searcher::Mode mode) { return choice_name(kSearcherModes, mode); }

std::string_view to_string(GradientCompression compression) { return choice_name(kCompressions, compression); }

const std::vector<std::string>& scheduler_common_keys() {
  static const std::vector<std::string> keys = {"type", "account", "time_limit", "preemption_grace",
                                                "modules", "environment", "extra_directives"};
  return keys;
}

bool check_scheduler_name(const ConfigNode& node, const std::string& path, Diagnostics& diagnostics,
                          bool allow_at) {
  return detail::read_scheduler_name(node, path, diagnostics, allow_at).has_value();
}

}  // namespace hpctrial::core
