#include "hpctrial/trainer/core_context.h"

#include <cstring>
#include <filesystem>
#include <vector>

#include "config_json.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/search.h"
#include "hpctrial/mpi_launcher/communicator.h"
#include "hpctrial/mpi_launcher/mpi_environment.h"
#include "metrics_log.h"
#include "stop_signals.h"

namespace hpctrial::trainer {
namespace {

// Takes hpctrial's options out of argv (`--name VALUE` or `--name=VALUE`), leaving the rest.
std::vector<std::pair<std::string, std::string>> take_options(int& argc, char**& argv) {
  static const char* names[] = {"--config", "--set", "--trial-dir"};
  std::vector<std::pair<std::string, std::string>> taken;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    bool matched = false;
    for (const char* name : names) {
      const std::string prefix = std::string(name) + "=";
      if (arg == name) {
        if (i + 1 >= argc) throw ConfigError(std::string(name) + " needs a value");
        taken.emplace_back(name, argv[++i]);
        matched = true;
      } else if (arg.rfind(prefix, 0) == 0) {
        taken.emplace_back(name, arg.substr(prefix.size()));
        matched = true;
      }
      if (matched) break;
    }
    if (!matched) argv[out++] = argv[i];
  }
  argc = out;
  argv[argc] = nullptr;
  return taken;
}

}  // namespace

CoreContext::CoreContext(int& argc, char**& argv) {
  mpi_ = std::make_unique<mpi_launcher::MpiEnvironment>(&argc, &argv);
  if (mpi_->size() == 1) {
    communicator_ = std::make_unique<mpi_launcher::LocalCommunicator>();
  } else {
    communicator_ = std::make_unique<mpi_launcher::MpiCommunicator>(mpi_->world());
  }
  distributed_ = {mpi_->rank(), mpi_->size(), mpi_->local_rank(), mpi_->local_size(), mpi_->node_count()};

  core::ProcessEnv env;
  core::ConfigSources sources;
  for (const auto& [name, value] : take_options(argc, argv)) {
    if (name == "--config") sources.config_path = value;
    else if (name == "--set") sources.overrides.push_back(value);
    else trial_dir_ = value;
  }
  if (sources.config_path.empty()) sources.config_path = env.get("HPCTRIAL_CONFIG").value_or("");
  if (!sources.config_path.empty()) {
    config_ = core::trial_config(core::load_experiment_config(sources),
                                 core::trial_id_from_env(env.get("HPCTRIAL_TRIAL_ID")));
    hparams_ = detail::trial_hparams(*config_);
    data_config_ = detail::to_json(config_->data);
  } else if (!sources.overrides.empty()) {
    throw ConfigError("--set needs an experiment config: give --config EXP.yaml");
  }
  if (trial_dir_.empty()) trial_dir_ = env.get("HPCTRIAL_TRIAL_DIR").value_or("");
  if (trial_dir_.empty()) trial_dir_ = (std::filesystem::path("runs") / (config_ ? config_->name : "core")).string();
  if (distributed_.is_chief()) {
    core::create_directories(trial_dir_);
    log_ = std::make_unique<detail::MetricsLog>((std::filesystem::path(trial_dir_) / "metrics.jsonl").string());
    if (config_) {
      core::write_file_atomic((std::filesystem::path(trial_dir_) / "effective-config.yaml").string(),
                              core::to_yaml(*config_));
    }
  }
  detail::install_stop_handlers();
}

CoreContext::~CoreContext() {
  log_.reset();
  communicator_.reset();
  mpi_.reset();
}

void CoreContext::report_training_metrics(std::int64_t batches, const MetricValues& metrics) {
  if (log_) log_->write("training", batches, 0, 0, metrics);
}

void CoreContext::report_validation_metrics(std::int64_t batches, const MetricValues& metrics) {
  if (log_) log_->write("validation", batches, 0, 0, metrics);
}

bool CoreContext::should_stop() {
  const bool local = stop_requested_ || detail::stop_signal_received().load();
  return communicator_->any(local);
}

void CoreContext::abort(int code, const std::string& message) const { mpi_->abort(code, message); }

}  // namespace hpctrial::trainer
