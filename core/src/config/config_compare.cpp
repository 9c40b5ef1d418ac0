// Two effective configs compared key by key, and which keys a later run of an experiment may
// change (experiment_config.h: config_differences, is_run_setting).
#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "hpctrial/core/config_compare.h"
#include "hpctrial/core/config_node.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_config.h"

namespace hpctrial::core {
namespace {

// The tree of a config as it is written (to_yaml: every key present, in one order).
ConfigNode tree_of(const ExperimentConfig& config, const std::string& what) {
  Diagnostics diagnostics;
  ConfigNode root = parse_config_text(to_yaml(config), what, diagnostics);
  if (!diagnostics.empty()) throw ConfigError(diagnostics.to_string());
  return root;
}

// A value on one line, for a message.
std::string one_line(const ConfigNode* node) {
  if (node == nullptr) return "(none)";
  if (node->is_scalar()) return node->quoted() ? "\"" + node->text() + "\"" : node->text();
  if (node->is_null()) return "null";
  std::string text = node->to_yaml();
  std::string out;
  bool space = false;
  for (char c : text) {
    if (c == '\n' || c == ' ') {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += c;
  }
  return out;
}

bool same(const ConfigNode& a, const ConfigNode& b) {
  if (a.kind() != b.kind()) return false;
  if (a.is_scalar()) return a.text() == b.text() && a.quoted() == b.quoted();
  return a.to_yaml() == b.to_yaml();
}

void compare(const std::string& key, const ConfigNode* a, const ConfigNode* b, std::vector<ConfigDifference>& out) {
  if (a != nullptr && b != nullptr && a->is_map() && b->is_map()) {
    std::vector<std::string> keys;
    for (const auto& e : a->entries()) keys.push_back(e.key);
    for (const auto& e : b->entries()) {
      if (std::find(keys.begin(), keys.end(), e.key) == keys.end()) keys.push_back(e.key);
    }
    for (const auto& k : keys) compare(key.empty() ? k : key + "." + k, a->find(k), b->find(k), out);
    return;
  }
  if (a != nullptr && b != nullptr && same(*a, *b)) return;
  out.push_back({key, one_line(a), one_line(b)});
}

// `key` is `prefix` or lies below it.
bool under(std::string_view key, std::string_view prefix) {
  return key == prefix || (key.size() > prefix.size() && key.substr(0, prefix.size()) == prefix &&
                           key[prefix.size()] == '.');
}

}  // namespace

std::vector<ConfigDifference> config_differences(const ExperimentConfig& recorded, const ExperimentConfig& given) {
  const ConfigNode a = tree_of(recorded, "the recorded config");
  const ConfigNode b = tree_of(given, "the given config");
  std::vector<ConfigDifference> out;
  compare("", &a, &b, out);
  return out;
}

bool is_run_setting(std::string_view key, const ExperimentConfig& config) {
  // Where and how the trials run, how often they are saved, how long a trial trains without a
  // search to depend on it: a run resumes under other values of these.
  static constexpr std::string_view kRunSettings[] = {
      "description",
      "resources",
      "scheduler",
      "launcher",
      "max_restarts",
      "environment",
      "profiling",
      "min_checkpoint_period",
      "checkpoint_levels",
      "data.stage",
      "scheduling_unit",
      // An inference run's rows are by record: how many it predicts at once and how often it
      // records its progress change nothing it writes.
      "inference.batch_size",
      "inference.progress_period",
      "checkpoint_storage.save_trial_best",
      "checkpoint_storage.save_trial_latest",
      "checkpoint_storage.async",
      "checkpoint_storage.auto_overhead",
      "checkpoint_storage.auto_max_interval",
      "checkpoint_storage.group_readable",
      "optimizations.collective_timeout",
      "optimizations.network_interface",
      "optimizations.bucket_cap_mb",
      "optimizations.replica_check_period",
      "optimizations.huge_pages",
      // The engine's shape: a resumed engine trial keeps train_batch_size on other ranks, stages
      // and shards.
      "engine.train_micro_batch_size_per_gpu",
      "engine.gradient_accumulation_steps",
      "engine.zero_optimization",
      "engine.pipeline",
  };
  for (std::string_view prefix : kRunSettings) {
    if (under(key, prefix)) return true;
  }
  // A trial of a search without rungs may be trained on for longer; an adaptive search's rungs
  // are cut from max_length.
  return under(key, "searcher.max_length") && !config.searcher.adaptive();
}

}  // namespace hpctrial::core
