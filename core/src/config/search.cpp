#include "hpctrial/core/search.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <stdexcept>

#include "hpctrial/core/config_node.h"
#include "hpctrial/core/diagnostics.h"
#include "hpctrial/core/error.h"

namespace hpctrial::core {
namespace {

using Type = Hyperparameter::Type;

bool is_range(const Hyperparameter& hp) {
  return hp.type == Type::kInt || hp.type == Type::kDouble || hp.type == Type::kLog || hp.type == Type::kCategorical;
}

// Every range, depth first in the order of the config, with its dotted name.
void collect(std::vector<std::pair<std::string, Hyperparameter>>& hps, const std::string& prefix,
             std::vector<std::pair<std::string, Hyperparameter*>>& out) {
  for (auto& [name, hp] : hps) {
    if (hp.type == Type::kNested) {
      collect(hp.nested, prefix + name + ".", out);
    } else if (is_range(hp)) {
      out.emplace_back(prefix + name, &hp);
    }
  }
}

std::string number_text(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", value);
  // Shortest text that reads back as the same double, so that 0.1 stays 0.1.
  for (int digits = 1; digits <= 17; ++digits) {
    char shorter[32];
    std::snprintf(shorter, sizeof shorter, "%.*g", digits, value);
    if (std::strtod(shorter, nullptr) == value) return shorter;
  }
  return text;
}

std::string integer_text(double value) { return std::to_string(static_cast<long long>(std::llround(value))); }

// The trial's own stream of random numbers: splitmix64 over (seed, trial id), the same on every
// platform (std's distributions are not).
class TrialRandom {
 public:
  TrialRandom(std::uint64_t seed, std::uint64_t trial) : state_(seed * 0x9E3779B97F4A7C15ULL ^ (trial + 1)) { next(); }
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  std::uint64_t below(std::uint64_t n) { return static_cast<std::uint64_t>(uniform() * static_cast<double>(n)) % n; }

