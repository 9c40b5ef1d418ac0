// The experiment config: the typed form of the YAML a user writes.
//
// load_experiment_config() reads a config file, merges an optional template, applies --set
// overrides, and validates everything against the schema documented in
// docs/config-reference.md. Every problem is reported at once, each naming file, line,
// column and key path, as a ConfigError. A config that loads is complete: defaults are filled
// in, so to_yaml() writes the effective config that makes a run reproducible.
//
// Plain values; not thread-safe to mutate, safe to share read-only.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hpctrial/core/config_node.h"
#include "hpctrial/core/diagnostics.h"

namespace hpctrial::core {

// A training length or period: {batches: N}, {epochs: N}, {records: N} or {seconds: N}.
enum class LengthUnit { kBatches, kEpochs, kRecords, kSeconds };
std::string_view to_string(LengthUnit unit);

struct Length {
  LengthUnit unit = LengthUnit::kBatches;
  std::int64_t value = 0;
};

// What the ranks run: a program (argv) or a trial class in a shared library
// (`./libmodel.so:MyTrial`), loaded by the worker program.
struct Entrypoint {
  enum class Kind { kExecutable, kLibrary };
  Kind kind = Kind::kExecutable;
  std::vector<std::string> argv;  // kExecutable
  std::string library;            // kLibrary
  std::string trial_class;        // kLibrary, may be namespace-qualified
};

struct Hyperparameter {
  enum class Type { kConst, kInt, kDouble, kLog, kCategorical, kNested };
  Type type = Type::kConst;
  ConfigNode value;                 // kConst: the value as written
  double minval = 0, maxval = 0;    // kInt (integral), kDouble, kLog (exponents)
  std::int64_t count = 0;           // grid points; 0 when not given
  double base = 10;                 // kLog
  std::vector<ConfigNode> vals;     // kCategorical
  std::vector<std::pair<std::string, Hyperparameter>> nested;  // kNested
};
std::string_view to_string(Hyperparameter::Type type);

struct Searcher {
  // adaptive_asha and async_halving: asynchronous successive halving (search/asha.h).
  enum class Name { kSingle, kGrid, kRandom, kAdaptiveAsha, kAsyncHalving };
  Name name = Name::kSingle;
  std::string metric;
  bool smaller_is_better = true;
  Length max_length;
  std::int64_t max_trials = 1;
  // How many trials of a search run at once (a job array's `%k`; the adaptive searchers' workers),
  // as Determined's default.
  std::int64_t max_concurrent_trials = 16;
  // The adaptive searchers, in Determined's names and defaults.
  enum class Mode { kAggressive, kStandard, kConservative };
  Mode mode = Mode::kStandard;         // adaptive_asha: how many brackets
  double divisor = 4;                  // the fraction of a rung that goes on, and rung length ratio
  int max_rungs = 5;                   // adaptive_asha
  std::vector<int> bracket_rungs;      // adaptive_asha: the brackets' rungs, instead of mode
  int num_rungs = 0;                   // async_halving (required there)
  bool stop_once = false;              // stop a trial for good at a rung rather than pause it
  // Fine-tuning (Determined's source_checkpoint_uuid and source_trial_id): every trial starts
  // from this checkpoint's weights, with its own fresh optimizer, at batch 0. A checkpoint file,
  // a trial's checkpoint directory (its latest good checkpoint), or, with source_trial_id, an
  // experiment directory whose trial it names. Absolute once loaded.
  std::string source_checkpoint;
  std::optional<int> source_trial_id;
  bool adaptive() const { return name == Name::kAdaptiveAsha || name == Name::kAsyncHalving; }
};
std::string_view to_string(Searcher::Mode mode);
std::string_view to_string(Searcher::Name name);

struct Resources {
  int slots_per_trial = 1;
  int slots_per_node = 1;  // defaults to slots_per_trial: one node
  int cpus_per_slot = 1;
  int gpus_per_slot = 0;
  std::optional<std::uint64_t> memory_per_node_bytes;  // unset: the scheduler's default
  // Elastic jobs: the fewest slots a run may start on (whole nodes); 0: slots_per_trial.
  int min_slots_per_trial = 0;
  // Nodes a trial's job may leave out, each one its ranks failed on in two attempts (Slurm);
  // 0: none is ever left out.
  int max_excluded_nodes = 2;
  // Nodes asked for beyond those the ranks need: a node the ranks failed on is left out of the
  // job's runs and a spare takes its ranks, inside the job (Slurm, PBS). 0: none.
  int spare_nodes = 0;

