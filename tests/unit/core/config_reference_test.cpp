// docs/config-reference.md and the schema must list the same keys: every key a config can set
// is documented, and every documented key is accepted.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <regex>
#include <set>
#include <sstream>

#include "../../support/read_file.h"
#include "hpctrial/core/experiment_config.h"

namespace hpctrial::core {
namespace {

using testing_support::read_file;

// Key paths documented as the first cell of a table row: | `resources.slots_per_trial` | ...
std::set<std::string> documented_keys() {
  const std::string text = read_file(HPCTRIAL_SOURCE_DIR "/docs/config-reference.md");
  std::set<std::string> keys;
  const std::regex row(R"(^\| `([a-z_.A-Z0-9]+)` \|)");
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    std::smatch match;
    if (std::regex_search(line, match, row)) keys.insert(match[1]);
  }
  return keys;
}

// Sections whose inside is the user's own (free-form) or a one-key length map.
bool is_leaf_section(const std::string& path) {
  static const std::set<std::string> leaves = {
      "data", "environment", "scheduler.environment", "searcher.max_length",
      "min_validation_period", "min_checkpoint_period", "inference.progress_period",
      "checkpoint_levels.memory.period"};
  return leaves.count(path) > 0;
}

void collect(const ConfigNode& node, const std::string& path, std::set<std::string>& keys) {
  if (!path.empty()) keys.insert(path);
  if (path == "data" && node.is_map() && node.find("stage") != nullptr) {
    collect(*node.find("stage"), "data.stage", keys);  // hpctrial's one key among the user's
  }
  if (path == "environment" && node.is_map()) {
    for (const char* setting : {"image", "container_runtime", "bind", "environment_variables"}) {  // settings
      if (node.find(setting) != nullptr) keys.insert(std::string("environment.") + setting);
    }
  }
  if (!node.is_map() || is_leaf_section(path)) return;
  if (path == "hyperparameters") {
    // Typed hyperparameters document their keys as hyperparameters.NAME.<key>.
    for (const auto& hp : node.entries()) {
      if (hp.value.is_map() && hp.value.find("type") != nullptr) {
        for (const auto& field : hp.value.entries()) keys.insert("hyperparameters.NAME." + field.key);
      }
    }
    return;
  }
  for (const auto& entry : node.entries()) {
    collect(entry.value, path.empty() ? entry.key : path + "." + entry.key, keys);
  }
}

TEST(ConfigReference, DocumentsExactlyTheKeysOfTheSchema) {
  std::set<std::string> schema_keys;
  for (const char* name : {"every_key.yaml", "every_key_pbs.yaml", "every_key_fp16.yaml", "every_key_pipeline.yaml",
                           "every_key_asha.yaml", "every_key_halving.yaml", "every_key_inference.yaml",
                           "every_key_determined.yaml"}) {
    Diagnostics d;
    const ConfigNode root =
        load_config_file(std::string(HPCTRIAL_SOURCE_DIR "/tests/unit/core/data/") + name, d);
    ASSERT_TRUE(d.empty()) << d.to_string();
    parse_experiment_config(root, d, {"local", "slurm", "pbs"});
    ASSERT_TRUE(d.empty()) << name << " must be valid:\n" << d.to_string();
    collect(root, "", schema_keys);
  }
  const std::set<std::string> documented = documented_keys();
  for (const auto& key : schema_keys) {
    EXPECT_EQ(documented.count(key), 1u) << "docs/config-reference.md does not document " << key;
  }
  for (const auto& key : documented) {
    EXPECT_EQ(schema_keys.count(key), 1u)
        << "docs/config-reference.md documents " << key
        << ", which neither tests/unit/core/data/every_key*.yaml sets";
  }
}

// The first ```yaml block after `heading` in a Markdown file, parsed and validated.
ExperimentConfig example_config(const std::string& path, const std::string& heading) {
  const std::string text = read_file(path);
  const std::size_t section = text.find(heading);
  EXPECT_NE(section, std::string::npos) << heading;
  const std::size_t start = text.find("```yaml\n", section);
  EXPECT_NE(start, std::string::npos);
  const std::size_t end = text.find("```", start + 8);
  EXPECT_NE(end, std::string::npos);
  Diagnostics d;
  const ConfigNode root = parse_config_text(text.substr(start + 8, end - start - 8), path, d);
  const ExperimentConfig config = parse_experiment_config(root, d);
  EXPECT_TRUE(d.empty()) << d.to_string();
  return config;
}

TEST(ConfigReference, TheCompleteExampleIsValid) {
  const ExperimentConfig config =
      example_config(HPCTRIAL_SOURCE_DIR "/docs/config-reference.md", "## A complete example");
  EXPECT_EQ(config.resources.nodes(), 2);
}

TEST(ConfigReference, TheReadmeTourIsValid) {
  const ExperimentConfig config =
      example_config(HPCTRIAL_SOURCE_DIR "/README.md", "## A config in 20 lines");
  EXPECT_EQ(config.resources.nodes(), 2);
  EXPECT_EQ(config.scheduler.preemption_grace_seconds, 600);
}

}  // namespace
}  // namespace hpctrial::core
