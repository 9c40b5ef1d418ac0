#include "api/config_json.h"

#include <cmath>
#include <cstdlib>
#include <regex>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer::detail {
namespace {

nlohmann::json scalar(const core::ConfigNode& node) {
  const std::string& t = node.text();
  if (node.quoted()) return t;
  if (t == "true" || t == "True" || t == "TRUE") return true;
  if (t == "false" || t == "False" || t == "FALSE") return false;
  static const std::regex integer("[-+]?[0-9]+");
  static const std::regex number(R"([-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?)");
  if (std::regex_match(t, integer)) {
    errno = 0;
    const long long value = std::strtoll(t.c_str(), nullptr, 10);
    if (errno != ERANGE) return static_cast<std::int64_t>(value);
  }
  if (std::regex_match(t, number)) {
    const double value = std::strtod(t.c_str(), nullptr);
    if (std::isfinite(value)) return value;
  }
  return t;
}

void add_hparams(const std::vector<std::pair<std::string, core::Hyperparameter>>& hps,
                 const std::string& prefix, nlohmann::json& out) {
  for (const auto& [name, hp] : hps) {
    switch (hp.type) {
      case core::Hyperparameter::Type::kConst:
        out[name] = to_json(hp.value);
        break;
      case core::Hyperparameter::Type::kNested:
        out[name] = nlohmann::json::object();
        add_hparams(hp.nested, prefix + name + ".", out[name]);
        break;
      default:
        throw ConfigError(
            "hyperparameters." + prefix + name + " is a range (type: " +
            std::string(core::to_string(hp.type)) +
            "); running one trial needs a value for it: give a constant, e.g. --set "
            "hyperparameters." + prefix + name + "=VALUE");
    }
  }
}

}  // namespace

nlohmann::json to_json(const core::ConfigNode& node) {
  switch (node.kind()) {
    case core::ConfigNode::Kind::kNull:
      return nullptr;
    case core::ConfigNode::Kind::kScalar:
      return scalar(node);
    case core::ConfigNode::Kind::kSequence: {
      nlohmann::json out = nlohmann::json::array();
      for (const auto& item : node.items()) out.push_back(to_json(item));
      return out;
    }
    case core::ConfigNode::Kind::kMap: {
      nlohmann::json out = nlohmann::json::object();
      for (const auto& entry : node.entries()) out[entry.key] = to_json(entry.value);
      return out;
    }
  }
  return nullptr;
}

nlohmann::json trial_hparams(const core::ExperimentConfig& config) {
  nlohmann::json out = nlohmann::json::object();
  add_hparams(config.hyperparameters, "", out);
  return out;
}

}  // namespace hpctrial::trainer::detail