  int nodes() const { return (slots_per_trial + slots_per_node - 1) / slots_per_node; }
  int min_slots() const { return min_slots_per_trial > 0 ? min_slots_per_trial : slots_per_trial; }
  int min_nodes() const { return (min_slots() + slots_per_node - 1) / slots_per_node; }
  bool elastic() const { return min_slots() < slots_per_trial; }
};

// How gradients travel in the all-reduce: as they are, or rounded to a 16-bit float.
enum class GradientCompression { kNone, kFloat16, kBFloat16 };
std::string_view to_string(GradientCompression compression);

// How an adaptive batch scales the learning rate (docs/adaptive.md): AdaScale's gain, its square
// root (AdamScale, for Adam and AdamW), the batch's scale, its square root, or the square root
// after a warm-up that grows with the batch. kAuto, the default, is AdaptDL's: AdamScale for an
// Adam or AdamW optimizer, AdaScale for any other (resolved when the trial is built).
enum class ScalingRule { kAuto, kAdaScale, kAdamScale, kLinear, kSqrt, kLegw };
std::string_view to_string(ScalingRule rule);

// optimizations.adaptive_batch_size: AdaptDL's adaptive batch size. The base batch is the
// trial's global batch size; batches are chosen between it and max_batch_size.
struct AdaptiveBatch {
  bool enabled = false;
  std::int64_t max_batch_size = 0;  // records a step across the ranks; 0: the base batch
  std::int64_t min_local_batch = 1;  // local_batch_size_bounds: records a micro-batch a rank
  std::int64_t max_local_batch = 0;  // 0: no bound but max_batch_size
  bool gradient_accumulation = false;
  ScalingRule scaling_rule = ScalingRule::kAuto;
  double legw_warmup_epochs = 0;   // LEGW's warm-up at the base batch, in epochs
  std::int64_t decision_interval = 50;  // optimizer steps between choices of the batch
  double smoothing = 0.999;        // the gradient noise estimates' moving average
};

struct Optimizations {
  std::int64_t aggregation_frequency = 1;
  bool average_training_metrics = true;
  double bucket_cap_mb = 25;
  GradientCompression gradient_compression = GradientCompression::kNone;
  // A collective that has not finished after this long ends the job (the watchdog).
  std::int64_t collective_timeout_seconds = 1800;
  // The ranks compare checksums of their replicated state (parameters, unsharded optimizer
  // state) at every checkpoint and, when positive, every this many batches; 0: at checkpoints only.
  std::int64_t replica_check_period = 0;
  // The network interface the ranks talk over (Determined's dtrain_network_interface): Open
  // MPI's TCP transports and NCCL's sockets; empty: their own choice.
  std::string network_interface;
  // The ranks' large allocations in transparent huge pages (glibc's malloc, told by the
  // GLIBC_TUNABLES the launcher sets): a tensor's first touch faults 2 MiB at a time, not 4 KiB.
  bool huge_pages = true;
  AdaptiveBatch adaptive_batch_size;
};

// The `engine:` section of an engine trial (docs/engine-trials.md), in DeepSpeed's key names.
// Unset batch sizes are derived from the others by resolve_engine_batch().
struct EngineConfig {
  std::optional<std::int64_t> train_batch_size;
  std::optional<std::int64_t> train_micro_batch_size_per_gpu;
  std::optional<std::int64_t> gradient_accumulation_steps;
  double gradient_clipping = 0;  // the gradients' largest global L2 norm; 0: no clipping
  int zero_stage = 0;            // zero_optimization.stage
  // zero_optimization.reduce_bucket_size: the elements of a bucket of gradients ZeRO reduces at once
  std::int64_t reduce_bucket_size = 500'000'000;
  // zero_optimization.offload_optimizer: where the optimizer state lives between steps.
  // "none" or "cpu" (host memory: where a model on the CPU keeps it anyway), or "nvme" (a swap
  // file a rank under nvme_path, on a local disk); buffer_count: the state tensors of sub-groups
  // in memory at once during a step.
  struct Offload {
    std::string device = "none";
    std::string nvme_path;
    int buffer_count = 4;
  } offload_optimizer;
  // zero_optimization.offload_param (stage 3): where each rank's parts of the parameters live
  // between the gathers and steps that use them: "none" or "cpu" (host memory), or "nvme" (in the
  // optimizer state's swap file, which needs offload_optimizer on nvme; its buffer_count unused).
  Offload offload_param;
  // zero_optimization.sub_group_size: the elements of parameters the offloaded step takes at once.
  std::int64_t sub_group_size = 1'000'000'000;
  // zero_optimization.stage3_param_persistence_threshold (stage 3): a parameter of at most this
  // many elements stays gathered on every rank (never released), while the persistent ones come
  // to at most stage3_model_persistence_threshold elements, first come first kept in the
  // optimizer's order (DeepSpeed's keys, defaults and rule).
  std::int64_t param_persistence_threshold = 100'000;
  std::int64_t model_persistence_threshold = std::numeric_limits<std::int64_t>::max();
  // zero_optimization.stage3_prefetch_bucket_size (stage 3): at most about this many elements of
  // the parameters the next layers use gathered ahead, while the current layer computes (0: none);
  // stage3_max_live_parameters: at most about this many gathered, or on their way, at once
  // (DeepSpeed's keys and defaults; a prefetch stops once it reaches either).
  std::int64_t prefetch_bucket_size = 50'000'000;
  std::int64_t max_live_parameters = 1'000'000'000;
  // zero_optimization.stage3_max_reuse_distance (stage 3, a model of layers): a layer's forward
  // leaves its parameters gathered for its backward when fewer than this many elements of
  // parameters are used in between (DeepSpeed's key, default and rule; 0: released after each
  // forward and gathered again for backward).
  std::int64_t max_reuse_distance = 1'000'000'000;
  bool bf16 = false;  // bf16.enabled: forward under bfloat16 autocast, float32 weights
  // fp16: forward under float16 autocast (GPUs only), float32 weights, dynamic loss scaling.
  struct Fp16 {
    bool enabled = false;
    double loss_scale = 0;  // 0: dynamic; otherwise a static scale
    // DeepSpeed's defaults where the section sets any of these keys; with none of them set,
    // those of DeepSpeed's DynamicLossScaler (initial_scale_power 32, hysteresis 1).
    int initial_scale_power = 16;  // the dynamic scale starts at 2^initial_scale_power
    std::int64_t loss_scale_window = 1000;  // steps without overflow before the scale doubles
    int hysteresis = 2;  // overflows skipped at one scale before it halves
    // true: a step without overflow restores the hysteresis (it counts overflows in a row);
    // false: only a growth of the scale does.
    bool consecutive_hysteresis = false;
    double min_loss_scale = 1;
  } fp16;
  // pipeline: a model in `stages` pipeline stages (an engine trial whose model is a
  // PipelineModule), on ranks = stages x data-parallel replicas.
  struct Pipeline {
    int stages = 1;
    // "parameters" (balance parameter counts), "uniform" (balance layer counts) or "explicit"
    // (`bounds`: the first layer of each stage, then the number of layers).
    std::string partition_method = "parameters";
    std::vector<std::int64_t> bounds;
    int activation_checkpoint_interval = 0;  // layers a segment recomputed in backward; 0: none
    // Not a key: a pipeline's layers run as one stage (a trained pipeline loaded on one rank).
    bool as_one_stage = false;
  } pipeline;
};

// The batch sizes an engine trial trains with: train_batch_size records a step across the
// data-parallel ranks, each rank running gradient_accumulation_steps micro-batches of
// micro_batch_size.
struct EngineBatch {
  std::int64_t train_batch_size = 0;
  std::int64_t micro_batch_size = 0;
  std::int64_t accumulation_steps = 1;
};

// DeepSpeed's rule, train_batch_size = micro x accumulation x ranks, with the unset sizes
// derived from the set ones; `global_batch_size` (hyperparameters.global_batch_size), when
// given, is the train_batch_size and wins over engine.train_batch_size. nullopt with the reason
// in `error` when the sizes do not agree or too few are set.
std::optional<EngineBatch> resolve_engine_batch(const EngineConfig& engine, std::optional<std::int64_t> global_batch_size,
                                                int ranks, std::string& error);
// The data-parallel replicas of `ranks` with the engine's pipeline (ranks / stages); nullopt with
// the reason in `error` when the stages do not divide them.
std::optional<int> engine_replicas(const EngineConfig& engine, int ranks, std::string& error);

struct Reproducibility {
  // Unset: chosen when the experiment is created, and recorded in its effective config.
  std::optional<std::uint32_t> experiment_seed;
};

// What is recorded beside the metrics (Determined's profiling section): batches through LibTorch's
// profiler, into a Chrome trace per rank, and the system metrics' period.
struct Profiling {
  bool enabled = false;
  std::int64_t begin_on_batch = 1;  // the first batch recorded, counted from 1
  // The last batch recorded; unset: begin_on_batch + 9.
  std::optional<std::int64_t> end_after_batch;
  // CPU, memory and I/O of each rank (and its GPU) every this many seconds; 0: none. Apart from
  // `enabled`.
  std::int64_t system_metrics_period_seconds = 60;
  std::int64_t last_batch() const { return end_after_batch ? *end_after_batch : begin_on_batch + 9; }
};

struct CheckpointStorage {
  std::string type = "shared_fs";
  // Empty: each trial's <trial dir>/checkpoints. Else each trial's checkpoints go in a folder
  // below it (core::checkpoint_dir). Loading makes a relative path absolute: relative to the
  // file that sets it (a template's directory for a template's value), or to the working
  // directory for --set.
  std::string host_path;
  int save_trial_latest = 1;
  int save_trial_best = 1;
  bool async = true;
  // Checkpoint files 0640 and directories 0750 (members of the owner's group may read them, to
  // share a trained model) instead of the private 0600/0700.
  bool group_readable = false;
  // min_checkpoint_period: auto checkpoints as often as keeps the measured cost of checkpoints
  // within this share of training time, and at least every auto_max_interval_seconds.
  double auto_overhead = 0.01;
  std::int64_t auto_max_interval_seconds = 30 * 60;
};

// checkpoint_levels: copies of a trial's state kept nearer than the shared filesystem, each a
// store of the same checkpoint files (docs/user-guide.md, "Checkpoint levels").
struct CheckpointLevels {
  // memory: every `memory_period` (batches, or seconds agreed on by the ranks; with
  // `memory_auto`, as often as the copies' measured cost stays within 1 % of the time) each rank
  // copies its state into node-local memory (`memory_dir`, a tmpfs), where a restart inside the
  // job finds it after a rank failed.
  bool memory_on = false;
  bool memory_auto = false;
  Length memory_period{LengthUnit::kBatches, 0};
  std::string memory_dir = "/dev/shm";
  // The share of the node's memory that its ranks' copies (two a rank) may take; more is refused.
  double memory_max_share = 0.25;
  // partner: each memory copy also sent to a rank on the next node, which keeps it, so that the
  // loss of a whole node loses none that the partner holds. Needs the memory level.
  bool partner = false;
  bool memory() const { return memory_on; }
};

// data.stage: the input data copied once per node to node-local storage before training
// (trainer/src/data/staging.h).
struct DataStage {
  enum class To { kNone, kNodeLocal, kShm, kPath };
  To to = To::kNone;   // kNodeLocal: $TMPDIR where the node sets it, else /tmp; kShm: /dev/shm
  std::string path;    // kPath: an absolute directory on each node
  // The keys of `data` whose paths are staged; empty: every key holding an absolute path.
  std::vector<std::string> keys;
};

// environment.image and its runtime: every rank runs inside the image (the hybrid model: the
// host's mpirun or srun starts one container a rank; `hpctrial launch` and the scheduler's
// commands stay on the host). Rendered by launcher/src/container.cpp. kEnroot: Slurm's pyxis
// plugin starts each srun task in the image (launcher.mpi: srun), the rank's parent included.
struct Container {
  enum class Runtime { kNone, kPodman, kApptainer, kSingularity, kEnroot };
  std::string image;  // empty: no container
  Runtime runtime = Runtime::kNone;
  // environment.bind: extra mounts "HOST[:CONTAINER[:ro|rw]]", both paths absolute.
  std::vector<std::string> binds;
};

// The runtime's name as the config spells it ("podman"); empty for kNone.
std::string runtime_name(Container::Runtime runtime);

// NAME=value for the ranks or the batch job. `value` may hold ${env:NAME} references to the
// submitting environment, resolved at submission.
struct EnvVar {
  std::string name;
  std::string value;
};

// How `hpctrial launch` and `hpctrial run` start the ranks.
struct LauncherConfig {
  // What starts them: Open MPI's mpirun, or, inside a Slurm job, `srun --mpi=pmix` (a job step
  // of Slurm's, its tasks the ranks).
  enum class Mpi { kMpirun, kSrun };
  Mpi mpi = Mpi::kMpirun;
  // Put before the entrypoint on every rank, e.g. [numactl, --interleave=all] or [nsys, profile].
  std::vector<std::string> prefix;
  // Added to the mpirun command line as they are (site MCA parameters, e.g. [--mca, btl, ^openib]).
  std::vector<std::string> mpirun_args;
  // Added to the srun command line as they are (e.g. [--network=..., --gres-flags=...]).
  std::vector<std::string> srun_args;
  // No rank finishing a step for this long ends the attempt as a failure (the hang watchdog).
  std::int64_t hang_timeout_seconds = 3600;
  // Run once on each node before every start of the ranks (Determined's startup hook), in their
  // environment and container; empty: none. A string in the config is run by /bin/sh -c.
  std::vector<std::string> startup_hook;
};

// The launcher's name as the config spells it: "mpirun" or "srun".
std::string mpi_name(LauncherConfig::Mpi mpi);

struct SchedulerConfig {
  // A name in the registry of schedulers (launcher/schedulers.h): "local", "slurm", "pbs".
  std::string type = "local";
  std::string account;
  // The keys of scheduler: that belong to one scheduler (Slurm's partition and qos, PBS's queue),
  // in the order written. Each scheduler declares and vets its own (Scheduler::options,
  // check_scheduler_config in scheduler.h); a config loaded without the registry keeps them as
  // they are (a stored config, checked when it was submitted).
  std::vector<ConfigEntry> options;
  std::optional<std::int64_t> time_limit_seconds;
  std::int64_t preemption_grace_seconds = 180;
  std::vector<std::string> modules;
  std::vector<EnvVar> environment;
  std::vector<std::string> extra_directives;
  // Where the user wrote type, account and each option ("type" -> exp.yaml:4:19), for the errors
  // a scheduler reports about its own options (Scheduler::check_config).
  std::map<std::string, SourceLocation> written_at;

