// The pieces of the experiment schema (internal to core): its limits, the names of its
// enumerations, the readers of its values and of its sections. experiment_config.cpp puts them
// together; docs/config-reference.md documents the same keys, and a test checks that they agree.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config_values.h"
#include "hpctrial/core/experiment_config.h"

namespace hpctrial::core::detail {


// Limits that catch typos (an extra digit) long before any machine would.
inline constexpr std::int64_t kMaxSlots = 1 << 20;
inline constexpr std::int64_t kMaxCpusPerSlot = 4096;
inline constexpr std::int64_t kMaxGpusPerSlot = 64;
inline constexpr std::int64_t kMaxLength = std::int64_t{1} << 53;
inline constexpr std::int64_t kMaxTrials = 1000000;
inline constexpr std::int64_t kMaxRestarts = 100000;
inline constexpr std::int64_t kMaxAggregation = 1 << 20;
inline constexpr double kMaxBucketCapMb = 65536;
inline constexpr std::int64_t kMaxTimeLimit = 366LL * 86400;
// Slurm's --signal=SIG@TIME takes at most 65535 seconds.
inline constexpr std::int64_t kMaxGrace = 65535;
inline constexpr std::int64_t kMaxCollectiveTimeout = 7LL * 86400;
inline constexpr std::size_t kMaxNameLength = 128;

// The names of an enumeration as written in configs: one table per enum drives parsing,
// messages and to_string().
template <typename E>
struct Choice {
  const char* name;
  E value;
};

inline constexpr Choice<LengthUnit> kLengthUnits[] = {{"batches", LengthUnit::kBatches},
                                               {"epochs", LengthUnit::kEpochs},
                                               {"records", LengthUnit::kRecords},
                                               {"seconds", LengthUnit::kSeconds}};
inline constexpr Choice<Hyperparameter::Type> kHyperparameterTypes[] = {
    {"const", Hyperparameter::Type::kConst},   {"int", Hyperparameter::Type::kInt},
    {"double", Hyperparameter::Type::kDouble}, {"log", Hyperparameter::Type::kLog},
    {"categorical", Hyperparameter::Type::kCategorical}};
inline constexpr Choice<Searcher::Name> kSearcherNames[] = {{"single", Searcher::Name::kSingle},
                                                     {"grid", Searcher::Name::kGrid},
                                                     {"random", Searcher::Name::kRandom},
                                                     {"adaptive_asha", Searcher::Name::kAdaptiveAsha},
                                                     {"async_halving", Searcher::Name::kAsyncHalving}};
inline constexpr Choice<Searcher::Mode> kSearcherModes[] = {{"aggressive", Searcher::Mode::kAggressive},
                                                     {"standard", Searcher::Mode::kStandard},
                                                     {"conservative", Searcher::Mode::kConservative}};
inline constexpr Choice<GradientCompression> kCompressions[] = {{"none", GradientCompression::kNone},
                                                        {"fp16", GradientCompression::kFloat16},
                                                        {"bf16", GradientCompression::kBFloat16}};
inline constexpr Choice<ScalingRule> kScalingRules[] = {{"auto", ScalingRule::kAuto},
                                                     {"adascale", ScalingRule::kAdaScale},
                                                     {"adamscale", ScalingRule::kAdamScale},
                                                     {"linear", ScalingRule::kLinear},
                                                     {"sqrt", ScalingRule::kSqrt},
                                                     {"legw", ScalingRule::kLegw}};
enum class StorageType { kSharedFs };
inline constexpr Choice<StorageType> kStorageTypes[] = {{"shared_fs", StorageType::kSharedFs}};

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

bool full_match(const std::string& text, const char* pattern);

// Values.
std::optional<Length> read_length(const ConfigNode& node, const std::string& path, Diagnostics& d,
                                  const std::vector<LengthUnit>& units);
std::optional<std::int64_t> read_duration(const ConfigNode& node, const std::string& path, Diagnostics& d,
                                          std::int64_t min_seconds, std::int64_t max_seconds);
std::optional<std::string> read_scheduler_name(const ConfigNode& node, const std::string& path, Diagnostics& d,
                                               bool allow_empty);
// `settings`: keys of the map that are not variables (environment.image and its kin).
std::vector<EnvVar> read_environment(const ConfigNode* node, const std::string& path, Diagnostics& d,
                                     const std::vector<std::string>& settings = {});
std::optional<Entrypoint> read_entrypoint(const ConfigNode& node, const std::string& path, Diagnostics& d);
std::vector<std::pair<std::string, Hyperparameter>> read_hyperparameters(const ConfigNode& node,
                                                                         const std::string& path, Diagnostics& d,
                                                                         int depth);

// Sections.
void read_searcher(MapReader& r, Searcher& s);
// `inference:` (node), which takes the place of `searcher:` in `top` (config_inference.cpp).
void read_inference(MapReader& top, const ConfigNode& node, ExperimentConfig& config);
// launcher.startup_hook: a shell command (run by /bin/sh -c) or a command's words.
void read_startup_hook(MapReader& r, LauncherConfig& l);
// A path `key`, made absolute: relative to the file that sets it (a template's directory for a
// template's value), or to the working directory for --set.
void read_path(MapReader& r, const char* key, std::string& out);
void read_resources(MapReader& r, Resources& res);
void read_optimizations(MapReader& r, Optimizations& o);
void read_adaptive_batch(const ConfigNode& node, const std::string& path, Diagnostics& d, AdaptiveBatch& a);
void read_checkpoint_storage(MapReader& r, CheckpointStorage& c);
void read_checkpoint_levels(MapReader& r, CheckpointLevels& c);
void read_profiling(MapReader& r, Profiling& p);
void read_launcher(MapReader& r, LauncherConfig& l);
void read_scheduler(MapReader& r, SchedulerConfig& s);
void read_engine(MapReader& r, EngineConfig& e);
std::optional<EngineBatch> resolve_engine_batch_sizes(const EngineConfig& engine,
                                                      std::optional<std::int64_t> global_batch_size, int ranks,
                                                      std::string& error);
// Cross-section checks that need several sections at once.
void check_hyperparameters(const ExperimentConfig& config, const ConfigNode& root, Diagnostics& d);
void check_engine(const ExperimentConfig& config, const ConfigNode& root, Diagnostics& d);
void check_adaptive_batch(const ExperimentConfig& config, const ConfigNode& root, Diagnostics& d);

// The tree with the keys of Determined's config that mean something here (environment_variables,
// bind_mounts, the sections of `scheduler_sections`) written as hpctrial's own
// (config_reference_keys.cpp).
ConfigNode from_reference_keys(const ConfigNode& root, const std::vector<std::string>& scheduler_sections,
                               Diagnostics& d);

}  // namespace hpctrial::core::detail
