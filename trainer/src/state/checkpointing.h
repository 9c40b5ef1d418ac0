// A whole trial's state as checkpoint contents, and back; and the thread that writes them.
// Internal to the trainer (the layout is in docs/checkpoint-format.md).
//
//   model/<i>/<name>        parameters and buffers of wrapped model i, by their LibTorch names
//   optimizer/<i>/...       see state_io.h
//   model_parallel/<k>/model/..., model_parallel/<k>/optimizer/...   the same for part k of a
//                           model split over ranks (a model-parallel unit), with
//                           meta/model_parallel {"parts": n}, and each part's
//                           optimizer/<i>/param_names; a pipeline's stages add "pipeline": true
//   scheduler/<i>/step_count, rng/cpu, sampler/records
//   scaler/<i>              JSON: wrapped GradScaler i's scale and counters
//   progress                JSON: batches, epochs, records, restart count, the loop's counters,
//                           the unreported training metrics of the current period
//   meta/config, meta/hparams, meta/validation, callbacks, trial_state   texts (JSON, YAML)
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "hpctrial/checkpoint/shared_write.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/trainer/callback.h"
#include "hpctrial/trainer/trial.h"
#include "hpctrial/trainer/trial_context.h"
#include "state/state_io.h"

namespace hpctrial::trainer::detail {

class ShardedOptimizer;

// What the loop itself carries across a resume.
struct LoopState {
  std::int64_t batches_trained = 0;
  std::int64_t epochs_trained = 0;
  std::int64_t restart_count = 0;
  std::int64_t last_validation_batches = -1;
  std::int64_t last_report_batches = 0;
  MetricValues last_validation;
  std::optional<double> best_metric;
  // Training metrics of the period not yet reported: one value per batch.
  std::map<std::string, std::vector<double>> period_values;
  std::int64_t period_batches = 0;
  bool ended_by_trial = false;  // set_stop_requested ended the trial: it is complete
  // Per rank, in rank order, {reducer name: state_dict()} of the custom training reducers; null
  // when there are none.
  nlohmann::json reducer_states;
  // Per rank, in rank order, {"pass", "offset"} of its training StreamDataset after the last
  // batch trained; null when the training data is not a stream.
  nlohmann::json stream_positions;
  // The adaptive batch's state (adaptive_batch.h); null without one.
  nlohmann::json adaptive;
  std::int64_t records_trained(std::int64_t global_batch) const {
    return adaptive.is_object() ? adaptive.at("records").get<std::int64_t>() : batches_trained * global_batch;
  }
};

struct TrialIdentity {
  // The experiment's identity (core::ExperimentIdentity); empty when the trial runs alone.
  std::string experiment_id;
  std::string experiment_name;
  std::string config_yaml;
  std::string code_digest;  // the code the run is (LoopOptions::code_digest); empty: not frozen
  nlohmann::json hparams;
  int trial_id = 0;
  int world_size = 1;
  std::string searcher_metric;
  std::int64_t global_batch = 0;
  // A model split over ranks (a model-parallel unit): its number of parts, and the prefix of this
  // rank's part in a checkpoint, "model_parallel/<part>/" (empty for a whole model).
  int parts = 1;
  std::string part;
  // The parts are a pipeline's stages, whose layers are named by their index in the whole model:
  // a checkpoint resumes on another number of stages (pipeline_checkpoint.h).
  bool pipeline = false;
};

using Callbacks = std::map<std::string, std::shared_ptr<Callback>>;

// What the chief's AsyncCheckpointWriter needs to write its datasets into a laid-out file and
// publish it once every rank's pieces are durable.
struct PlannedWrite {
  checkpoint::FilePlan plan;
  // Called once, on the writer's thread: the chief's datasets are durable (empty) or failed.
  std::function<void(const std::string& error)> written;
  // Blocks until the loop has settled: the CRCs of the shared datasets, or a CheckpointError.
  std::function<std::vector<std::uint32_t>()> pieces;
};

// The state at this step boundary. With `defer`, parameters and optimizer state on the CPU are
// not copied here but by the writer's thread (AsyncCheckpointWriter); until it has, the
// optimizer must not step (the loop holds step_optimizer). Everything else - buffers, which a
// forward pass changes, RNG, progress - is copied now.
struct Snapshot {
  checkpoint::Contents contents;
  Deferred deferred;
  // Set: the file is laid out already and other ranks write parts of it (sharded_checkpoint.h).
  std::optional<PlannedWrite> planned;
  // Called by the writer's thread just before a whole file is published (the tests' fault hook).
  std::function<void()> before_publish;
  // Set: the writer's thread takes the contents from it, in place of `contents` and `deferred`
  // (a copy in node memory of the same state: MemoryLevel::pinned_copy).
  std::function<checkpoint::Contents()> source;
};
// `whole_optimizers`: the datasets of the context's sharded optimizers (ZeRO), gathered whole by
// every rank beforehand (ShardedOptimizer::save_whole), used in place of their shards.
Snapshot capture(TrialContext& context, Trial& trial, const Callbacks& callbacks, const LoopState& loop,
                 const TrialIdentity& identity, bool defer = false,
                 const checkpoint::Contents* whole_optimizers = nullptr);

// This rank's part of a model split over ranks (TrialIdentity::part): its models' tensors and its
// optimizers' state under `part`, copied now; `whole_optimizers` as for capture.
checkpoint::Contents capture_part(TrialContext& context, const std::string& part,
                                  const checkpoint::Contents* whole_optimizers = nullptr);

// The context's optimizers that ZeRO shards, by their index in context.optimizers().
using ShardedOptimizers = std::map<std::size_t, ShardedOptimizer*>;

// Marks the optimizer state under `prefix` as rank `rank`'s shards of `ranks` (its optimizer's
// state over its parts, as captured: a rank's copy of its own, checkpoint_levels.memory). restore
// loads it into that rank's sharded optimizer as it is, and refuses it on another rank or count.
void mark_shard_of(checkpoint::Contents& contents, const std::string& prefix, int rank, int ranks);
// Under a part's prefix, what mark_shard_of marks in a rank's own copy whose ZeRO stage 3
// parameters are the rank's parts of them (ShardedOptimizer::part): restore loads them into that
// rank's parts as they are.
inline constexpr const char* kParameterParts = "meta/parameters";

// Whether a checkpoint that reads intact may be resumed by this trial, before anything is
// restored: ConfigError for one of another experiment or trial, or (unless
// `allow_config_change`) written with other hyperparameters; CheckpointError when its progress
// cannot be read (the store then takes the previous one).
void check_resumable(const checkpoint::Contents& contents, const std::string& path, const TrialIdentity& identity,
                     bool allow_config_change);

// Puts everything back. Refuses a checkpoint of another model (naming the tensor) and, unless
// `allow_config_change`, one written with other hyperparameters. A sharded optimizer takes its
// shard of the whole state in the file, whatever the number of ranks that wrote it; at stage 3
// its parameters stay released and each rank reads its parts from ranges of their datasets
// (which `contents` may leave in the file: resume_read_options).
void restore(const checkpoint::Contents& contents, const std::string& path, TrialContext& context, Trial& trial,
             const Callbacks& callbacks, LoopState& loop, const TrialIdentity& identity, bool allow_config_change,
             const ShardedOptimizers& sharded = {});

// How a resume reads the checkpoint: at ZeRO stage 3 (`sharded` partitions parameters) the
// large datasets of the models and optimizers are left in the file, each rank reading what its
// parts cover (and only the chief, with `verify`, checking them whole, through a small buffer).
checkpoint::ReadOptions resume_read_options(const ShardedOptimizers& sharded, const std::string& part, bool verify);

// The models' weights alone (a trained model loaded, a fine-tuning's start): the tensors of
// `identity.part`, a pipeline's layers taken from whichever stage held them on any number of
// stages; nothing of the optimizers, schedulers, progress or data position. At ZeRO stage 3
// (`sharded` partitions parameters) each rank takes its parts of them, as a resume does.
// ConfigError naming the tensor for another model, and for a model split into another number of
// parts.
void restore_weights(const checkpoint::Contents& contents, const std::string& path, TrialContext& context,
                     const TrialIdentity& identity, const ShardedOptimizers& sharded = {});

// Writes and publishes checkpoints on a thread of its own, one at a time: submit() waits for
// the previous one first; wait() returns once the last is durable (rethrowing its error).
class AsyncCheckpointWriter {
 public:
  explicit AsyncCheckpointWriter(checkpoint::CheckpointStore& store);
  ~AsyncCheckpointWriter();
  AsyncCheckpointWriter(const AsyncCheckpointWriter&) = delete;
  AsyncCheckpointWriter& operator=(const AsyncCheckpointWriter&) = delete;

  void submit(Snapshot snapshot);
  // Returns once the deferred tensors of the last snapshot are copied (training may step).
  void wait_for_copies();
  // The path of the last checkpoint made durable since the previous call, if any.
  std::optional<std::string> wait();
  // Without waiting: the seconds the thread spent on the last checkpoint (copies, writing,
  // publication), once it is done, and only once; nullopt while it is still being written.
  std::optional<double> take_write_seconds();

 private:
  void run();
  std::exception_ptr write_planned(PlannedWrite& planned, const checkpoint::Contents& contents, std::exception_ptr error);

  checkpoint::CheckpointStore& store_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::optional<Snapshot> pending_;
  bool busy_ = false;
  bool copying_ = false;  // deferred tensors of the current snapshot not yet copied
  // Host buffers of the last checkpoint's deferred tensors, reused by the next (no page faults).
  std::multimap<std::size_t, std::shared_ptr<checkpoint::Buffer>> pool_;
  bool stopping_ = false;
  std::exception_ptr error_;
  std::optional<std::string> done_;
  std::optional<double> write_seconds_;
  std::thread thread_;
};

}  // namespace hpctrial::trainer::detail
