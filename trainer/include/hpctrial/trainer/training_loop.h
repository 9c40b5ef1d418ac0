// The training loop: a fixed sequence of phases plus callbacks (LBANN's shape), driven by the
// experiment config. HPCTRIAL_MAIN (main.h) sets it up from the command line; tests and
// programs that embed hpctrial can run it directly.
//
// Per batch: next batch (prefetched) -> to_device -> train_batch -> LR schedulers -> at the
// step boundary the ranks agree on stop and time triggers, then training metrics, validation
// and stopping happen on every rank at the same batch.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/trainer/trial.h"

namespace hpctrial::comm {
class Communicator;
}

namespace hpctrial::trainer {

using TrialFactory = std::function<std::unique_ptr<Trial>(TrialContext&)>;

struct LoopOptions {
  std::string trial_dir;            // metrics.jsonl goes here (created if missing)
  int trial_id = 0;
  std::string experiment_dir;       // TrialContext::experiment_id(); empty when run alone
  // Where the identity every checkpoint names is recorded (core::experiment_identity): the
  // experiment directory; for a rank run alone, its trial directory, where the chief makes it the
  // first time (HPCTRIAL_MAIN does). Empty: none, and checkpoints name no experiment.
  std::string identity_dir;
  std::uint32_t experiment_seed = 0;
  DistributedContext distributed;
  double progress_interval_s = 10;  // progress lines on stderr (chief only); <= 0: none
  std::int64_t report_period_batches = 100;  // training metrics every N batches, and at the end
  // Training batches read ahead, on the loader's workers; 0: each read on the training thread.
  std::size_t prefetch_depth = 2;
  // Set by signal handlers: a stop request the ranks agree on at the next step boundary.
  const std::atomic<bool>* external_stop = nullptr;
  // Reduces gradients that live on a GPU (NCCL); null on the CPU path.
  comm::Communicator* device_communicator = nullptr;
  // Where checkpoints go; empty: as core::checkpoint_dir says (checkpoint_storage.host_path's
  // folder of this experiment and trial, else <trial_dir>/checkpoints). A run resumes from the
  // latest good checkpoint there.
  std::string checkpoint_dir;
  // With checkpoints present but none usable: start over rather than refuse.
  bool allow_fresh_start = false;
  // Resume a checkpoint written with other hyperparameters.
  bool allow_config_change = false;
  // The launcher's contract (see docs/trial-api.md): a stop-request file the chief watches, the
  // restart count, and the fault-injection spec of the tests (HPCTRIAL_FAULT). Empty: none.
  std::string stop_file;
  int restart_count = 0;
  std::string fault;
  // The digest of the code this run is (HPCTRIAL_CODE_DIGEST): recorded in runs.jsonl and in
  // every checkpoint's attributes (code_digest). Empty: code that is not frozen.
  std::string code_digest;
  // The launcher's run of the trial (HPCTRIAL_SESSION), the same for each of its attempts: the
  // copies in node memory (checkpoint_levels.memory) of another run are left over. Empty: a run
  // of its own (the chief names one).
  std::string session;
  // An adaptive search's trial, run by its worker (HPCTRIAL_SEARCH_WORKER): the run trains to
  // the end of the rung the search log says the trial trains toward; there the ranks validate
  // and checkpoint, the chief records the rung, and they train on to the next rung's end when the
  // search promotes the trial at once (in place), or end. The chief's access to the log (empty
  // functions on the other ranks): the rung's end, and the rung reached with the searcher metric
  // (the next rung's end when promoted, else 0), both in the unit of searcher.max_length.
  bool search_in_place = false;
  std::function<std::int64_t()> search_target;
  std::function<std::int64_t(double metric)> search_rung_reached;
  // Called when training fails on this rank, with the exit code (2 for a ConfigError, else 1)
  // and the error's message, before anything of the loop is destroyed: the objects of a failed
  // rank must not wait for its peers in their destructors. A multi-rank program aborts the job
  // here (MPI_Abort) and does not return; if it returns, the error propagates.
  std::function<void(int code, const std::string& message)> on_failure;
  // Tests: the seconds a step of `local_batch` x `accumulation` records a rank on `ranks` ranks
  // takes, as the adaptive batch's throughput model sees it, in place of the measured time (so
  // that its choices repeat from run to run). Empty: measured.
  std::function<double(std::int64_t local_batch, std::int64_t accumulation, int ranks)> adaptive_step_seconds;
  // With it, the part of a modelled step on more than one rank that waits for all-reduces.
  double adaptive_sync_seconds = 0;
};

struct LoopResult {
  std::int64_t batches_trained = 0;
  std::int64_t epochs_trained = 0;
  bool stopped_early = false;  // a stop request ended training before max_length (checkpointed, to resume)
  bool ended_by_trial = false;  // the trial called set_stop_requested: complete, validated, checkpointed
  std::string checkpoint_path;  // the last checkpoint written (chief)
  // min_checkpoint_period: auto (chief): the seconds between periodic checkpoints it last chose
  // from their measured cost, and that cost (the mean of the recent ones); 0 with another period.
  double auto_checkpoint_interval_s = 0;
  double auto_checkpoint_cost_s = 0;
  // Per phase of the loop: {"train_batch": {"total_s", "mean_ms", "count"}, ...}
  nlohmann::json timings;
  MetricValues last_validation;
  std::string metrics_path;
  // An inference experiment's: the result file, and the records this run predicted.
  std::string predictions_path;
  std::int64_t records_predicted = 0;
};

// Trains (or, for a config with `inference:`, predicts). With glibc it fixes malloc's mmap and
// trim thresholds for the process first, so that batches freed on one thread and read on another
// reuse memory (MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ in the environment win).
LoopResult run_training(const core::ExperimentConfig& config, const TrialFactory& factory,
                        comm::Communicator& communicator, const LoopOptions& options);

}  // namespace hpctrial::trainer