  // The scalar value of option `key`; empty when the config does not set it.
  std::string option(const std::string& key) const;
};

// An inference experiment (`inference:`, in place of `searcher:`): one trial that runs the
// trial's predict_batch over its inference data with a trained checkpoint's weights, on every
// rank, and writes one row per record into one HDF5 file (docs/user-guide.md, "Batch inference").
struct Inference {
  // The checkpoint whose weights are evaluated: a checkpoint file, a trial's checkpoint
  // directory (its latest good one) or, with trial_id, an experiment directory. Absolute.
  std::string checkpoint;
  std::optional<int> trial_id;
  // Records a rank predicts at once; unset: the inference data loader's batch size.
  std::optional<std::int64_t> batch_size;
  // How often the rows written are made durable and the progress recorded: the work a
  // preemption or a crash can cost ({batches: N} on each rank, or {seconds: N}).
  Length progress_period{LengthUnit::kSeconds, 30};
};

struct ExperimentConfig {
  std::string name;
  std::string description;
  Entrypoint entrypoint;
  std::vector<std::pair<std::string, Hyperparameter>> hyperparameters;
  Searcher searcher;  // a single trial, not read from the config, for an inference experiment
  std::optional<Inference> inference;
  std::int64_t records_per_epoch = 0;  // 0: from the training data loader
  std::optional<Length> min_validation_period;
  // An explicit period; unset: see auto_checkpoint_period.
  std::optional<Length> min_checkpoint_period;
  // `min_checkpoint_period: auto` (the default when the key is absent): periodic checkpoints at
  // the interval checkpoint_storage.auto_overhead allows. False for an explicit period or `none`.
  bool auto_checkpoint_period = true;
  Resources resources;
  Optimizations optimizations;
  std::optional<EngineConfig> engine;  // present when the config has an `engine:` section
  Reproducibility reproducibility;
  CheckpointStorage checkpoint_storage;
  CheckpointLevels checkpoint_levels;
  Profiling profiling;
  int max_restarts = 5;
  // Training metrics are reported every this many batches (Determined's scheduling_unit).
  std::int64_t scheduling_unit = 100;
  LauncherConfig launcher;
  SchedulerConfig scheduler;
  // The context folder (Determined's context directory), absolute: frozen with the code when the
  // experiment is made, through its .hpctrialignore, and the ranks' working directory (frozen_code.h).
  std::string context;
  ConfigNode data = ConfigNode::map();
  DataStage stage;  // data.stage
  std::vector<EnvVar> environment;
  Container container;  // environment.image, container_runtime, bind

