#include "api/rank_identity.h"

#include <nlohmann/json.hpp>

#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"

namespace hpctrial::trainer::detail {

RankIdentity rank_identity(const std::string& experiment_dir, const std::string& trial_dir, const std::string& name,
                           comm::Communicator& world) {
  const std::string dir = experiment_dir.empty() ? trial_dir : experiment_dir;
  // The chief reads (or, alone, makes) it; every rank takes its answer, or its error.
  std::string answer;
  if (world.rank() == 0) {
    try {
      const core::ExperimentLayout layout{dir};
      core::ExperimentIdentity identity;
      if (experiment_dir.empty()) {
        core::create_directories(dir);
        identity = core::ensure_experiment_identity(layout, name);
      } else {
        identity = core::require_experiment_identity(layout);
      }
      answer = nlohmann::json{{"id", identity.id}, {"name", identity.name}, {"host_folder", identity.host_folder}}.dump();
    } catch (const Error& e) {
      answer = std::string("!") + e.what();
    }
  }
  world.broadcast(answer, 0);
  if (answer.empty() || answer.front() == '!') throw IoError(answer.empty() ? "no identity" : answer.substr(1));
  const auto j = nlohmann::json::parse(answer);
  return {{j.at("id").get<std::string>(), j.at("name").get<std::string>(), j.at("host_folder").get<std::string>()},
          dir};
}

}  // namespace hpctrial::trainer::detail
