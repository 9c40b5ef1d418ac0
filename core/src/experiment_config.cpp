// The experiment schema: every key, its type, default and limits. docs/config-reference.md
// documents the same keys; a test checks that the two agree.
#include "hpctrial/core/experiment_config.h"

#include <fmt/core.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <regex>
#include <tuple>

#include "config_values.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/paths.h"

namespace hpctrial::core {

using detail::describe;
using detail::MapReader;
using detail::read_bool;
using detail::read_double;
using detail::read_int;
using detail::read_string;
using detail::read_string_list;
using detail::report;

namespace {

// Limits that catch typos (an extra digit) long before any machine would.
constexpr std::int64_t kMaxSlots = 1 << 20;
constexpr std::int64_t kMaxCpusPerSlot = 4096;
constexpr std::int64_t kMaxGpusPerSlot = 64;
constexpr std::int64_t kMaxLength = std::int64_t{1} << 53;
constexpr std::int64_t kMaxTrials = 1000000;
constexpr std::int64_t kMaxRestarts = 100000;
constexpr std::int64_t kMaxAggregation = 1 << 20;
constexpr double kMaxBucketCapMb = 65536;
constexpr std::int64_t kMaxTimeLimit = 366LL * 86400;
// Slurm's --signal=SIG@TIME takes at most 65535 seconds.
constexpr std::int64_t kMaxGrace = 65535;
constexpr std::int64_t kMaxCollectiveTimeout = 7LL * 86400;
constexpr std::size_t kMaxNameLength = 128;

bool full_match(const std::string& text, const char* pattern) {
  return std::regex_match(text, std::regex(pattern));
}

// The names of an enumeration as written in configs: one table per enum drives parsing,
// messages and to_string().
template <typename E>
struct Choice {
  const char* name;
  E value;
};

constexpr Choice<LengthUnit> kLengthUnits[] = {{"batches", LengthUnit::kBatches},
                                               {"epochs", LengthUnit::kEpochs},
                                               {"records", LengthUnit::kRecords},
                                               {"seconds", LengthUnit::kSeconds}};
constexpr Choice<Hyperparameter::Type> kHyperparameterTypes[] = {
    {"const", Hyperparameter::Type::kConst},   {"int", Hyperparameter::Type::kInt},
    {"double", Hyperparameter::Type::kDouble}, {"log", Hyperparameter::Type::kLog},
    {"categorical", Hyperparameter::Type::kCategorical}};
constexpr Choice<Searcher::Name> kSearcherNames[] = {{"single", Searcher::Name::kSingle},
                                                     {"grid", Searcher::Name::kGrid},
                                                     {"random", Searcher::Name::kRandom}};
constexpr Choice<SchedulerConfig::Type> kSchedulerTypes[] = {
    {"local", SchedulerConfig::Type::kLocal},
    {"slurm", SchedulerConfig::Type::kSlurm},
    {"pbs", SchedulerConfig::Type::kPbs}};
constexpr Choice<GradientCompression> kCompressions[] = {{"none", GradientCompression::kNone},
                                                        {"fp16", GradientCompression::kFloat16},
                                                        {"bf16", GradientCompression::kBFloat16}};
enum class StorageType { kSharedFs };
constexpr Choice<StorageType> kStorageTypes[] = {{"shared_fs", StorageType::kSharedFs}};

template <typename E, std::size_t N>
std::string_view choice_name(const Choice<E> (&choices)[N], E value) {
  for (const auto& choice : choices) {
    if (choice.value == value) return choice.name;
  }
  return "unknown";
}

// Reads one of the names in `choices`; reports "unknown <what> "x"; use one of a, b, c (did
// you mean 'b'?)" otherwise.
template <typename E, std::size_t N>
std::optional<E> read_choice(const ConfigNode& node, const std::string& path, Diagnostics& d,
                             const std::string& what, const Choice<E> (&choices)[N]) {
  const auto text = read_string(node, path, d);
  if (!text) return std::nullopt;
  std::vector<std::string> names;
  for (const auto& choice : choices) {
    if (*text == choice.name) return choice.value;
    names.emplace_back(choice.name);
  }
  std::string message = "unknown " + what + " " + describe(node) + "; use ";
  message += names.size() == 1 ? names.front() : "one of ";
  for (std::size_t i = 0; names.size() > 1 && i < names.size(); ++i) message += (i ? ", " : "") + names[i];
  const std::string suggestion = closest_match(*text, names);
  if (!suggestion.empty()) message += " (did you mean '" + suggestion + "'?)";
  report(node, path, d, message);
  return std::nullopt;
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

std::vector<EnvVar> read_environment(const ConfigNode* node, const std::string& path,
                                     Diagnostics& d) {
  std::vector<EnvVar> out;
  if (node == nullptr || node->is_null()) return out;
  if (!detail::expect_map(*node, path, d, path + ": {OMP_NUM_THREADS: \"4\"}")) return out;
  for (const auto& entry : node->entries()) {
    const std::string key_path = path + "." + entry.key;
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
    if (ok) result = hp;
  } else {
    if (const ConfigNode* vals = r.require("vals", "vals: [32, 64, 128]")) {
      if (!vals->is_sequence() || vals->items().empty()) {
        report(*vals, r.path("vals"), d,
               "must be a non-empty list of choices, e.g. [32, 64, 128]; got " + describe(*vals));
      } else {
        hp.vals = vals->items();
        result = hp;
      }
    }
  }
  r.finish();
  return result;
}

void read_searcher(MapReader& r, Searcher& s) {
  Diagnostics& d = r.diagnostics();
  if (const ConfigNode* n = r.require("name", "name: single")) {
    if (auto v = read_choice(*n, r.path("name"), d, "searcher", kSearcherNames)) s.name = *v;
  }
  if (const ConfigNode* n = r.require("metric", "metric: validation_loss")) {
    if (auto v = read_string(*n, r.path("metric"), d)) s.metric = *v;
  }
  if (const ConfigNode* n = r.get("smaller_is_better")) {
    if (auto v = read_bool(*n, r.path("smaller_is_better"), d)) s.smaller_is_better = *v;
  }
  if (const ConfigNode* n = r.require("max_length", "max_length: {batches: 1000}")) {
    if (auto v = read_length(*n, r.path("max_length"), d,
                             {LengthUnit::kBatches, LengthUnit::kEpochs, LengthUnit::kRecords})) {
      s.max_length = *v;
    }
  }
  const ConfigNode* trials = r.get("max_trials");
  if (trials != nullptr) {
    if (auto v = read_int(*trials, r.path("max_trials"), d, 1, kMaxTrials)) {
      s.max_trials = *v;
      if (s.name == Searcher::Name::kSingle && *v != 1) {
        report(*trials, r.path("max_trials"), d,
               "the single searcher runs exactly one trial; remove max_trials or use the random "
               "searcher");
      } else if (s.name == Searcher::Name::kGrid) {
        report(*trials, r.path("max_trials"), d,
               "the grid searcher runs one trial per grid point; remove max_trials and set "
               "`count` on each hyperparameter range instead");
      }
    }
  } else if (s.name == Searcher::Name::kRandom && r.present()) {
    r.diagnostics().error(r.where(), r.path("max_trials"),
                          "required key is missing for the random searcher; add it, e.g. "
                          "`max_trials: 16`");
  }
  if (const ConfigNode* n = r.get("max_concurrent_trials")) {
    if (auto v = read_int(*n, r.path("max_concurrent_trials"), d, 1, kMaxTrials)) s.max_concurrent_trials = *v;
  }
  r.finish();
}

void read_resources(MapReader& r, Resources& res) {
  Diagnostics& d = r.diagnostics();
  const ConfigNode* per_node = nullptr;
  if (const ConfigNode* n = r.get("slots_per_trial")) {
    if (auto v = read_int(*n, r.path("slots_per_trial"), d, 1, kMaxSlots)) res.slots_per_trial = static_cast<int>(*v);
  }
  bool per_node_ok = true;
  if ((per_node = r.get("slots_per_node"))) {
    auto v = read_int(*per_node, r.path("slots_per_node"), d, 1, kMaxSlots);
    per_node_ok = v.has_value();
    if (v) res.slots_per_node = static_cast<int>(*v);
  }
  if (per_node == nullptr) res.slots_per_node = res.slots_per_trial;
  if (const ConfigNode* n = r.get("cpus_per_slot")) {
    if (auto v = read_int(*n, r.path("cpus_per_slot"), d, 1, kMaxCpusPerSlot)) res.cpus_per_slot = static_cast<int>(*v);
  }
  if (const ConfigNode* n = r.get("gpus_per_slot")) {
    if (auto v = read_int(*n, r.path("gpus_per_slot"), d, 0, kMaxGpusPerSlot)) res.gpus_per_slot = static_cast<int>(*v);
  }
  if (const ConfigNode* n = r.get("memory_per_node")) {
    if (auto text = read_string(*n, r.path("memory_per_node"), d)) {
      std::string reason;
      if (auto bytes = parse_memory(*text, &reason)) {
        if (*bytes < (1u << 20)) {
          report(*n, r.path("memory_per_node"), d, "must be at least 1M, got " + describe(*n));
        } else {
          res.memory_per_node_bytes = bytes;
        }
      } else {
        report(*n, r.path("memory_per_node"), d, describe(*n) + " " + reason);
      }
    }
  }
  if (per_node != nullptr && per_node_ok) {
    if (res.slots_per_node > res.slots_per_trial) {
      report(*per_node, r.path("slots_per_node"), d,
             "is " + std::to_string(res.slots_per_node) + ", more than slots_per_trial (" +
                 std::to_string(res.slots_per_trial) + "); a trial uses at most slots_per_trial "
                 "slots, so lower slots_per_node");
    } else if (res.slots_per_trial % res.slots_per_node != 0) {
      const int lower = res.slots_per_trial / res.slots_per_node * res.slots_per_node;
      const int upper = lower + res.slots_per_node;
      report(*per_node, r.path("slots_per_node"), d,
             "slots_per_trial (" + std::to_string(res.slots_per_trial) +
                 ") must be a multiple of slots_per_node (" + std::to_string(res.slots_per_node) +
                 ") so every node runs the same number of ranks; use slots_per_trial " +
                 (lower > 0 ? std::to_string(lower) + " or " : "") + std::to_string(upper));
    }
  }
  r.finish();
}

void read_optimizations(MapReader& r, Optimizations& o) {
  Diagnostics& d = r.diagnostics();
  if (const ConfigNode* n = r.get("aggregation_frequency")) {
    if (auto v = read_int(*n, r.path("aggregation_frequency"), d, 1, kMaxAggregation)) o.aggregation_frequency = *v;
  }
  if (const ConfigNode* n = r.get("average_training_metrics")) {
    if (auto v = read_bool(*n, r.path("average_training_metrics"), d)) o.average_training_metrics = *v;
  }
  if (const ConfigNode* n = r.get("bucket_cap_mb")) {
    if (auto v = read_double(*n, r.path("bucket_cap_mb"), d, 0, kMaxBucketCapMb, true)) o.bucket_cap_mb = *v;
  }
  if (const ConfigNode* n = r.get("gradient_compression")) {
    // Determined's boolean form is kept: true is fp16.
    if (n->is_scalar() && !n->quoted() && (n->text() == "true" || n->text() == "false")) {
      o.gradient_compression = n->text() == "true" ? GradientCompression::kFloat16 : GradientCompression::kNone;
    } else if (auto v = read_choice(*n, r.path("gradient_compression"), d, "gradient compression",
                                    kCompressions)) {
      o.gradient_compression = *v;
    }
  }
  if (const ConfigNode* n = r.get("collective_timeout")) {
    if (auto v = read_duration(*n, r.path("collective_timeout"), d, 1, kMaxCollectiveTimeout)) {
      o.collective_timeout_seconds = *v;
    }
  }
  r.finish();
}

void read_checkpoint_storage(MapReader& r, CheckpointStorage& c) {
  Diagnostics& d = r.diagnostics();
  if (const ConfigNode* n = r.get("type")) {
    read_choice(*n, r.path("type"), d, "storage type", kStorageTypes);
  }
  if (const ConfigNode* n = r.get("host_path")) {
    if (auto v = read_string(*n, r.path("host_path"), d)) {
      // Relative to the file that says it (a template's directory for a template's path);
      // relative to the working directory for --set.
      const SourceLocation& where = n->where();
      std::filesystem::path base = std::filesystem::current_path();
      if (where.line > 0 && std::filesystem::path(where.file).has_parent_path()) {
        base = std::filesystem::path(where.file).parent_path();
      }
      try {
        c.host_path = resolve_user_path(*v, base, r.path("host_path")).string();
      } catch (const ConfigError& e) {
        // The message already starts with the key path; keep only the reason.
        const std::string message = e.what();
        report(*n, r.path("host_path"), d, message.substr(r.path("host_path").size() + 2));
      }
    }
  }
  const ConfigNode* latest = r.get("save_trial_latest");
  if (latest != nullptr) {
    if (auto v = read_int(*latest, r.path("save_trial_latest"), d, 0, 100000)) {
      if (*v == 0) {
        report(*latest, r.path("save_trial_latest"), d,
               "must be at least 1: a paused, preempted or requeued trial resumes from its "
               "latest checkpoint");
      } else {
        c.save_trial_latest = static_cast<int>(*v);
      }
    }
  }
  if (const ConfigNode* n = r.get("save_trial_best")) {
    if (auto v = read_int(*n, r.path("save_trial_best"), d, 0, 100000)) c.save_trial_best = static_cast<int>(*v);
  }
  if (const ConfigNode* n = r.get("async")) {
    if (auto v = read_bool(*n, r.path("async"), d)) c.async = *v;
  }
  if (const ConfigNode* n = r.get("group_readable")) {
    if (auto v = read_bool(*n, r.path("group_readable"), d)) c.group_readable = *v;
  }
  r.finish();
}

void read_launcher(MapReader& r, LauncherConfig& l) {
  Diagnostics& d = r.diagnostics();
  for (auto [key, target] : {std::pair{"prefix", &l.prefix}, std::pair{"mpirun_args", &l.mpirun_args}}) {
    const ConfigNode* n = r.get(key);
    if (n == nullptr) continue;
    if (auto list = read_string_list(*n, r.path(key), d)) {
      for (std::size_t i = 0; i < list->size(); ++i) {
        if ((*list)[i].empty() || (*list)[i].find_first_of(std::string("\0\n", 2)) != std::string::npos) {
          report(n->items()[i], r.path(key) + "[" + std::to_string(i) + "]", d,
                 "must be a non-empty argument without newlines, got " + describe(n->items()[i]));
        } else {
          target->push_back((*list)[i]);
        }
      }
    }
  }
  if (const ConfigNode* n = r.get("hang_timeout")) {
    if (auto v = read_duration(*n, r.path("hang_timeout"), d, 1, kMaxCollectiveTimeout)) l.hang_timeout_seconds = *v;
  }
  r.finish();
}

void read_scheduler(MapReader& r, SchedulerConfig& s) {
  Diagnostics& d = r.diagnostics();
  if (const ConfigNode* n = r.get("type")) {
    if (auto v = read_choice(*n, r.path("type"), d, "scheduler", kSchedulerTypes)) s.type = *v;
  }
  const ConfigNode* partition = r.get("partition");
  const ConfigNode* queue = r.get("queue");
  const ConfigNode* qos = r.get("qos");
  if (partition != nullptr) {
    if (auto v = read_scheduler_name(*partition, r.path("partition"), d, false)) s.partition = *v;
  }
  if (queue != nullptr) {
    if (auto v = read_scheduler_name(*queue, r.path("queue"), d, true)) s.queue = *v;
  }
  if (const ConfigNode* n = r.get("account")) {
    if (auto v = read_scheduler_name(*n, r.path("account"), d, false)) s.account = *v;
  }
  if (qos != nullptr) {
    if (auto v = read_scheduler_name(*qos, r.path("qos"), d, false)) s.qos = *v;
  }
  if (s.type == SchedulerConfig::Type::kPbs && partition != nullptr) {
    report(*partition, r.path("partition"), d, "is a Slurm option; PBS calls it scheduler.queue");
  }
  if (s.type == SchedulerConfig::Type::kPbs && qos != nullptr) {
    report(*qos, r.path("qos"), d, "is a Slurm option that PBS does not have; remove it");
  }
  if (s.type == SchedulerConfig::Type::kSlurm && queue != nullptr) {
    report(*queue, r.path("queue"), d, "is a PBS option; Slurm calls it scheduler.partition");
  }
  const ConfigNode* limit = r.get("time_limit");
  if (limit != nullptr) {
    s.time_limit_seconds = read_duration(*limit, r.path("time_limit"), d, 60, kMaxTimeLimit);
  }
  const ConfigNode* grace = r.get("preemption_grace");
  if (grace != nullptr) {
    if (auto v = read_duration(*grace, r.path("preemption_grace"), d, 10, kMaxGrace)) {
      s.preemption_grace_seconds = *v;
    }
  }
  if (s.time_limit_seconds && s.preemption_grace_seconds >= *s.time_limit_seconds) {
    const ConfigNode& at = grace != nullptr ? *grace : *limit;
    report(at, r.path(grace != nullptr ? "preemption_grace" : "time_limit"), d,
           "preemption_grace (" + format_duration(s.preemption_grace_seconds) +
               ") must be shorter than time_limit (" + format_duration(*s.time_limit_seconds) +
               "), or the trial is asked to stop before it starts");
  }
  if (const ConfigNode* n = r.get("modules")) {
    if (auto list = read_string_list(*n, r.path("modules"), d)) {
      for (std::size_t i = 0; i < list->size(); ++i) {
        if (!full_match((*list)[i], "[A-Za-z0-9._+/-]+")) {
          report(n->items()[i], r.path("modules") + "[" + std::to_string(i) + "]", d,
                 "is not a module name (letters, digits and . _ + / -), got " +
                     describe(n->items()[i]));
        } else {
          s.modules.push_back((*list)[i]);
        }
      }
    }
  }
  s.environment = read_environment(r.get("environment"), r.path("environment"), d);
  if (const ConfigNode* n = r.get("extra_directives")) {
    if (auto list = read_string_list(*n, r.path("extra_directives"), d)) {
      for (std::size_t i = 0; i < list->size(); ++i) {
        if ((*list)[i].front() != '-') {
          report(n->items()[i], r.path("extra_directives") + "[" + std::to_string(i) + "]", d,
                 "must be an option such as --exclusive or -l place=scatter (without the "
                 "#SBATCH / #PBS prefix), got " + describe(n->items()[i]));
        } else {
          s.extra_directives.push_back((*list)[i]);
        }
      }
    }
  }
  r.finish();
}

// Cross-section checks that need several sections at once.
void check_hyperparameters(const ExperimentConfig& config, const ConfigNode& root, Diagnostics& d) {
  const ConfigNode* hps = root.find("hyperparameters");
  if (hps == nullptr) return;
  for (const auto& [name, hp] : config.hyperparameters) {
    const ConfigNode* node = hps->find(name);
    const std::string path = "hyperparameters." + name;
    if (config.searcher.name == Searcher::Name::kGrid && hp.count == 0 &&
        (hp.type == Hyperparameter::Type::kInt || hp.type == Hyperparameter::Type::kDouble ||
         hp.type == Hyperparameter::Type::kLog)) {
      report(*node, path, d,
             "the grid searcher needs `count` on every int, double and log range (how many grid "
             "points); add e.g. count: 4");
    }
    if (name == "global_batch_size" && hp.type == Hyperparameter::Type::kConst) {
      const std::string& text = hp.value.text();
      const auto value = hp.value.is_scalar() && !hp.value.quoted() ? detail::parse_int(text)
                                                                     : std::nullopt;
      // Not a multiple of the slots: each slot trains global // slots records a batch, and the
      // trial says so once when it starts (as Determined does).
      if (!value || *value < config.resources.slots_per_trial) {
        report(hp.value, path, d,
               "must be an integer of at least resources.slots_per_trial (" +
                   std::to_string(config.resources.slots_per_trial) + "), got " + describe(hp.value));
      }
    }
  }
}

}  // namespace

std::string_view to_string(LengthUnit unit) { return choice_name(kLengthUnits, unit); }

std::string_view to_string(Hyperparameter::Type type) {
  if (type == Hyperparameter::Type::kNested) return "nested";
  return choice_name(kHyperparameterTypes, type);
}

std::string_view to_string(Searcher::Name name) { return choice_name(kSearcherNames, name); }

std::string_view to_string(SchedulerConfig::Type type) { return choice_name(kSchedulerTypes, type); }
std::string_view to_string(GradientCompression compression) { return choice_name(kCompressions, compression); }

ExperimentConfig parse_experiment_config(const ConfigNode& root, Diagnostics& d) {
  ExperimentConfig config;
  if (!root.is_map()) {
    d.error(root.where(), "",
            root.is_null() ? "is empty; an experiment config needs at least name, entrypoint "
                             "and searcher (see docs/config-reference.md)"
                           : "must be a map of keys (name:, entrypoint:, ...), got " + root.kind_name());
    return config;
  }
  MapReader top(&root, "", d);

  if (const ConfigNode* n = top.require("name", "name: mnist-cnn")) {
    if (auto v = read_string(*n, "name", d)) {
      if (v->size() > kMaxNameLength) {
        report(*n, "name", d, "is " + std::to_string(v->size()) + " characters; keep it to " +
                                   std::to_string(kMaxNameLength));
      } else {
        config.name = *v;
      }
    }
  }
  if (const ConfigNode* n = top.get("description")) {
    if (auto v = read_string(*n, "description", d, true)) config.description = *v;
  }
  if (const ConfigNode* n = top.require("entrypoint", "entrypoint: ./my_trial")) {
    if (auto v = read_entrypoint(*n, "entrypoint", d)) config.entrypoint = *v;
  }
  if (const ConfigNode* n = top.get("hyperparameters")) {
    if (!n->is_null() && detail::expect_map(*n, "hyperparameters", d, "hyperparameters: {lr: 0.01}")) {
      config.hyperparameters = read_hyperparameters(*n, "hyperparameters", d, 0);
    }
  }
  {
    const ConfigNode* n = top.require(
        "searcher", "searcher: {name: single, metric: validation_loss, max_length: {batches: 1000}}");
    if (n != nullptr && detail::expect_map(*n, "searcher", d,
                                           "searcher: {name: single, metric: validation_loss, "
                                           "max_length: {batches: 1000}}")) {
      MapReader r(n, "searcher", d);
      read_searcher(r, config.searcher);
    }
  }
  if (const ConfigNode* n = top.get("records_per_epoch")) {
    if (auto v = read_int(*n, "records_per_epoch", d, 1, kMaxLength)) config.records_per_epoch = *v;
  }
  const std::vector<LengthUnit> period_units = {LengthUnit::kBatches, LengthUnit::kEpochs,
                                                LengthUnit::kRecords, LengthUnit::kSeconds};
  if (const ConfigNode* n = top.get("min_validation_period")) {
    config.min_validation_period = read_length(*n, "min_validation_period", d, period_units);
  }
  if (const ConfigNode* n = top.get("min_checkpoint_period")) {
    config.min_checkpoint_period = read_length(*n, "min_checkpoint_period", d, period_units);
  }

  struct Section {
    const char* key;
    const char* example;
    std::function<void(MapReader&)> read;
  };
  const Section sections[] = {
      {"resources", "resources: {slots_per_trial: 4}",
       [&](MapReader& r) { read_resources(r, config.resources); }},
      {"optimizations", "optimizations: {aggregation_frequency: 2}",
       [&](MapReader& r) { read_optimizations(r, config.optimizations); }},
      {"reproducibility", "reproducibility: {experiment_seed: 42}",
       [&](MapReader& r) {
         if (const ConfigNode* n = r.get("experiment_seed")) {
           if (auto v = read_int(*n, r.path("experiment_seed"), d, 0, 4294967295LL)) {
             config.reproducibility.experiment_seed = static_cast<std::uint32_t>(*v);
           }
         }
         r.finish();
       }},
      {"checkpoint_storage", "checkpoint_storage: {host_path: /scratch/me/checkpoints}",
       [&](MapReader& r) { read_checkpoint_storage(r, config.checkpoint_storage); }},
      {"launcher", "launcher: {prefix: [numactl, --interleave=all]}",
       [&](MapReader& r) { read_launcher(r, config.launcher); }},
      {"scheduler", "scheduler: {type: slurm, partition: gpu, time_limit: 4h}",
       [&](MapReader& r) { read_scheduler(r, config.scheduler); }},
  };
  for (const auto& section : sections) {
    const ConfigNode* n = top.get(section.key);
    if (n == nullptr || n->is_null()) continue;
    if (!detail::expect_map(*n, section.key, d, section.example)) continue;
    MapReader r(n, section.key, d);
    section.read(r);
  }

  if (const ConfigNode* n = top.get("max_restarts")) {
    if (auto v = read_int(*n, "max_restarts", d, 0, kMaxRestarts)) config.max_restarts = static_cast<int>(*v);
  }
  if (const ConfigNode* n = top.get("data")) {
    if (n->is_null()) {
      config.data = ConfigNode::map(n->where());
    } else if (detail::expect_map(*n, "data", d, "data: {url: /scratch/me/mnist}")) {
      config.data = *n;
    }
  }
  config.environment = read_environment(top.get("environment"), "environment", d);
  top.finish();

  check_hyperparameters(config, root, d);
  return config;
}

ExperimentConfig load_experiment_config(const ConfigSources& sources) { return load_experiment_config(sources, ""); }

ExperimentConfig load_experiment_config(const ConfigSources& sources, const std::string& site_path) {
  Diagnostics d;
  ConfigNode root = load_config_file(sources.config_path, d);
  // Under the config: the template, then the site's defaults under both.
  for (const auto& [path, what] : {std::pair<std::string, const char*>{sources.template_path, "a template"},
                                   std::pair<std::string, const char*>{site_path, "a site's defaults file"}}) {
    if (path.empty()) continue;
    ConfigNode layer = load_config_file(path, d);
    if (!layer.is_null() && !layer.is_map()) {
      d.error(layer.where(), "", std::string(what) + " must be a map of keys, got " + layer.kind_name());
    }
    if (d.empty()) root = merge_template(layer, root);
  }
  for (const auto& assignment : sources.overrides) apply_override(root, assignment, d);
  // Problems with the YAML itself come first; the schema is only checked on a readable tree.
  d.throw_if_any();
  ExperimentConfig config = parse_experiment_config(root, d);
  d.sort();
  d.throw_if_any();
  config.source_path = sources.config_path;
  return config;
}

}  // namespace hpctrial::core