  // The config file it was read from (empty when built in code).
  std::string source_path;
};

// Where a config comes from: the file, an optional template, and --set overrides in order.
struct ConfigSources {
  std::string config_path;
  std::string template_path;  // empty: none
  std::vector<std::string> overrides;
  // The schedulers whose section of Determined's config (`slurm:`, `pbs:`) the config may hold:
  // the registry's names (load_experiment_config in scheduler.h fills them in).
  std::vector<std::string> scheduler_sections = {};
};

// Reads, merges, overrides and validates. Throws ConfigError listing every problem. The keys of
// scheduler: beyond the common ones are kept as written: the registry's check (scheduler.h) vets
// them, as `hpctrial config`, `run` and `submit` do; a stored config was vetted when submitted.
ExperimentConfig load_experiment_config(const ConfigSources& sources);
// The same, with a site's defaults (a YAML map like a template; empty path: none) merged under
// the template: site < template < config < --set.
ExperimentConfig load_experiment_config(const ConfigSources& sources, const std::string& site_path);
// The same, with `check` adding its problems to the config's own before any is thrown (the
// registry's check of scheduler.*: load_experiment_config in scheduler.h).
using ConfigCheck = std::function<void(const ExperimentConfig&, Diagnostics&)>;
ExperimentConfig load_experiment_config(const ConfigSources& sources, const std::string& site_path,
                                        const ConfigCheck& check);

// The keys of scheduler: every scheduler has (type, account, time_limit, ...), in the reference's order.
const std::vector<std::string>& scheduler_common_keys();
// Checks a scheduler option's value: a name of letters, digits, '.', '_' and '-' (with
// `allow_at`, optionally @server), which a batch script can hold unquoted.
bool check_scheduler_name(const ConfigNode& node, const std::string& path, Diagnostics& diagnostics,
                          bool allow_at);

// Validates a tree (already merged and overridden). Problems go to `diagnostics`. A top-level key
// named in `scheduler_sections` is that scheduler's section of Determined's config: read as
// hpctrial's keys where it is the config's scheduler.type, left out otherwise.
ExperimentConfig parse_experiment_config(const ConfigNode& root, Diagnostics& diagnostics,
                                         const std::vector<std::string>& scheduler_sections = {});

// The effective config as YAML, every key present, in the order of the reference.
std::string to_yaml(const ExperimentConfig& config);

// Parses "90s", "45m", "2h", "1d", "HH:MM:SS", "MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS" into
// seconds; nullopt (with a reason) when the text is none of those.
std::optional<std::int64_t> parse_duration(const std::string& text, std::string* reason);
// Seconds as "D-HH:MM:SS" / "HH:MM:SS".
std::string format_duration(std::int64_t seconds);
// Parses "64G", "512M", "1.5T", "64GiB", "64gb" (binary units) into bytes.
std::optional<std::uint64_t> parse_memory(const std::string& text, std::string* reason);
std::string format_memory(std::uint64_t bytes);

}  // namespace hpctrial::core
