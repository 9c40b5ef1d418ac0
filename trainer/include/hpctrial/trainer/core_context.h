// For programs that are not trials (Determined's Core API): any MPI program can learn its place
// in the job, report metrics where hpctrial reports them, and stop together on a request.
//
//   int main(int argc, char** argv) {
//     hpctrial::CoreContext context(argc, argv);  // MPI, --config, --trial-dir, signals
//     for (std::int64_t step = 1; step <= steps; ++step) {
//       double loss = train_one_step();
//       if (step % 100 == 0) context.report_training_metrics(step, {{"loss", loss}});
//       if (context.should_stop()) break;         // the same answer on every rank
//     }
//   }
//
// Construct one CoreContext per process, first thing in main(): it initializes MPI. Collective
// calls (should_stop) must be made by every rank at the same points. Not thread-safe.
//
// Started by `hpctrial run` or a batch job (entrypoint: ./program), a program keeps the launcher's
// contract as a trial does: its collectives run under the watchdog
// (optimizations.collective_timeout), `hpctrial pause` reaches should_stop() through the stop
// file too, each report_*_metrics() call counts as progress for the launcher's hang watch
// (launcher.hang_timeout: report at least that often), and a rank that fails (abort(), or an
// exception that leaves the CoreContext's scope) ends the job at once instead of leaving its
// peers waiting for it.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/trainer/accumulator.h"
#include "hpctrial/trainer/metrics.h"
#include "hpctrial/trainer/trial_context.h"

namespace hpctrial::comm {
class Communicator;
class MpiEnvironment;
}  // namespace hpctrial::comm

namespace hpctrial::tensorboard {
class EventWriter;
}

namespace hpctrial::rank {
class RankBootstrap;
class StopFile;
}  // namespace hpctrial::rank

namespace hpctrial::trainer {

namespace detail {
class MetricsLog;
}  // namespace detail

class CoreContext {
 public:
  // Reads --config FILE (or $HPCTRIAL_CONFIG; optional), --set KEY=VALUE, --trial-dir DIR (or
  // $HPCTRIAL_TRIAL_DIR; default runs/<name> or runs/core), and removes them from argv so the
  // program sees only its own arguments. Throws ConfigError for a bad config or option.
  CoreContext(int& argc, char**& argv);
  ~CoreContext();
  CoreContext(const CoreContext&) = delete;
  CoreContext& operator=(const CoreContext&) = delete;

  const DistributedContext& distributed() const { return distributed_; }
  comm::Communicator& communicator() const;
  // The experiment config, when one was given.
  const core::ExperimentConfig* config() const { return config_ ? &*config_ : nullptr; }
  // Constant hyperparameters and the data: section (empty without a config).
  const nlohmann::json& hparams() const { return hparams_; }
  const nlohmann::json& data_config() const { return data_config_; }
  const std::string& trial_dir() const { return trial_dir_; }
  // How many times hpctrial's launcher restarted this trial before this run (0 outside it).
  int restart_count() const;

  // Writes one line to <trial dir>/metrics.jsonl, and the values to TensorBoard's event files
  // under <trial dir>/tensorboard/ ("training/<name>" at step `batches`). Only the chief's call
  // writes (reduce across ranks first if the values differ); other ranks' calls do nothing.
  void report_training_metrics(std::int64_t batches, const MetricValues& metrics);
  void report_validation_metrics(std::int64_t batches, const MetricValues& metrics);

  // Asks every rank to stop at the next should_stop().
  void request_stop() { stop_requested_ = true; }
  // Collective: true on every rank when any rank asked to stop or received SIGUSR1, SIGUSR2,
  // SIGTERM or SIGINT.
  bool should_stop();

  // --- state across restarts (AdaptDL's checkpoint-restart) ---------------------------------
  // An Accumulator (accumulator.h) saved by save_state(); make them in the same order on every rank.
  // `initial`: the sums it starts with, the same on every rank (AdaptDL's Accumulator(*args,
  // **kwargs)); a restored one's saved sums replace them.
  std::shared_ptr<Accumulator> make_accumulator(std::string name = {}, Accumulator::Values initial = {});

