#include "hpctrial/trainer/training_loop.h"

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <cstring>
#include <set>

#include "parallel/autocast.h"
#include "state/checkpointing.h"
#include "api/engine_access.h"
#include "parallel/zero.h"
#include "loop/loop.h"
#include "api/config_json.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/trainer/engine_trial.h"
#include "hpctrial/trainer/random.h"
#include "hpctrial/trainer/sampler.h"
#include "hpctrial/trainer/summary_writer.h"
#include "hpctrial/rank/runtime.h"
#include "observe/metrics_log.h"
#include "data/prefetcher.h"
#include "hpctrial/rank/stop_signals.h"

namespace hpctrial::trainer {
namespace detail {

using core::Length;
using core::LengthUnit;
using comm::Communicator;
using comm::DType;
using comm::ReduceOp;

namespace {

// Streams of the trial seed, one per consumer, so that adding a consumer changes no other.
constexpr std::uint64_t kDataStream = 2;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// A length in batches of `global_batch` records, with `records_per_epoch` records an epoch.
std::int64_t to_batches(const Length& length, std::int64_t global_batch, std::int64_t records_per_epoch) {
  switch (length.unit) {
    case LengthUnit::kBatches: return length.value;
    case LengthUnit::kRecords: return ceil_div(length.value, global_batch);
    case LengthUnit::kEpochs: return ceil_div(length.value * records_per_epoch, global_batch);
    case LengthUnit::kSeconds: break;
  }
  throw InternalError("to_batches: seconds are not a number of batches");
}

Period to_period(const std::optional<Length>& length, std::int64_t global_batch, std::int64_t rpe) {
  Period period;
  if (!length) return period;
  if (length->unit == LengthUnit::kSeconds) {
    period.seconds = static_cast<double>(length->value);
  } else {
    period.batches = std::max<std::int64_t>(1, to_batches(*length, global_batch, rpe));
  }
  return period;
}

}  // namespace

TrialSettings trial_settings(const core::ExperimentConfig& config, comm::Communicator& comm,
                             const nlohmann::json& hparams, std::uint64_t trial_seed) {
  TrialSettings settings;
  settings.hparams = hparams;
  settings.data_config = detail::to_json(config.data);
  settings.trial_seed = trial_seed;
  settings.aggregation_frequency = config.optimizations.aggregation_frequency;
  settings.adaptive_batch = config.optimizations.adaptive_batch_size.enabled;
  if (config.engine) resolve_engine_batch(config, comm, settings);
  settings.bucket_cap_mb = config.optimizations.bucket_cap_mb;
  settings.gradient_compression = config.optimizations.gradient_compression;
  settings.gpus_per_slot = config.resources.gpus_per_slot;
  if (config.profiling.enabled) {
    settings.profiler_window = ProfilerWindow{config.profiling.begin_on_batch, config.profiling.last_batch()};
  }
  core::Diagnostics d;
  settings.experiment_config = detail::to_json(core::parse_config_text(core::to_yaml(config), "config", d));
  settings.experiment_config["hyperparameters"] = settings.hparams;
  return settings;
}

TrialSettings Loop::make_trial_settings(std::uint64_t trial_seed) const {
  TrialSettings settings = trial_settings(config_, comm_, detail::trial_hparams(config_), trial_seed);
  settings.distributed = options_.distributed;
  settings.trial_id = options_.trial_id;
  settings.experiment_dir = options_.experiment_dir;
  if (chief()) settings.tensorboard_dir = core::TrialLayout{options_.trial_dir}.tensorboard_dir();
  return settings;
}

void Loop::setup() {
  faults_ = std::make_unique<rank::FaultPlan>(options_.fault, comm_.rank(), options_.restart_count);
  if (chief() && !options_.stop_file.empty()) stop_file_ = std::make_unique<rank::StopFile>(options_.stop_file);
  const std::uint64_t trial_seed = derive_seed(options_.experiment_seed, static_cast<std::uint64_t>(options_.trial_id));
  torch::manual_seed(derive_seed(trial_seed, kTorchSeedStream));

  TrialSettings settings = make_trial_settings(trial_seed);
  settings_hparams_ = settings.hparams;
  // Before the trial is built: its constructor may already write to TensorBoard.
  if (chief()) core::create_directories(options_.trial_dir, config_.checkpoint_storage.group_readable ? 0750 : 0700);
  context_ = std::make_unique<TrialContext>(std::move(settings), comm_, options_.device_communicator);
  trial_ = factory_(*context_);
  if (!trial_) throw ConfigError("the trial factory returned no trial");
  agree_on_model_parallelism();
  if (config_.engine && dynamic_cast<EngineTrialRunner*>(trial_.get()) == nullptr) {
    throw ConfigError("the experiment config has an engine section, which configures engine trials, but the trial "
                      "is a Trial; remove the section (a Trial's batch comes from hyperparameters.global_batch_size "
                      "and optimizations.aggregation_frequency) or derive the trial from EngineTrial");
  }
  if (const auto by_batch = TrialAccess::evaluates_by_batch(*trial_)) {
    evaluate_by_batch_ = *by_batch;
    evaluation_agreed_ = true;  // every rank runs the same class
  }
  train_loader_ = std::make_unique<DataLoader>(trial_->build_training_data_loader());
  validation_loader_ = std::make_unique<DataLoader>(trial_->build_validation_data_loader());
  callbacks_ = trial_->build_callbacks();
  reducers_ = trial_->evaluation_reducer();
  context_->start_training();

  global_batch_ = context_->global_batch_size();
  if (train_loader_->batch_size() != context_->per_slot_batch_size()) {
    throw ConfigError("build_training_data_loader: the batch size is " +
                      std::to_string(train_loader_->batch_size()) + " but per_slot_batch_size() is " +
                      std::to_string(context_->per_slot_batch_size()) +
                      " (global_batch_size / slots); use context.per_slot_batch_size()");
  }
  records_per_epoch_ = training_records_per_epoch();
  max_batches_ = to_batches(config_.searcher.max_length, global_batch_, records_per_epoch_);
  if (options_.search_in_place) {
    // 0: the log has the trial's rung already (recorded by the attempt before this one, which
    // failed as it ended): nothing is left to train.
    max_batches_ = search_length([&] { return options_.search_target(); });
    search_recorded_ = max_batches_ == 0;
  }
  validation_period_ = to_period(config_.min_validation_period, global_batch_, records_per_epoch_);
  checkpoint_period_ = to_period(config_.min_checkpoint_period, global_batch_, records_per_epoch_);
  if (config_.auto_checkpoint_period && !config_.min_checkpoint_period && chief()) {
    auto_checkpoint_ = std::make_unique<AutoCheckpointPeriod>(
        config_.checkpoint_storage.auto_overhead,
        static_cast<double>(config_.checkpoint_storage.auto_max_interval_seconds));
    checkpoint_period_.seconds = auto_checkpoint_->interval_s();
  }
  if (const auto experiment = experiment_identity()) {
    identity_.experiment_id = experiment->id;
    identity_.experiment_name = experiment->name;
  }
  identity_.config_yaml = core::to_yaml(config_);
  identity_.code_digest = options_.code_digest;
  identity_.hparams = settings_hparams_;
  identity_.trial_id = options_.trial_id;
  identity_.world_size = comm_.size();  // parts: agree_on_model_parallelism()
  identity_.searcher_metric = config_.searcher.metric;
  identity_.global_batch = global_batch_;
  setup_adaptive();
  open_memory_level();
  resume();

  data_seed_ = derive_seed(trial_seed, kDataStream);
  start_training_data(data_seed_);

  start_outputs();
  last_validation_time_ = Clock::now();
  last_checkpoint_time_ = Clock::now();
}

void Loop::train_one_batch() {
  const std::int64_t batch_idx = batches_trained_;
  rank::record_phase(core::RankPhase::kBatch);
  faults_->at(rank::FaultPhase::kBatch, batch_idx);
  comm_.set_step(batch_idx);
  if (adaptive_ && micro_in_step_ == 0) start_adaptive_step();
  // With an adaptive batch, epochs are statistical: a step ends one when its progress does.
  const std::int64_t epoch = adaptive_ ? step_epoch_ : epoch_of_batch(batch_idx);
  const bool epoch_start = adaptive_ ? micro_in_step_ == 0 && epoch != last_started_epoch_
                                     : batch_idx == 0 || epoch_of_batch(batch_idx - 1) != epoch;
  // An adaptive step's end is foreseen with the gain known now, and decided with its own, once its
  // gradients are measured (fold_norms).
  bool epoch_end = adaptive_ ? micro_in_step_ + 1 == loop_accumulation() &&
                                         adaptive_->epoch_after_step() != epoch
                                   : epoch_of_batch(batch_idx + 1) != epoch;
  if (epoch_start) {
    last_started_epoch_ = epoch;
    call([&](Callback& c) { c.on_training_epoch_start(epoch); });
  }

  Batch batch;
  {
    detail::PhaseTimings::Scope t(timings_, "dataloader_next");
    batch = prefetcher_->next();
    if (stream_reader_) stream_trained_ = stream_reader_->take_position();
  }
  {
    detail::PhaseTimings::Scope t(timings_, "to_device");
    batch = context_->to_device(batch);
  }
  context_->set_loop_position(epoch_start, epoch_end, batch_idx);
  Metrics metrics;
  {
    detail::PhaseTimings::Scope t(timings_, "train_batch");
    const detail::AutocastScope autocast(context_->device(), context_->mixed_precision());
    metrics = trial_->train_batch(batch, epoch, batch_idx);
  }
  for (const auto& scaler : context_->scalers()) scaler->update();  // once the batch's optimizers stepped
  // No kernel per step: the period's values are kept and summed once per report.
  for (auto& [name, metric] : metrics) {
    if (!metric.is_scalar()) {
      throw ConfigError("train_batch returned the metric '" + name + "' with shape " +
                        c10::str(metric.tensor().sizes()) + "; a training metric is one number a batch (averaged over "
                        "a reporting period): reduce it (e.g. .mean()), or report it from evaluate_batch or a reducer");
    }
    period_values_[name].push_back(metric.tensor());
  }
  ++period_batches_;
  ++batches_trained_;
  if (adaptive_) epoch_end = end_adaptive_micro_batch() && adaptive_->epoch() != epoch;
  step_lr_schedulers(epoch_end);
  if (epoch_end) {
    call([&](Callback& c) { c.on_training_epoch_end(epoch); });
    result_.epochs_trained = adaptive_ ? adaptive_->epoch() : epoch + 1;
  }
}

// Every rank's requests after the batch just trained, agreed on (the maximum over the ranks): a
// stop, the trial's stop, a validation by time, a checkpoint by time, a sharded checkpoint still
// being written, a sample of the system metrics.
std::array<std::int64_t, 8> Loop::agree_on_step_requests() {
  const bool time_to_validate =
      chief() && validation_period_.seconds > 0 &&
      std::chrono::duration<double>(Clock::now() - last_validation_time_).count() >= validation_period_.seconds;
  rank::record_step(batches_trained_);
  settle_checkpoint_cost();
  if (const auto* record = rank::RankRecord::current()) record->check();
  const bool stop_local = (options_.external_stop != nullptr && options_.external_stop->load()) ||
                          (stop_file_ && stop_file_->requested());
  const bool time_to_checkpoint =
      chief() && checkpoint_period_.seconds > 0 &&
      std::chrono::duration<double>(Clock::now() - last_checkpoint_time_).count() >= checkpoint_period_.seconds;
  const bool writing_shards = sharded_in_flight_ && !sharded_in_flight_->done();
  const bool copy_now = time_to_copy();
  // The chief's next copy would replace the one a checkpoint is being written from: every rank
  // holds its copy back (the partners exchange the same batches) until the checkpoint is durable.
  const bool hold_copy = chief() && memory_ && memory_->next_copy_would_wait(batches_trained_);
  std::array<std::int64_t, 8> flags = {stop_local ? 1 : 0, context_->get_stop_requested() ? 1 : 0,
                                       time_to_validate ? 1 : 0, time_to_checkpoint ? 1 : 0,
                                       writing_shards ? 1 : 0, time_to_sample_system() ? 1 : 0,
                                       copy_now ? 1 : 0, hold_copy ? 1 : 0};
  rank::record_phase(core::RankPhase::kAgreement);
  faults_->at(rank::FaultPhase::kAgreement, batches_trained_);
  comm_.allreduce(flags.data(), static_cast<int>(flags.size()), DType::kInt64, ReduceOp::kMax);
  return flags;
}

// Determined's rule: never between two batches whose gradients go to the same optimizer step
// (aggregation_frequency, an adaptive batch's micro-batches), only an epoch's end does.
void Loop::step_lr_schedulers(bool epoch_end) {
  detail::PhaseTimings::Scope t(timings_, "step_lr_schedulers");
  ++batches_since_optimizer_step_;
  const bool optimizer_stepped = group_end();
  for (const auto& wrapped : context_->lr_schedulers()) {
    std::int64_t steps = 0;
    if (wrapped.mode == StepMode::EveryEpoch) steps = epoch_end ? 1 : 0;
    if (wrapped.mode == StepMode::EveryBatch) steps = optimizer_stepped ? batches_since_optimizer_step_ : 0;
    if (wrapped.mode == StepMode::EveryOptimizerStep) steps = optimizer_stepped ? 1 : 0;
    for (; steps > 0; --steps) wrapped.scheduler->step();
  }
  if (optimizer_stepped) batches_since_optimizer_step_ = 0;
}

// The step boundary: batch-count triggers are the same on every rank; a stop request or a time
// trigger is agreed on, so that every rank takes the same branch here. True when training ends.
bool Loop::step_boundary() {
  const std::array<std::int64_t, 8> flags = agree_on_step_requests();
  if (flags[5] != 0) report_system();
  if (sharded_in_flight_ && flags[4] == 0) {
    with_chief_hooks([&] { settle_sharded_checkpoint(); });  // every rank's shard is durable
  }
  const bool last = reached_max_length();
  const bool group_end = this->group_end();
  if (adaptive_ && group_end) decide_adaptive_batch();
  const auto period_reached = [&](const Period& period) {
    if (adaptive_) return adaptive_period_reached(period);
    return period.batches > 0 && batches_trained_ % period.batches == 0;
  };
  const bool validate_now = flags[2] != 0 || period_reached(validation_period_);
  // Stops and checkpoints wait for the end of an aggregation group: the gradients accumulated
  // part way through one are in no checkpoint. Every rank agreed on the flags, so every rank
  // keeps the same pending requests.
  stop_pending_ = stop_pending_ || flags[0] != 0;
  trial_stop_pending_ = trial_stop_pending_ || flags[1] != 0;
  checkpoint_pending_ = checkpoint_pending_ || flags[3] != 0 || period_reached(checkpoint_period_);
  const bool stop = stop_pending_ && group_end && !last;
  const bool trial_ends = trial_stop_pending_ && group_end && !last;

  // Not at a stop: the period's values travel in the checkpoint, so that a resumed run reports
  // exactly what an uninterrupted one would.
  if (batches_trained_ - last_report_batches_ >= options_.report_period_batches || validate_now || last) {
    report_training();
  }
  if (validate_now && !last) with_chief_hooks([&] { validate(); });
  const std::int64_t check_period = config_.optimizations.replica_check_period;
  if (check_period > 0 && group_end && batches_trained_ % check_period == 0) {
    check_replicas("at batch " + std::to_string(batches_trained_));
  }
  if (stop) {
    save_checkpoint(/*wait=*/true);
  } else if (checkpoint_pending_ && group_end && !last && !trial_ends) {
    with_chief_hooks([&] {
      const auto started = Clock::now();
      save_checkpoint(/*wait=*/!config_.checkpoint_storage.async);
      note_checkpoint_stall(std::chrono::duration<double>(Clock::now() - started).count());
    });
  }
  if (memory_) {
    const core::Length& memory_period = config_.checkpoint_levels.memory_period;
    const bool counted = !config_.checkpoint_levels.memory_auto && memory_period.unit == core::LengthUnit::kBatches;
    memory_pending_ = memory_pending_ || flags[6] != 0 || (counted && batches_trained_ % memory_period.value == 0);
    // Not twice at a batch (a checkpoint written from a copy took this batch's already), and not
    // into the slot of a copy a checkpoint is still being written from: at a later boundary.
    if (last_memory_batches_ == batches_trained_) memory_pending_ = false;
    if (memory_pending_ && group_end && !stop && !last && !trial_ends && flags[7] == 0) save_memory_copy();
  }
  progress_->update(progress_batches(), trained_epoch(), last_loss_);
  if (profiler_) profiler_->after_batch(batches_trained_);
  if (stop) {
    result_.stopped_early = true;
    core::log_info("stop requested: stopping after batch {} of {}; checkpoint {}", batches_trained_, max_batches_,
                   result_.checkpoint_path.empty() ? "written by the chief" : result_.checkpoint_path);
    return true;
  }
  if (trial_ends) {
    // Determined's set_stop_requested: the trial is complete, validated and checkpointed below
    // like one that reached max_length, and nothing resumes it.
    result_.ended_by_trial = true;
    core::log_info("the trial asked to stop (set_stop_requested) after batch {} of {}: it ends here, complete",
                   batches_trained_, max_batches_);
    return true;
  }
  return false;
}

// After the last batch: the last validation and checkpoint unless stopped, the outputs closed.
LoopResult Loop::finish_run() {
  profiler_.reset();  // a window the run stopped inside of ends here
  rank::record_phase(core::RankPhase::kShutdown);
  // The checkpoint holds, and the trial's on_trial_shutdown sees, the same state on every rank.
  if (!result_.stopped_early && last_validation_batches_ != batches_trained_) with_chief_hooks([&] { validate(); });
  with_chief_hooks([&] {
    if (!result_.stopped_early && last_checkpoint_batches_ != batches_trained_) save_checkpoint(/*wait=*/true);
    settle_sharded_checkpoint();
    finish_checkpoint();
  });
  close_memory_level();  // the shared filesystem's checkpoint is durable: the copies are of no more use
  progress_->update(progress_batches(), trained_epoch(), last_loss_, true);
  progress_->finish();
  call([](Callback& c) { c.on_trial_shutdown(); });
  prefetcher_.reset();

  if (log_) {
    log_->write("timings", batches_trained_, trained_epoch(), records_trained(), {}, {{"timings", timings_.summary()}});
    log_->sync();
    context_->tensorboard_writer().flush();
    core::log_info("trained {} batches ({} records); timings:\n{}", batches_trained_, records_trained(),
                   timings_.table());
  }
  result_.batches_trained = batches_trained_;
  result_.timings = timings_.summary();
  if (auto_checkpoint_) {
    result_.auto_checkpoint_interval_s = checkpoint_period_.seconds;
    result_.auto_checkpoint_cost_s = auto_checkpoint_->cost_s().value_or(0);
  }
  return result_;
}

LoopResult Loop::run() {
  rank::record_phase(core::RankPhase::kStartup);
  setup();
  if (options_.external_stop == &rank::stop_signal_received()) {
    // The trial's constructor may have loaded a library that installs handlers of its own.
    const std::string replaced = rank::replaced_stop_handlers();
    if (!replaced.empty()) {
      core::log_warning("the handler of {} was replaced while the trial was set up; hpctrial installs its "
                        "own again so that stop requests reach the trial", replaced);
      rank::install_stop_handlers();
    }
  }
  faults_->at(rank::FaultPhase::kStartup, batches_trained_);
  call([](Callback& c) { c.on_training_start(); });
  for (auto& model : context_->models()) model->train();
  while (true) {
    while (!reached_max_length()) {
      if (profiler_) profiler_->before_batch(batches_trained_ + 1);
      train_one_batch();
      if (step_boundary()) break;
    }
    if (!options_.search_in_place || search_recorded_ || result_.stopped_early || !reached_max_length() ||
        !promoted_in_place()) {
      break;
    }
  }
  return finish_run();
}

// The chief's answer of the search log, a length in the unit of max_length (0: none), as
// batches on every rank.
std::int64_t Loop::search_length(const std::function<std::int64_t()>& ask) {
  std::int64_t batches = 0;
  if (chief()) {
    const std::int64_t length = ask();
    if (length > 0) batches = to_batches(core::Length{config_.searcher.max_length.unit, length}, global_batch_,
                                         records_per_epoch_);
  }
  comm_.broadcast_async(&batches, sizeof batches, 0)->wait();
  return batches;
}

// At a rung's end, as at a run's: validated and checkpointed (a trial that waits for a promotion
// resumes from that checkpoint); then the chief records the rung, and the ranks train on when the
// search promotes the trial at once.
bool Loop::promoted_in_place() {
  // A checkpoint past the rung's end is not of the training the log records: nothing is recorded
  // here, and the worker refuses it, naming both.
  if (!adaptive_ && batches_trained_ > max_batches_) return false;
  with_chief_hooks([&] {
    if (last_validation_batches_ != batches_trained_) validate();
  });
  with_chief_hooks([&] {
    if (last_checkpoint_batches_ != batches_trained_) save_checkpoint(/*wait=*/true);
    settle_sharded_checkpoint();
  });
  const std::int64_t next = search_length([&] {
    const auto it = result_.last_validation.find(config_.searcher.metric);
    const double metric = it != result_.last_validation.end() ? it->second.number() : std::nan("");
    return options_.search_rung_reached(metric);
  });
  if (next <= max_batches_) return false;
  if (chief()) core::log_info("promoted at batch {}: the trial trains on to batch {}", batches_trained_, next);
  max_batches_ = next;
  progress_->set_total(next);
  return true;
}

}  // namespace detail

LoopResult run_training(const core::ExperimentConfig& config, const TrialFactory& factory,
                        comm::Communicator& communicator, const LoopOptions& options) {
  detail::keep_batch_memory();
  detail::Loop loop(config, factory, communicator, options);
  const auto run = [&] {
    return config.inference ? detail::run_inference(config, factory, communicator, options) : loop.run();
  };
  if (!options.on_failure) return run();
  try {
    return run();
  } catch (const InvalidHP& e) {
    options.on_failure(core::kExitInvalidHP, std::string("the trial's hyperparameters are invalid: ") + e.what());
    throw;
  } catch (const ConfigError& e) {
    options.on_failure(core::kExitConfig, e.what());  // here, while every object of the loop lives
    throw;
  } catch (const std::exception& e) {
    options.on_failure(core::kExitFailed, e.what());
    throw;
  }
}

}  // namespace hpctrial::trainer