 private:
  std::uint64_t state_;
};

ConfigNode sample(const Hyperparameter& hp, TrialRandom& random) {
  switch (hp.type) {
    case Type::kInt: {
      const auto lo = static_cast<long long>(std::llround(hp.minval));
      const auto span = static_cast<std::uint64_t>(std::llround(hp.maxval) - lo) + 1;
      return ConfigNode::scalar(std::to_string(lo + static_cast<long long>(random.below(span))));
    }
    case Type::kDouble:
      return ConfigNode::scalar(number_text(hp.minval + random.uniform() * (hp.maxval - hp.minval)));
    case Type::kLog:
      return ConfigNode::scalar(number_text(std::pow(hp.base, hp.minval + random.uniform() * (hp.maxval - hp.minval))));
    case Type::kCategorical:
      return hp.vals.at(random.below(hp.vals.size()));
    default:
      return hp.value;
  }
}

void make_constant(Hyperparameter& hp, ConfigNode value) {
  Hyperparameter constant;
  constant.type = Type::kConst;
  constant.value = std::move(value);
  hp = std::move(constant);
}

std::string searcher_name(const ExperimentConfig& config) {
  return "the " + std::string(to_string(config.searcher.name)) + " searcher" +
         (config.source_path.empty() ? "" : " of " + config.source_path);
}

// `config` with every range replaced by the constant of trial `trial_id` (trial_config).
ExperimentConfig with_constants(const ExperimentConfig& config, int trial_id) {
  ExperimentConfig out = config;
  std::vector<std::pair<std::string, Hyperparameter*>> ranges;
  collect(out.hyperparameters, "", ranges);
  if (ranges.empty() && trial_id == 0) return out;
  const int count = trial_ids(config);
  if (trial_id < 0 || trial_id >= count) {
    throw ConfigError("trial " + std::to_string(trial_id) + " does not exist: " + searcher_name(config) +
                      " makes " + std::to_string(count) + " trial(s), numbered 0 to " + std::to_string(count - 1));
  }
  switch (config.searcher.name) {
    case Searcher::Name::kSingle:
      throw ConfigError("hyperparameters." + ranges.front().first + " is a range (type: " +
                        std::string(to_string(ranges.front().second->type)) + "), but " + searcher_name(config) +
                        " runs one trial with constant values: give a constant (e.g. --set hyperparameters." +
                        ranges.front().first + "=VALUE), or use searcher.name grid or random");
    case Searcher::Name::kGrid: {
      // Mixed radix, the last range varying fastest.
      std::int64_t rest = trial_id;
      for (auto it = ranges.rbegin(); it != ranges.rend(); ++it) {
        auto points = grid_points(*it->second);
        const auto n = static_cast<std::int64_t>(points.size());
        make_constant(*it->second, points[static_cast<std::size_t>(rest % n)]);
        rest /= n;
      }
      return out;
    }
    case Searcher::Name::kRandom:
    case Searcher::Name::kAdaptiveAsha:  // each trial sampled as random samples it
    case Searcher::Name::kAsyncHalving: {
      if (!config.reproducibility.experiment_seed) {
        throw ConfigError(searcher_name(config) + " needs reproducibility.experiment_seed to choose each trial's "
                          "values; `hpctrial run` and `hpctrial submit` record one in the experiment directory");
      }
      TrialRandom random(*config.reproducibility.experiment_seed, static_cast<std::uint64_t>(trial_id));
      for (auto& [name, hp] : ranges) make_constant(*hp, sample(*hp, random));
      return out;
    }
  }
  return out;
}

// The constants under hyperparameters.engine, with their dotted paths below it.
void engine_leaves(const std::vector<std::pair<std::string, Hyperparameter>>& hps, const std::string& prefix,
                   std::vector<std::pair<std::string, const ConfigNode*>>& out) {
  for (const auto& [name, hp] : hps) {
    if (hp.type == Type::kNested) {
      engine_leaves(hp.nested, prefix + name + ".", out);
    } else {
      out.emplace_back(prefix + name, &hp.value);
    }
  }
}

// hyperparameters.engine (DeepSpeedTrial's overwrite_deepspeed_config): each of its constants
// replaces the engine section's key of the same path for this trial, so that a search ranges
// over engine.* keys; the trial's hparams keep them too. ConfigError naming the trial and the key
// for one the engine section has not or a value it refuses.
ExperimentConfig with_engine_hyperparameters(ExperimentConfig config, int trial_id) {
  const auto it = std::find_if(config.hyperparameters.begin(), config.hyperparameters.end(),
                               [](const auto& hp) { return hp.first == "engine"; });
  if (it == config.hyperparameters.end()) return config;
  const std::string what = "hyperparameters.engine of trial " + std::to_string(trial_id);
  if (it->second.type != Type::kNested) {
    throw ConfigError(what + " must be a map of engine keys, e.g. {zero_optimization: {stage: 2}}");
  }
  if (!config.engine) {
    throw ConfigError(what + " sets keys of the engine section, which this config has not; add `engine:` (an "
                      "EngineTrial's settings) or rename the hyperparameter");
  }
  std::vector<std::pair<std::string, const ConfigNode*>> leaves;
  engine_leaves(it->second.nested, "", leaves);
  Diagnostics d;
  ConfigNode root = parse_config_text(to_yaml(config), what, d);
  for (const auto& [path, value] : leaves) {
    ConfigNode* node = root.find("engine");
    std::size_t start = 0;
    for (std::size_t dot = path.find('.'); node != nullptr; dot = path.find('.', start)) {
      const std::string key = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      if (dot == std::string::npos) {
        node->set(key, *value);
        break;
      }
      if (node->find(key) == nullptr || !node->find(key)->is_map()) node->set(key, ConfigNode::map());
      node = node->find(key);
      start = dot + 1;
    }
  }
  ExperimentConfig merged = parse_experiment_config(root, d);
  if (!d.empty()) throw ConfigError(what + ": " + d.to_string());
  merged.source_path = config.source_path;
  return merged;
}

}  // namespace

ExperimentConfig trial_config(const ExperimentConfig& config, int trial_id) {
  return with_engine_hyperparameters(with_constants(config, trial_id), trial_id);
}

std::vector<ConfigNode> grid_points(const Hyperparameter& hp) {
  std::vector<ConfigNode> points;
  if (hp.type == Type::kCategorical) return hp.vals;
  if (!is_range(hp)) return {hp.value};
  const std::int64_t count = std::max<std::int64_t>(hp.count, 1);
  auto at = [&](std::int64_t i) {
    return count == 1 ? hp.minval : hp.minval + (hp.maxval - hp.minval) * static_cast<double>(i) / (count - 1);
  };
  if (hp.type == Type::kInt) {
    const auto lo = std::llround(hp.minval), hi = std::llround(hp.maxval);
    if (count >= hi - lo + 1) {
      for (long long v = lo; v <= hi; ++v) points.push_back(ConfigNode::scalar(std::to_string(v)));
      return points;
    }
    std::string last;
    for (std::int64_t i = 0; i < count; ++i) {
      std::string text = integer_text(at(i));
      if (text != last) points.push_back(ConfigNode::scalar(text));
      last = std::move(text);
    }
    return points;
  }
  for (std::int64_t i = 0; i < count; ++i) {
    const double x = at(i);
    points.push_back(ConfigNode::scalar(number_text(hp.type == Type::kLog ? std::pow(hp.base, x) : x)));
  }
  return points;
}

int trial_ids(const ExperimentConfig& config) {
  return trial_count(config) * (config.searcher.adaptive() ? 2 : 1);
}

int trial_count(const ExperimentConfig& config) {
  switch (config.searcher.name) {
    case Searcher::Name::kSingle:
      return 1;
    case Searcher::Name::kRandom:
    case Searcher::Name::kAdaptiveAsha:
    case Searcher::Name::kAsyncHalving:
      return static_cast<int>(config.searcher.max_trials);
    case Searcher::Name::kGrid: {
      ExperimentConfig copy = config;
      std::vector<std::pair<std::string, Hyperparameter*>> ranges;
      collect(copy.hyperparameters, "", ranges);
      std::int64_t n = 1;
      for (const auto& [name, hp] : ranges) {
        n *= static_cast<std::int64_t>(grid_points(*hp).size());
        if (n > 1000000) {
          throw ConfigError(searcher_name(config) + " spans more than a million trials; lower the `count` of "
                            "hyperparameters." + name + " or of the ranges before it");
        }
      }
      return static_cast<int>(n);
    }
  }
  return 1;
}

int search_workers(const ExperimentConfig& config) {
  if (!config.searcher.adaptive()) return 0;
  return static_cast<int>(std::min<std::int64_t>(config.searcher.max_concurrent_trials, config.searcher.max_trials));
}


}  // namespace hpctrial::core