  // Epochs that survive restarts, as AdaptDL's remaining_epochs_until:
  //   for (std::int64_t epoch : context.remaining_epochs_until(30)) { ... }   // 0 .. 29
  //   for (std::int64_t epoch : context.remaining_epochs_until(60)) { ... }   // 30 .. 59
  // Epochs finished before the last save_state() are skipped; one that was running then runs
  // again from its start (the program resumes its data where it saved it: TrainingSampler::
  // set_epoch(epoch, index)). ConfigError when called while another such loop is running.
  class EpochRange;
  EpochRange remaining_epochs_until(std::int64_t epoch);
  // Marks a data loop while the guard lives, as iterating AdaptDL's AdaptiveDataLoader does: a
  // loop that resumes where save_state() left it (TrainingSampler::set_epoch with the saved
  // index), whose accumulator synchronizations are never replayed after a restart. Those
  // outside one are (accumulator.h):
  //   { auto loop = context.data_loop(); for (...) { ...; accum["loss"] += l; } }
  //   { auto guard = accum.synchronized(); ... }   // replayed, not run twice, after a restart
  class DataLoop;
  [[nodiscard]] DataLoop data_loop();
  // The epoch of the running remaining_epochs_until loop; none outside one.
  std::optional<std::int64_t> current_epoch() const { return current_epoch_; }
  // Epochs finished in remaining_epochs_until loops (this run and the saved ones before it).
  std::int64_t finished_epochs() const { return finished_epochs_; }

  // Collective: sums every accumulator's pending updates and saves the epochs, the accumulators
  // and the chief's `program_state` (whatever the program needs to resume: a step, the paths of
  // its own files, written before this call) to <trial dir>/core-state.json, atomically; returns
  // on every rank once the file is durable. A program saves when should_stop() is true, and as
  // often as it wants to lose no more than that on a crash.
  void save_state(const nlohmann::json& program_state = nullptr);
  // The program_state of the last save_state() of an earlier run of this trial; null when the
  // trial starts afresh.
  const nlohmann::json& restored_state() const { return restored_program_state_; }

  // Logs the message with rank and host and ends every rank of the job with `code`.
  [[noreturn]] void abort(int code, const std::string& message) const;

 private:
  std::unique_ptr<rank::RankBootstrap> rank_;
  std::unique_ptr<rank::StopFile> stop_file_;
  DistributedContext distributed_;
  std::optional<core::ExperimentConfig> config_;
  nlohmann::json hparams_ = nlohmann::json::object();
  nlohmann::json data_config_ = nlohmann::json::object();
  std::string trial_dir_;
  std::unique_ptr<tensorboard::EventWriter> events_;
  std::unique_ptr<detail::MetricsLog> log_;
  bool stop_requested_ = false;
  std::unique_ptr<detail::Accumulators> accumulators_;
  std::int64_t finished_epochs_ = 0;
  std::optional<std::int64_t> current_epoch_;
  detail::ReplayClock replay_clock_{&current_epoch_, 0};
  nlohmann::json restored_program_state_;

  void load_state();
};

// What remaining_epochs_until returns: a range of epochs; while it lives, current_epoch() is set
// inside its loop body, and leaving the loop (at the end, by break or by an exception) ends it;
// a break or an exception finishes the epoch it left (AdaptDL's rule).
class CoreContext::EpochRange {
 public:
  class Iterator {
   public:
    std::int64_t operator*() const { return *owner_->current_epoch_; }
    Iterator& operator++() {
      owner_->finished_epochs_ = *owner_->current_epoch_ + 1;
      owner_->current_epoch_.reset();
      return *this;
    }
    bool operator!=(const Iterator&) const {
      if (owner_->finished_epochs_ >= until_) return false;
      owner_->current_epoch_ = owner_->finished_epochs_;
      return true;
    }

   private:
    friend class EpochRange;
    Iterator(CoreContext* owner, std::int64_t until) : owner_(owner), until_(until) {}
    CoreContext* owner_;
    std::int64_t until_;
  };
  EpochRange(EpochRange&& other) noexcept : owner_(std::exchange(other.owner_, nullptr)), until_(other.until_) {}
  EpochRange& operator=(EpochRange&&) = delete;
  // Leaving the loop by a break or an exception finishes the epoch it left, as AdaptDL's does.
  ~EpochRange() {
    if (owner_ == nullptr || !owner_->current_epoch_) return;
    owner_->finished_epochs_ = *owner_->current_epoch_ + 1;
    owner_->current_epoch_.reset();
  }
  Iterator begin() const { return Iterator(owner_, until_); }
  Iterator end() const { return Iterator(owner_, until_); }

 private:
  friend class CoreContext;
  EpochRange(CoreContext* owner, std::int64_t until) : owner_(owner), until_(until) {}
  CoreContext* owner_;
  std::int64_t until_;
};

class CoreContext::DataLoop {
 public:
  DataLoop(DataLoop&& other) noexcept : clock_(std::exchange(other.clock_, nullptr)) {}
  DataLoop& operator=(DataLoop&&) = delete;
  ~DataLoop() {
    if (clock_ != nullptr) --clock_->data_loops;
  }

 private:
  friend class CoreContext;
  explicit DataLoop(detail::ReplayClock* clock) : clock_(clock) { ++clock_->data_loops; }
  detail::ReplayClock* clock_;
};

inline CoreContext::DataLoop CoreContext::data_loop() { return DataLoop(&replay_clock_); }

}  // namespace hpctrial::trainer
