#include "hpctrial/core/experiment_dir.h"

#include <filesystem>

namespace hpctrial::core {

std::string checkpoint_dir(const ExperimentConfig& config, const std::string& trial_dir, int trial_id) {
  namespace fs = std::filesystem;
  if (config.checkpoint_storage.host_path.empty()) return (fs::path(trial_dir) / "checkpoints").string();
  fs::path base(config.checkpoint_storage.host_path);
  if (base.is_relative() && !config.source_path.empty()) base = fs::path(config.source_path).parent_path() / base;
  return (base / ("trial-" + std::to_string(trial_id))).string();
}

}  // namespace hpctrial::core
