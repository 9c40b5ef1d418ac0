// The training loop of one trial (internal to the trainer): set-up and resume, batches,
// checkpoints (training_loop.cpp); training data and the per-rank state checkpoints carry
// (loop/data.cpp); metrics and validation (loop/metrics.cpp); checkpoints every rank writes part
// of (loop/checkpoint.cpp).
#pragma once

#include <torch/torch.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "adaptive/adaptive_batch.h"
#include "loop/auto_checkpoint.h"
#include "state/checkpointing.h"
#include "state/memory_level.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/trainer/sampler.h"
#include "hpctrial/trainer/training_loop.h"
#include "hpctrial/rank/runtime.h"
#include "observe/metrics_log.h"
#include "data/prefetcher.h"
#include "observe/nvtx_marker.h"
#include "observe/profiler.h"
#include "observe/system_metrics.h"
#include "state/sharded_checkpoint.h"
#include "data/stream_reader.h"

namespace hpctrial::trainer::detail {

class EngineTrialRunner;

using Clock = std::chrono::steady_clock;

// A period: every N batches, or every N seconds (measured on the chief).
struct Period {
  std::int64_t batches = 0;  // 0: not batch-based
  double seconds = 0;        // 0: not time-based
  bool enabled() const { return batches > 0 || seconds > 0; }
};

// The stream of the trial seed LibTorch's generator is seeded from before the trial is built.
constexpr std::uint64_t kTorchSeedStream = 1;

// How the trial's model lies over the ranks (TrialIdentity's parts, part and pipeline).
struct ModelLayout {
  int parts = 1;
  std::string part;  // "model_parallel/<k>/", or empty for a whole model
  bool pipeline = false;
};
// Once the trial is built: the ranks' model-parallel units agree, and this rank's part is known.
// A collective; ConfigError on every rank for units that do not fit together.
ModelLayout agree_on_model_layout(comm::Communicator& comm, const core::ExperimentConfig& config,
                                  const ModelParallelUnit& mine);
// The context's settings from the config, for the trial's `hparams`, on `comm`'s ranks (an
// engine trial's batch resolved over them); the caller sets where it runs (distributed, trial
// id, experiment, TensorBoard).
TrialSettings trial_settings(const core::ExperimentConfig& config, comm::Communicator& comm,
                             const nlohmann::json& hparams, std::uint64_t trial_seed);
void resolve_engine_batch(const core::ExperimentConfig& config, comm::Communicator& comm, TrialSettings& settings);

// The checkpoint `path` names (a file, or a directory's newest good one), as the chief chose it:
// the chief keeps what it read, the other ranks read the same file. A collective; CheckpointError
// on every rank when there is none.
checkpoint::CheckpointStore::Loaded load_chosen_checkpoint(const std::string& path, comm::Communicator& comm);
// A fine-tuning's or an inference's source: `path`, or with `trial_id` that trial of the
// experiment directory `path`, as load_chosen_checkpoint chose it. ConfigError naming `key` on
// every rank when there is none.
checkpoint::CheckpointStore::Loaded load_source_checkpoint(const std::string& path, std::optional<int> trial_id,
                                                           const std::string& key, comm::Communicator& comm);

// An experiment with `inference:` (loop/inference.cpp): the trial's predict_batch over its
// inference data with the source checkpoint's weights, rows written by every rank into one file.
LoopResult run_inference(const core::ExperimentConfig& config, const TrialFactory& factory, comm::Communicator& comm,
                         const LoopOptions& options);

class Loop {
 public:
  Loop(const core::ExperimentConfig& config, const TrialFactory& factory, comm::Communicator& comm,
       const LoopOptions& options)
      : config_(config), factory_(factory), comm_(comm), options_(options) {}

  LoopResult run();

