// The launcher's decisions in a trial's launcher state (launcher_state.h).
#include "launcher_state.h"

#include "hpctrial/core/error.h"
#include "hpctrial/core/json_file.h"

namespace hpctrial::core::detail {
namespace {

using json = nlohmann::json;

std::optional<FailedHandOver> failed_hand_over_in(const json& state, const std::string& path) {
  const auto it = state.find(kFailedHandOverKey);
  if (it == state.end() || it->is_null()) return std::nullopt;
  if (!it->is_object()) {
    throw IoError(path + ": \"" + std::string(kFailedHandOverKey) + "\" holds " + it->dump() +
                  ", which is not an object; fix the file or remove it");
  }
  return FailedHandOver{json_field(*it, "time", std::string(), path), json_field(*it, "job", std::string(), path),
                        json_field(*it, "tries", 0, path), json_field(*it, "error", std::string(), path),
                        json_field(*it, "resume", std::string(), path)};
}

}  // namespace

void read_launcher_decisions(const json& state, const std::string& path, TrialProgress& p) {
  p.failed_hand_over = failed_hand_over_in(state, path);
  if (const auto left_out = state.find("excluded_nodes"); left_out != state.end() && left_out->is_array()) {
    for (const json& e : *left_out) {
      if (!e.is_object()) continue;
      p.excluded_nodes.push_back({json_field(e, "node", std::string(), path), json_field(e, "job", std::string(), path),
                                  json_field(e, "reason", std::string(), path) == "no_spare_left"});
    }
  }
  if (const auto spared = state.find("spared_nodes"); spared != state.end() && spared->is_array()) {
    for (const json& e : *spared) {
      if (!e.is_object()) continue;
      p.spared_nodes.push_back({json_field(e, "node", std::string(), path), json_field(e, "spare", std::string(), path),
                                json_field(e, "job", std::string(), path), json_field(e, "time", std::string(), path)});
    }
  }
}

}  // namespace hpctrial::core::detail
