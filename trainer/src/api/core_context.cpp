#include "hpctrial/trainer/core_context.h"

#include <chrono>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "api/config_json.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/tensorboard/event_writer.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/search.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/mpi_environment.h"
#include "hpctrial/core/launch_contract.h"
#include "api/rank_identity.h"
#include "data/staging.h"
#include "observe/metrics_log.h"
#include "hpctrial/rank/bootstrap.h"
#include "hpctrial/rank/stop_signals.h"

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
  core::ProcessEnv env;
  rank_ = std::make_unique<rank::RankBootstrap>(env);
  rank_->start_mpi(&argc, &argv);
  rank_->start_record();
  const core::RankContract& contract = rank_->contract();
  const comm::MpiEnvironment& mpi = rank_->mpi();
  distributed_ = {mpi.rank(), mpi.size(), mpi.local_rank(), mpi.local_size(), mpi.node_count(), mpi.node_index()};

  core::ConfigSources sources;
  for (const auto& [name, value] : take_options(argc, argv)) {
    if (name == "--config") sources.config_path = value;
    else if (name == "--set") sources.overrides.push_back(value);
    else trial_dir_ = value;
  }
  if (sources.config_path.empty()) sources.config_path = contract.config;
  if (!sources.config_path.empty()) {
    config_ = core::rank_config(core::load_experiment_config(sources), contract);
    hparams_ = detail::trial_hparams(*config_);
    data_config_ = detail::to_json(config_->data);
  } else if (!sources.overrides.empty()) {
    throw ConfigError("--set needs an experiment config: give --config EXP.yaml");
  }
  if (trial_dir_.empty()) trial_dir_ = contract.trial_dir;
  if (trial_dir_.empty()) trial_dir_ = core::default_experiment_dir(config_ ? config_->name : "core");
  const core::ExperimentConfig defaults;
  rank_->start_communicator(std::chrono::seconds(
      (config_ ? *config_ : defaults).optimizations.collective_timeout_seconds));
  if (config_ && config_->stage.to != core::DataStage::To::kNone) {
    // The effective config keeps the paths as written; the program's data config names the copies.
    core::ExperimentConfig staged = *config_;
    const detail::RankIdentity identity =
        detail::rank_identity(contract.experiment_dir, trial_dir_, config_->name, rank_->communicator());
    detail::stage_data(staged, rank_->communicator(), distributed_.local_rank == 0,
                       detail::stage_owner(identity.identity, contract.trial_id), core::host_name(),
                       mpi.node_index());
    data_config_ = detail::to_json(staged.data);
  }
  if (distributed_.is_chief()) {
    core::create_directories(trial_dir_);
    const core::TrialLayout trial{trial_dir_};
    log_ = std::make_unique<detail::MetricsLog>(trial.metrics_file());
    events_ = std::make_unique<tensorboard::EventWriter>(trial.tensorboard_dir());
    log_->set_events(events_.get());
    if (config_) core::write_file_atomic(trial.effective_config(), core::to_yaml(*config_));
    if (!contract.stop_file.empty()) stop_file_ = std::make_unique<rank::StopFile>(contract.stop_file);
  }
  rank::install_stop_handlers();
  accumulators_ = std::make_unique<detail::Accumulators>(rank_->communicator(), &replay_clock_);
  load_state();
}

// The chief reads the saved state and every rank parses the same bytes: all start alike, or
// all fail alike.
void CoreContext::load_state() {
  const std::string path = core::TrialLayout{trial_dir_}.core_state_file();
  std::string text;
  if (distributed_.is_chief() && std::filesystem::exists(path)) {
    std::ifstream in(path, std::ios::binary);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) text = "!";  // unreadable: reported below, on every rank
  }
  rank_->communicator().broadcast(text, 0);
  if (text.empty()) return;
  try {
    const nlohmann::json state = nlohmann::json::parse(text);
    finished_epochs_ = state.at("finished_epochs").get<std::int64_t>();
    if (finished_epochs_ < 0) throw ConfigError("finished_epochs is negative");
    accumulators_->load_state_dict(state.at("accumulators"));
    restored_program_state_ = state.at("program_state");
  } catch (const std::exception& e) {
    throw CheckpointError(path + " is not a state hpctrial saved (" + e.what() +
                          "); remove it to start the program afresh");
  }
}

void CoreContext::save_state(const nlohmann::json& program_state) {
  accumulators_->synchronize_all();
  std::string error;
  if (distributed_.is_chief()) {
    const nlohmann::json state = {{"finished_epochs", finished_epochs_},
                                  {"accumulators", accumulators_->state_dict()},
                                  {"program_state", program_state}};
    try {
      core::write_file_atomic(core::TrialLayout{trial_dir_}.core_state_file(), state.dump(1) + "\n");
    } catch (const Error& e) {
      error = e.what();
    }
  }
  // Nobody goes on (or exits) before the state is durable, and a failure fails every rank.
  rank_->communicator().broadcast(error, 0);
  if (!error.empty()) throw IoError("the program's state was not saved: " + error);
}

std::shared_ptr<Accumulator> CoreContext::make_accumulator(std::string name, Accumulator::Values initial) {
  return accumulators_->make(std::move(name), std::move(initial));
}

CoreContext::EpochRange CoreContext::remaining_epochs_until(std::int64_t epoch) {
  if (current_epoch_) {
    throw ConfigError("remaining_epochs_until(" + std::to_string(epoch) + ") was called inside the loop of another "
                      "(in epoch " + std::to_string(*current_epoch_) + "); end that loop first");
  }
  return EpochRange(this, epoch);
}

CoreContext::~CoreContext() {
  if (std::uncaught_exceptions() > 0 && !rank_->alone()) {
    // The program is failing on this rank: its peers may wait for it in a collective.
    rank_->abort(core::kExitFailed, "an exception left the scope of hpctrial::CoreContext; ending the job");
  }
  log_.reset();
  events_.reset();
  if (std::uncaught_exceptions() == 0) rank_->finish();  // every rank got here: the goodbyes
  rank_.reset();
}

comm::Communicator& CoreContext::communicator() const { return rank_->communicator(); }

int CoreContext::restart_count() const { return rank_->contract().restart_count; }

void CoreContext::report_training_metrics(std::int64_t batches, const MetricValues& metrics) {
  rank::record_step(batches);
  if (log_) log_->write("training", batches, 0, 0, metrics);
  if (events_) events_->flush();
}

void CoreContext::report_validation_metrics(std::int64_t batches, const MetricValues& metrics) {
  rank::record_step(batches);
  if (log_) log_->write("validation", batches, 0, 0, metrics);
  if (events_) events_->flush();
}

bool CoreContext::should_stop() {
  const bool local = stop_requested_ || rank::stop_signal_received().load() ||
                     (stop_file_ && stop_file_->requested());
  return rank_->communicator().any(local);
}

void CoreContext::abort(int code, const std::string& message) const { rank_->abort(code, message); }

}  // namespace hpctrial::trainer