 private:
  void setup();
  TrialSettings make_trial_settings(std::uint64_t trial_seed) const;
  void resume();
  // A fresh start of a fine-tuning (searcher.source_checkpoint): its weights only.
  void start_fresh();
  std::vector<std::vector<std::string>> model_dataset_names(const detail::ShardedOptimizer& sharded) const;
  void start_from_source();
  // The chief's store of the shared filesystem's checkpoints in `dir`, and its writer.
  void open_checkpoint_store(const std::string& dir);
  // The batches of the newest checkpoint in the store whose manifest reads intact; -1: none.
  std::int64_t newest_shared_checkpoint() const;
  // The chief: picks the shared filesystem's checkpoint resume() restores.
  std::string choose_resume_checkpoint(const std::string& dir, const checkpoint::ReadOptions& read,
                                       checkpoint::Contents& contents);
  // min_checkpoint_period: auto: the periodic checkpoint just taken stalled the loop this long;
  // once its background write is done, the whole cost sets the next interval.
  void note_checkpoint_stall(double seconds);
  void settle_checkpoint_cost();
  void trim_metrics(std::int64_t batches);
  std::string checkpoint_dir() const;
  std::optional<core::ExperimentIdentity> experiment_identity() const;
  void save_checkpoint(bool wait);
  // Every rank: the replicas' checksums compared (replica_check.h); `when` for the message.
  void check_replicas(const std::string& when);
  void finish_checkpoints_before_failing();
  // Checkpoints with ZeRO on several ranks, each rank writing its own shard (loop/checkpoint.cpp):
  // one the loop waits for; one it does not (a periodic one), settled once every rank is done.
  // `files`: this rank's files (rank_files.h), or null.
  void save_sharded_checkpoint(const detail::LoopState& state, const detail::ShardedOptimizers& sharded,
                               const checkpoint::Contents* files);
  void start_sharded_checkpoint(const detail::LoopState& state, const detail::ShardedOptimizers& sharded,
                                const checkpoint::Contents* files);
  void settle_sharded_checkpoint();
  std::function<void()> writer_fault_hook() const;
  detail::ShardedSave save_shards(const detail::ShardedOptimizers& sharded, const checkpoint::Contents* files);
  // This rank's files for a checkpoint (Trial::save_files); none when the trial saves none. With
  // `counted`, they say how many ranks saved theirs on every rank (a copy of the rank's own).
  std::optional<checkpoint::Contents> capture_rank_files(bool counted = false);
  // Gives this rank the files its number saved in the checkpoint `contents` (Trial::load_files).
  void restore_rank_files(const checkpoint::Contents& contents, const std::string& path);
  void finish_checkpoint();
  // checkpoint_levels.memory (loop/memory_copies.cpp): every rank's folder in node memory, its
  // periodic copy, the newest copy every rank holds when it is newer than `level3_batches` (its
  // path on this rank, the copy read into `contents`), and its removal once the run ended.
  void open_memory_level();
  void open_partner_level();
  nlohmann::json memory_resume_plan(const std::vector<std::string>& held, std::int64_t level3_batches) const;
  void save_memory_copy();
  std::optional<std::string> resume_from_memory(std::int64_t level3_batches, checkpoint::Contents& contents);
  void close_memory_level();
  // Training data (loop/data.cpp).
  // agree_on_model_layout into identity_.
  void agree_on_model_parallelism();
  // The data-parallel view: this rank's replica and their number; whether it reads records and
  // whether its metrics count (its model-parallel unit's, every rank's without one).
  int replica() const { return context_->data_parallel_rank(); }
  int replicas() const { return context_->data_parallel_size(); }
  bool reads_data() const { return context_->mpu().should_build_data_loader; }
  bool reports_metrics() const { return context_->mpu().should_report_metrics; }
  std::int64_t training_records_per_epoch() const;
  void start_training_data(std::uint64_t data_seed);
  StreamPosition resumed_stream_position() const;
  nlohmann::json gather_stream_positions();
  nlohmann::json gather_reducer_states();
  void restore_reducer_states(const nlohmann::json& states);
  // An adaptive search's rungs, trained in place (options_.search_in_place).
  std::int64_t search_length(const std::function<std::int64_t()>& ask);
  bool promoted_in_place();
  bool search_recorded_ = false;  // the search log has this run's rung already
  // The adaptive batch (loop/adaptive.cpp).
  void setup_adaptive();
  void start_adaptive_step();
  bool end_adaptive_micro_batch();  // true at the end of a step
  void decide_adaptive_batch();
  bool adaptive_period_reached(const Period& period) const;
  // With an adaptive batch: the loop's batches a step, and a loop batch's records on a rank (an
  // engine trial's loop batch is a whole step; a Trial's is one micro-batch).
  std::int64_t loop_accumulation() const { return engine_runner_ ? 1 : adaptive_->shape().accumulation; }
  std::int64_t loop_local_batch() const {
    return adaptive_->shape().local_batch * (engine_runner_ ? adaptive_->shape().accumulation : 1);
  }
  void restart_training_data();
  // The chief's records in the trial directory: this run's size and batch (runs.jsonl), the size
  // an elastic trial's adaptive batch prefers for its next run (elastic.json).
  // `placement`: each rank's host, CPUs and device, as JSON text, in rank order.
  void record_run(const std::vector<std::string>& placement) const;
  void start_outputs();
  // The system metrics: whether their period has passed (the chief's clock), and every rank's
  // sample gathered to the chief, which writes them.
  bool time_to_sample_system() const;
  void report_system();
  void record_elastic_preference() const;
  // Records taken from the training order by the batches trained.
  std::int64_t records_trained() const { return adaptive_ ? adaptive_->records() : batches_trained_ * global_batch_; }
  // Whether max_length is reached: batches, or with an adaptive batch the progress at a step's end.
  bool reached_max_length() const {
    if (!adaptive_) return batches_trained_ >= max_batches_;
    return micro_in_step_ == 0 && adaptive_->progress() >= static_cast<double>(max_batches_) - 1e-9;
  }
  // What the progress lines count against max_length: batches, or with an adaptive batch the
  // steps of the base batch its progress is worth.
  std::int64_t progress_batches() const {
    return adaptive_ ? static_cast<std::int64_t>(adaptive_->progress()) : batches_trained_;
  }
  // The epoch of the last batch trained.
  std::int64_t trained_epoch() const {
    if (adaptive_) return last_step_epoch_;
    return epoch_of_batch(std::max<std::int64_t>(0, batches_trained_ - 1));
  }
  detail::LoopState loop_state() const;
  void apply(const detail::LoopState& state);
  void train_one_batch();
  void step_lr_schedulers(bool epoch_end);  // after the batch's train_batch
  // Whether the batch just trained ended an optimizer step (an aggregation group, an adaptive
  // batch's micro-batches).
  bool group_end() const {
    return adaptive_ ? micro_in_step_ == 0 : batches_trained_ % config_.optimizations.aggregation_frequency == 0;
  }
  // Runs `step`, in which hooks that run on the chief alone may run (every rank calls it alike),
  // and gives every rank what they changed before the next batch trains.
  // What the sharing costs (the state read before and after, the broadcast) is the phase
  // "chief_hook_changes" of the timings (benchmarks/harness_overhead --chief-hooks).
  template <typename Step>
  void with_chief_hooks(Step&& step) {
    auto started = Clock::now();
    const std::string before = chief() ? chief_hook_fingerprint() : std::string();
    const auto reading = Clock::now() - started;
    step();
    started = Clock::now();
    share_chief_hook_changes(before);
    timings_.add("chief_hook_changes", reading + (Clock::now() - started));
  }
  std::string chief_hook_state();
  std::string chief_hook_fingerprint();
  void share_chief_hook_changes(const std::string& before);
  // The step boundary after each batch: the ranks agree on their requests, and validate,
  // checkpoint or stop alike; true when training ends there.
  bool step_boundary();
  std::array<std::int64_t, 8> agree_on_step_requests();
  // The chief, at each step boundary: whether the time-based memory period has come (seconds,
  // or auto's interval, fed here with the last copy's cost once it is written).
  bool time_to_copy();
  LoopResult finish_run();
  void report_training();
  void validate();
  // This rank's share of the validation set through evaluate_batch; false when the trial does
  // not override it.
  // One evaluation metric over this rank's batches: its shape, and its values summed (kAvg,
  // kSum) or their extreme (kMax, kMin), element by element.
  struct BatchMetric {
    std::vector<std::int64_t> shape;
    std::vector<double> values;
    std::int64_t batches = 0;
    std::string error;  // a batch of another shape: told to every rank when they reduce
  };
  void add_batch_metric(BatchMetric& into, const std::string& name, const torch::Tensor& value) const;
  bool evaluate_local_batches(std::map<std::string, BatchMetric>& values);
  MetricValues reduce_batch_metrics(std::map<std::string, BatchMetric>& values);
  MetricValues reduce_custom(bool training);
  void call(const std::function<void(Callback&)>& hook) {
    for (auto& [name, callback] : callbacks_) hook(*callback);
  }
  bool chief() const { return comm_.is_chief(); }
  std::int64_t epoch_of_batch(std::int64_t batch) const {
    return batch * global_batch_ / records_per_epoch_;
  }

