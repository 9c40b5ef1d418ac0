// Where a trial's checkpoints are, which one it resumes from, and how often it checkpoints.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <utility>

#include <fmt/core.h>

#include "state/checkpointing.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/logging.h"
#include "loop/loop.h"
#include "api/engine_access.h"
#include "parallel/zero.h"

namespace hpctrial::trainer::detail {

checkpoint::CheckpointStore::Loaded load_chosen_checkpoint(const std::string& path, comm::Communicator& comm) {
  checkpoint::CheckpointStore::Loaded loaded;
  std::string chosen;
  if (comm.is_chief()) {
    try {
      loaded = checkpoint::load_checkpoint_at(path);
      chosen = loaded.path;
    } catch (const Error& e) {
      chosen = "!" + std::string(e.what());
    }
  }
  comm.broadcast(chosen, 0);
  if (!chosen.empty() && chosen.front() == '!') throw CheckpointError(chosen.substr(1));
  if (!comm.is_chief()) {
    loaded.path = chosen;
    loaded.contents = checkpoint::read_checkpoint(chosen);
  }
  return loaded;
}

checkpoint::CheckpointStore::Loaded load_source_checkpoint(const std::string& path, std::optional<int> trial_id,
                                                           const std::string& key, comm::Communicator& comm) {
  std::string chosen = path;
  std::string error;
  if (comm.is_chief() && trial_id) {
    try {
      chosen = core::trial_checkpoint_dir(core::ExperimentLayout{path}, *trial_id);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  comm.broadcast(error, 0);
  if (!error.empty()) throw ConfigError(key + ": " + error);
  try {
    return load_chosen_checkpoint(chosen, comm);
  } catch (const CheckpointError& e) {
    throw ConfigError(key + ": " + std::string(e.what()));
  }
}

// No checkpoint to resume: every rank takes the weights of searcher.source_checkpoint (at ZeRO
// stage 3 written whole, then each rank's parts taken from them), or the chief's initial ones
// (stage 3's parts were cut from them already: their parameters are empty here).
void Loop::start_fresh() {
  if (!config_.searcher.source_checkpoint.empty()) {
    const detail::ShardedOptimizers partitioned = sharded_optimizers(*trial_, *context_);
    gather_partitioned(partitioned);
    start_from_source();
    keep_partitioned(partitioned);
  } else {
    context_->broadcast_model_state();
  }
  // What a run that failed before its first checkpoint reported is trained again from here.
  if (chief()) trim_metrics(0);
}

// Fine-tuning: a fresh start takes the weights of searcher.source_checkpoint, nothing else of it
// (its optimizer, data position and progress are the new trial's own, from the start).
void Loop::start_from_source() {
  const core::Searcher& searcher = config_.searcher;
  const checkpoint::CheckpointStore::Loaded source = load_source_checkpoint(
      searcher.source_checkpoint, searcher.source_trial_id,
      searcher.source_trial_id ? "searcher.source_trial_id" : "searcher.source_checkpoint", comm_);
  detail::restore_weights(source.contents, source.path, *context_, identity_);
  source_checkpoint_ = source.path;
  if (chief()) {
    core::log_info("fine-tuning from the weights of {} ({} batches trained), with a fresh optimizer at batch 0",
                   source.path, source.batches);
  }
}

std::optional<core::ExperimentIdentity> Loop::experiment_identity() const {
  if (options_.identity_dir.empty()) return std::nullopt;
  return core::require_experiment_identity(core::ExperimentLayout{options_.identity_dir});
}

std::string Loop::checkpoint_dir() const {
  if (!options_.checkpoint_dir.empty()) return options_.checkpoint_dir;
  return core::checkpoint_dir(config_, core::TrialLayout{options_.trial_dir}, options_.trial_id,
                              experiment_identity());
}

void Loop::open_checkpoint_store(const std::string& dir) {
  checkpoint::StoreOptions store_options;
  store_options.keep_latest = config_.checkpoint_storage.save_trial_latest;
  store_options.keep_best = config_.checkpoint_storage.save_trial_best;
  store_options.smaller_is_better = config_.searcher.smaller_is_better;
  if (config_.checkpoint_storage.group_readable) {
    store_options.file_mode = 0640;
    store_options.dir_mode = 0750;
  }
  store_ = std::make_unique<checkpoint::CheckpointStore>(dir, store_options);
  store_->remove_temporaries();
  writer_ = std::make_unique<detail::AsyncCheckpointWriter>(*store_);
}

std::int64_t Loop::newest_shared_checkpoint() const {
  for (const auto& info : store_->list(/*verify=*/false)) {
    if (info.valid) return info.batches;
  }
  return -1;
}

// The chief picks the checkpoint to resume from the store open_checkpoint_store opened in `dir`,
// and reads its contents into `contents`. Returns its path; empty: start fresh; "!" or "?" +
// reason: refuse to start (a "?" as a mistake in the config).
std::string Loop::choose_resume_checkpoint(const std::string& dir, const checkpoint::ReadOptions& read,
                                           checkpoint::Contents& contents) {
  std::string chosen;
  std::vector<std::string> problems;
  std::optional<checkpoint::CheckpointStore::Loaded> loaded;
  try {
    loaded = store_->load_latest(
        &problems,
        [&](const checkpoint::CheckpointStore::Loaded& candidate) {
          detail::check_resumable(candidate.contents, candidate.path, identity_, options_.allow_config_change);
        },
        read);
  } catch (const ConfigError& e) {
    chosen = "?" + std::string(e.what());  // every rank fails with it, as a mistake in the config
  }
  for (const auto& problem : problems) core::log_warning("checkpoint not usable: {}", problem);
  if (!chosen.empty()) {
    // refused: said on every rank below
  } else if (loaded) {
    if (!problems.empty()) core::log_warning("resuming from the previous good checkpoint, {}", loaded->path);
    chosen = loaded->path;
    contents = std::move(loaded->contents);
  } else if (!problems.empty() && !options_.allow_fresh_start) {
    chosen = "!" + dir + " holds checkpoints but none is usable (see the warnings above); fix or remove them, or "
             "pass --allow-fresh-start to train this trial again from the start";
  } else if (!problems.empty()) {
    core::log_warning("no usable checkpoint in {}: starting afresh, as --allow-fresh-start allows", dir);
  }
  return chosen;
}

// What the loop carries across a resume, in a checkpoint's progress; and back.
detail::LoopState Loop::loop_state() const {
  detail::LoopState s;
  s.batches_trained = batches_trained_;
  s.epochs_trained = result_.epochs_trained;
  s.restart_count = restart_count_;
  s.last_validation_batches = last_validation_batches_;
  s.last_report_batches = last_report_batches_;
  s.last_validation = result_.last_validation;
  s.best_metric = best_metric_;
  s.period_batches = period_batches_;
  s.ended_by_trial = result_.ended_by_trial;
  for (const auto& [name, list] : period_values_) {
    auto& values = s.period_values[name];
    for (const auto& v : list) values.push_back(v.item<double>());
  }
  if (adaptive_) s.adaptive = adaptive_->state_dict();
  return s;
}

void Loop::apply(const detail::LoopState& s) {
  batches_trained_ = s.batches_trained;
  result_.epochs_trained = s.epochs_trained;
  restart_count_ = s.restart_count;
  last_validation_batches_ = s.last_validation_batches;
  last_report_batches_ = s.last_report_batches;
  result_.last_validation = s.last_validation;
  best_metric_ = s.best_metric;
  period_batches_ = s.period_batches;
  result_.ended_by_trial = s.ended_by_trial;
  period_values_.clear();
  for (const auto& [name, values] : s.period_values) {
    for (double v : values) period_values_[name].push_back(torch::tensor(v, torch::kFloat64));
  }
}

// Every rank restores from the checkpoint the chief chose, so that all take the same one.
void Loop::resume() {
  const std::string dir = checkpoint_dir();
  std::string chosen;  // empty: start fresh; "!" + reason: refuse to start
  checkpoint::Contents contents;
  if (chief()) open_checkpoint_store(dir);
  // The optimizer steps once the tensors of the checkpoint and the copy being written are copied.
  context_->set_before_optimizer_step([this] {
    detail::PhaseTimings::Scope t(timings_, "checkpoint_copy_wait");
    if (writer_) writer_->wait_for_copies();
    if (memory_) memory_->wait_for_copies();
  });
  // A copy in node memory newer than the shared filesystem's newest checkpoint, held by every rank,
  // wins, and no rank reads that checkpoint.
  checkpoint::Contents memory_contents;
  const std::optional<std::string> from_memory =
      resume_from_memory(chief() && memory_ ? newest_shared_checkpoint() : -1, memory_contents);
  // ZeRO stage 3: the parameters and the optimizer state stay in the file, each rank reading the
  // ranges its parts cover (the chief checked them whole, a few MiB at a time).
  const detail::ShardedOptimizers sharded = sharded_optimizers(*trial_, *context_);
  if (from_memory) {
    chosen = *from_memory;
    contents = std::move(memory_contents);
  } else {
    if (chief()) chosen = choose_resume_checkpoint(dir, detail::resume_read_options(sharded, identity_.part, true), contents);
    comm_.broadcast(chosen, 0);
    if (!chosen.empty() && chosen.front() == '!') throw CheckpointError(chosen.substr(1));
    if (!chosen.empty() && chosen.front() == '?') throw ConfigError(chosen.substr(1));
  }
  if (chosen.empty()) return start_fresh();
  if (!chief() && !from_memory) {
    contents = checkpoint::read_checkpoint(chosen, detail::resume_read_options(sharded, identity_.part, false));
  }
  detail::LoopState state = loop_state();
  detail::restore(contents, chosen, *context_, *trial_, callbacks_, state, identity_, options_.allow_config_change,
                  sharded);
  // The starts of this trial before this one: more than the checkpoint's count + 1 when an
  // attempt failed before its next checkpoint (the launcher counts those).
  state.restart_count = std::max<std::int64_t>(state.restart_count + 1, options_.restart_count);
  apply(state);
  restore_reducer_states(state.reducer_states);
  restore_rank_files(contents, chosen);
  if (!adaptive_ && state.adaptive.is_object()) {
    throw ConfigError(chosen + " was written with optimizations.adaptive_batch_size, whose batches change size: "
                      "its place in the data and its progress are not counted in batches of one size; resume "
                      "with the adaptive batch enabled");
  }
  if (adaptive_) {
    if (state.adaptive.is_null()) adaptive_->continue_fixed_run(batches_trained_);
    const bool rechosen = adaptive_->restore(state.adaptive);
    last_step_epoch_ = adaptive_->epoch_at(std::max(0.0, adaptive_->progress() - 1e-6));
    last_started_epoch_ = adaptive_->progress() > 0 ? last_step_epoch_ : -1;
    if (rechosen && chief()) {
      const BatchShape& shape = adaptive_->shape();
      core::log_info("adaptive batch: resumed on {} ranks: {} records a step ({} x {} micro-batch(es) x {} ranks)",
                     comm_.size(), shape.global(), shape.local_batch, shape.accumulation, shape.ranks);
    }
  }
  resumed_from_ = chosen;
  resumed_from_memory_ = from_memory.has_value();
  resumed_stream_positions_ = state.stream_positions;
  last_checkpoint_batches_ = batches_trained_;
  // Every rank restored the same file: the weights are equal without a broadcast.
  if (chief()) {
    trim_metrics(batches_trained_);
    core::log_info("resumed from {} after {} batches (restart {})", chosen, batches_trained_, restart_count_);
  }
  if (result_.ended_by_trial) {
    max_batches_ = adaptive_ ? 0 : batches_trained_;  // complete: nothing resumes a trial that ended itself
    if (chief()) core::log_info("the trial ended itself after {} batches (set_stop_requested); nothing to train",
                                batches_trained_);
  }
}

// A periodic checkpoint's cost to training: the loop's stall, and the whole of its background
// write (the copies, checksums, HDF5 and fsync), as if that had taken the CPU from training: on
// a machine with spare cores it costs less, never more. The write's length is the writer
// thread's own measure; where every rank writes parts, the step boundary that learns they all
// finished ends it.
void Loop::note_checkpoint_stall(double seconds) {
  if (!auto_checkpoint_) return;
  checkpoint_stall_s_ = seconds;
  shards_since_.reset();
  if (sharded_in_flight_) shards_since_ = Clock::now();
}

void Loop::settle_checkpoint_cost() {
  if (!auto_checkpoint_ || !checkpoint_stall_s_) return;
  std::optional<double> write_s = 0.0;
  if (shards_since_) {
    if (sharded_in_flight_) return;  // some rank is still writing
    write_s = std::chrono::duration<double>(Clock::now() - *std::exchange(shards_since_, std::nullopt)).count();
  } else if (config_.checkpoint_storage.async && writer_) {
    write_s = writer_->take_write_seconds();
    if (!write_s) return;  // still being written
  }
  const bool first = !auto_checkpoint_->cost_s();
  const double before = auto_checkpoint_->interval_s();
  auto_checkpoint_->record_cost(*std::exchange(checkpoint_stall_s_, std::nullopt) + *write_s);
  checkpoint_period_.seconds = auto_checkpoint_->interval_s();
  const double cost = *auto_checkpoint_->cost_s();
  const bool moved = std::abs(checkpoint_period_.seconds - before) > 0.5 * before;
  if (!first && !moved) return;
  using Limit = AutoCheckpointPeriod::Limit;
  const Limit limit = auto_checkpoint_->limit();
  const std::string why = limit == Limit::kBound   ? "bounded by checkpoint_storage.auto_max_interval"
                          : limit == Limit::kFloor ? "at most once a minute"
                                                   : fmt::format("checkpoint_storage.auto_overhead {:g} %",
                                                                 100 * auto_checkpoint_->overhead());
  core::log_info("a checkpoint costs training {:.3f} s (its stall and its write): checkpointing every {:.0f} s "
                 "(min_checkpoint_period: auto, {}), {:.2g} % of training time",
                 cost, checkpoint_period_.seconds, why, 100 * cost / checkpoint_period_.seconds);
}

}  // namespace hpctrial::trainer::detail