  const core::ExperimentConfig& config_;
  const TrialFactory& factory_;
  comm::Communicator& comm_;
  LoopOptions options_;

  std::unique_ptr<TrialContext> context_;
  std::unique_ptr<Trial> trial_;
  std::unique_ptr<DataLoader> train_loader_;
  std::unique_ptr<DataLoader> validation_loader_;
  std::map<std::string, std::shared_ptr<Callback>> callbacks_;
  std::unique_ptr<TrainingSampler> sampler_;     // an indexed dataset's order ...
  std::unique_ptr<StreamReader> stream_reader_;  // ... or a stream
  StreamPosition stream_trained_;                // the stream after the last batch trained
  std::unique_ptr<detail::Prefetcher> prefetcher_;
  std::unique_ptr<detail::MetricsLog> log_;
  std::unique_ptr<detail::Progress> progress_;
  std::unique_ptr<rank::StopFile> stop_file_;
  std::unique_ptr<rank::FaultPlan> faults_;
  detail::PhaseTimings timings_;
  std::unique_ptr<detail::PhaseMarker> nvtx_;         // NVTX ranges of the phases, in CUDA builds
  std::unique_ptr<detail::BatchProfiler> profiler_;  // the profiler window's, when one is set
  std::unique_ptr<detail::SystemMonitor> system_;    // when profiling.system_metrics_period > 0
  Clock::time_point last_system_sample_;
  ReducerSpec reducers_ = Reducer::kAvg;
  bool saves_files_ = true;  // until the trial shows it does not override save_files

  std::int64_t global_batch_ = 0;
  std::int64_t records_per_epoch_ = 0;
  std::int64_t max_batches_ = 0;
  Period validation_period_;
  std::int64_t batches_trained_ = 0;
  std::int64_t last_validation_batches_ = -1;
  Clock::time_point last_validation_time_;
  std::int64_t last_report_batches_ = 0;
  bool evaluate_by_batch_ = true;
  bool evaluation_agreed_ = false;  // the ranks agreed on evaluate_by_batch_
  bool checked_searcher_metric_ = false;

  // Checkpoints (the chief writes them; every rank restores).
  std::unique_ptr<checkpoint::CheckpointStore> store_;
  std::unique_ptr<detail::AsyncCheckpointWriter> writer_;
  // The sharded checkpoint being written while training goes on; gone before writer_, whose
  // thread it releases.
  std::unique_ptr<detail::ShardedWriteInFlight> sharded_in_flight_;
  detail::TrialIdentity identity_;
  std::string source_checkpoint_;  // the checkpoint whose weights a fine-tuning started from
  nlohmann::json settings_hparams_;
  Period checkpoint_period_;
  // min_checkpoint_period: auto, on the chief: the period follows what checkpoints cost.
  std::unique_ptr<AutoCheckpointPeriod> auto_checkpoint_;
  std::optional<double> checkpoint_stall_s_;  // the last periodic checkpoint's stall, its write to come
  std::optional<Clock::time_point> shards_since_;  // when every rank began writing its parts of it
  Clock::time_point last_checkpoint_time_;
  std::int64_t last_checkpoint_batches_ = -1;
  // checkpoint_levels.memory: this rank's copies in node memory; null without the level.
  std::unique_ptr<detail::MemoryLevel> memory_;
  std::int64_t last_memory_batches_ = -1;
  bool said_checkpoints_from_copies_ = false;
  Clock::time_point last_memory_time_ = Clock::now();  // checkpoint_levels.memory.period in seconds
  bool memory_pending_ = false;
  // checkpoint_levels.memory.period: auto, on the chief: the interval from the copies' cost, the
  // loop's stall (memory_stall_s_) and the optimizer's wait for the copy.
  std::unique_ptr<AutoCheckpointPeriod> auto_memory_;
  double memory_stall_s_ = 0;
  // Requests agreed at a step boundary, kept until the end of the aggregation group.
  bool stop_pending_ = false;        // a signal, the stop file: checkpoint and exit to be resumed
  bool trial_stop_pending_ = false;  // set_stop_requested: the trial ends, complete
  bool checkpoint_pending_ = false;
  std::int64_t restart_count_ = 0;
  std::optional<double> best_metric_;
  std::string resumed_from_;                // the checkpoint this run resumed; empty: a fresh start
  bool resumed_from_memory_ = false;        // ... a copy in node memory (checkpoint_levels.memory)
  std::vector<std::pair<int, int>> memory_moves_;  // ... some from partners: (owner, keeper)
  nlohmann::json resumed_stream_positions_;

  // Training metrics of the current reporting period.
  std::map<std::string, std::vector<torch::Tensor>> period_values_;
  std::int64_t period_batches_ = 0;
  double last_loss_ = std::numeric_limits<double>::quiet_NaN();

  LoopResult result_;

  // The adaptive batch: its state, where the step under way stands.
  std::unique_ptr<detail::AdaptiveBatchState> adaptive_;
  EngineTrialRunner* engine_runner_ = nullptr;  // an engine trial's, with an adaptive batch
  // AdamScale's preconditioned noise: the Adam optimizer, and what resets its moments.
  torch::optim::Optimizer* preconditioned_optimizer_ = nullptr;
  void (*reset_adam_)(torch::optim::Optimizer&) = nullptr;
  std::uint64_t data_seed_ = 0;
  std::int64_t micro_in_step_ = 0;        // micro-batches of the step under way trained
  std::int64_t batches_since_optimizer_step_ = 0;  // loop batches whose EveryBatch LR steps wait
  Clock::time_point step_started_;
  double progress_before_step_ = 0;
  std::int64_t step_epoch_ = 0;           // the statistical epoch the step under way is in
  std::int64_t last_step_epoch_ = 0;
  std::int64_t last_started_epoch_ = -1;
};

}  // namespace hpctrial::trainer::detail
