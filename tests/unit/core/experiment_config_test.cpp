#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/search.h"

#include <fstream>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../../support/temp_dir.h"
#include "hpctrial/core/error.h"

namespace hpctrial::core {
namespace {

using testing::ElementsAre;
using testing::HasSubstr;
using testing_support::TempDir;

const char* kMinimal = R"(name: t
entrypoint: ./trial
searcher: {name: single, metric: loss, max_length: {batches: 10}}
)";

// Every problem in `yaml` (read as "exp.yaml"), one "file:line:col: path: message" each.
std::vector<std::string> errors_of(const std::string& yaml) {
  Diagnostics d;
  const ConfigNode root = parse_config_text(yaml, "exp.yaml", d);
  if (d.empty()) parse_experiment_config(root, d);
  std::vector<std::string> out;
  for (const auto& item : d.items()) out.push_back(item.to_string());
  return out;
}

ExperimentConfig parse_ok(const std::string& yaml) {
  Diagnostics d;
  const ConfigNode root = parse_config_text(yaml, "exp.yaml", d);
  ExperimentConfig config = parse_experiment_config(root, d);
  EXPECT_TRUE(d.empty()) << d.to_string();
  return config;
}

std::string one_error(const std::string& yaml) {
  const auto errors = errors_of(yaml);
  EXPECT_EQ(errors.size(), 1u) << testing::PrintToString(errors);
  return errors.empty() ? "" : errors.front();
}

TEST(ExperimentConfig, MinimalConfigGetsEveryDefault) {
  const ExperimentConfig c = parse_ok(kMinimal);
  EXPECT_EQ(c.name, "t");
  EXPECT_EQ(c.description, "");
  EXPECT_EQ(c.entrypoint.kind, Entrypoint::Kind::kExecutable);
  EXPECT_THAT(c.entrypoint.argv, ElementsAre("./trial"));
  EXPECT_TRUE(c.hyperparameters.empty());
  EXPECT_EQ(c.searcher.name, Searcher::Name::kSingle);
  EXPECT_EQ(c.searcher.metric, "loss");
  EXPECT_TRUE(c.searcher.smaller_is_better);
  EXPECT_EQ(c.searcher.max_length.unit, LengthUnit::kBatches);
  EXPECT_EQ(c.searcher.max_length.value, 10);
  EXPECT_EQ(c.searcher.max_trials, 1);
  EXPECT_EQ(c.records_per_epoch, 0);
  EXPECT_FALSE(c.min_validation_period.has_value());
  EXPECT_FALSE(c.min_checkpoint_period.has_value());
  EXPECT_TRUE(c.auto_checkpoint_period);  // periodic checkpoints by default
  EXPECT_EQ(c.checkpoint_storage.auto_overhead, 0.01);
  EXPECT_EQ(c.checkpoint_storage.auto_max_interval_seconds, 1800);
  EXPECT_FALSE(c.checkpoint_levels.memory()) << "no memory level unless asked for";
  EXPECT_EQ(c.resources.slots_per_trial, 1);
  EXPECT_EQ(c.resources.slots_per_node, 1);
  EXPECT_EQ(c.resources.cpus_per_slot, 1);
  EXPECT_EQ(c.resources.gpus_per_slot, 0);
  EXPECT_FALSE(c.resources.memory_per_node_bytes.has_value());
  EXPECT_EQ(c.resources.max_excluded_nodes, 2);
  EXPECT_EQ(c.resources.spare_nodes, 0);
  EXPECT_EQ(c.optimizations.aggregation_frequency, 1);
  EXPECT_TRUE(c.optimizations.average_training_metrics);
  EXPECT_EQ(c.optimizations.bucket_cap_mb, 25.0);
  EXPECT_EQ(c.optimizations.gradient_compression, GradientCompression::kNone);
  EXPECT_EQ(c.optimizations.collective_timeout_seconds, 1800);
  EXPECT_EQ(c.optimizations.replica_check_period, 0);
  EXPECT_TRUE(c.optimizations.huge_pages);
  EXPECT_FALSE(c.reproducibility.experiment_seed.has_value());
  EXPECT_EQ(c.checkpoint_storage.type, "shared_fs");
  EXPECT_EQ(c.checkpoint_storage.host_path, "");
  EXPECT_EQ(c.checkpoint_storage.save_trial_latest, 1);
  EXPECT_EQ(c.checkpoint_storage.save_trial_best, 1);
  EXPECT_TRUE(c.checkpoint_storage.async);
  EXPECT_FALSE(c.checkpoint_storage.group_readable);
  EXPECT_EQ(c.max_restarts, 5);
  EXPECT_EQ(c.scheduling_unit, 100);
  EXPECT_TRUE(c.launcher.prefix.empty());
  EXPECT_EQ(c.launcher.hang_timeout_seconds, 3600);
  EXPECT_EQ(c.launcher.mpi, LauncherConfig::Mpi::kMpirun);
  EXPECT_EQ(c.scheduler.type, "local");
  EXPECT_FALSE(c.scheduler.time_limit_seconds.has_value());
  EXPECT_EQ(c.scheduler.preemption_grace_seconds, 180);
  EXPECT_TRUE(c.scheduler.modules.empty());
  EXPECT_TRUE(c.scheduler.environment.empty());
  EXPECT_TRUE(c.scheduler.extra_directives.empty());
  EXPECT_TRUE(c.data.is_map());
  EXPECT_TRUE(c.data.entries().empty());
  EXPECT_TRUE(c.environment.empty());
}

// Every key of the schema, each set to something other than its default.
std::string every_key_yaml() {
  std::ifstream in(HPCTRIAL_SOURCE_DIR "/tests/unit/core/data/every_key.yaml");
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_FALSE(text.str().empty());
  return text.str();
}

TEST(ExperimentConfig, EveryKeyIsRead) {
  const ExperimentConfig c = parse_ok(every_key_yaml());
  EXPECT_EQ(c.name, "full-experiment");
  EXPECT_EQ(c.description, "every key set");
  EXPECT_EQ(c.entrypoint.kind, Entrypoint::Kind::kLibrary);
  EXPECT_EQ(c.entrypoint.library, "./libmodel.so.1");
  EXPECT_EQ(c.entrypoint.trial_class, "ns::MyTrial");

  ASSERT_EQ(c.hyperparameters.size(), 7u);
  const auto& hp = c.hyperparameters;
  EXPECT_EQ(hp[0].first, "global_batch_size");
  EXPECT_EQ(hp[0].second.type, Hyperparameter::Type::kConst);
  EXPECT_EQ(hp[0].second.value.text(), "64");
  EXPECT_EQ(hp[1].second.type, Hyperparameter::Type::kLog);
  EXPECT_EQ(hp[1].second.base, 2.0);
  EXPECT_EQ(hp[1].second.minval, -10.0);
  EXPECT_EQ(hp[1].second.maxval, -2.0);
  EXPECT_EQ(hp[1].second.count, 5);
  EXPECT_EQ(hp[2].second.type, Hyperparameter::Type::kDouble);
  EXPECT_EQ(hp[2].second.maxval, 0.5);
  EXPECT_EQ(hp[3].second.type, Hyperparameter::Type::kInt);
  EXPECT_EQ(hp[3].second.maxval, 8.0);
  EXPECT_EQ(hp[4].second.type, Hyperparameter::Type::kCategorical);
  ASSERT_EQ(hp[4].second.vals.size(), 2u);
  EXPECT_EQ(hp[4].second.vals[1].text(), "tanh");
  EXPECT_EQ(hp[5].second.type, Hyperparameter::Type::kConst);
  EXPECT_EQ(hp[5].second.value.text(), "07");
  EXPECT_TRUE(hp[5].second.value.quoted());
  EXPECT_EQ(hp[6].second.type, Hyperparameter::Type::kNested);
  ASSERT_EQ(hp[6].second.nested.size(), 2u);
  EXPECT_EQ(hp[6].second.nested[1].second.type, Hyperparameter::Type::kCategorical);

  EXPECT_EQ(c.searcher.name, Searcher::Name::kRandom);
  EXPECT_EQ(c.searcher.max_trials, 8);
  EXPECT_EQ(c.searcher.max_concurrent_trials, 4);
  EXPECT_EQ(c.searcher.metric, "val_acc");
  EXPECT_FALSE(c.searcher.smaller_is_better);
  EXPECT_EQ(c.searcher.max_length.unit, LengthUnit::kEpochs);
  EXPECT_EQ(c.searcher.max_length.value, 3);
  EXPECT_EQ(c.records_per_epoch, 50000);
  ASSERT_TRUE(c.min_validation_period.has_value());
  EXPECT_EQ(c.min_validation_period->unit, LengthUnit::kRecords);
  EXPECT_EQ(c.min_validation_period->value, 1000);
  ASSERT_TRUE(c.min_checkpoint_period.has_value());
  EXPECT_EQ(c.min_checkpoint_period->unit, LengthUnit::kSeconds);
  EXPECT_EQ(c.min_checkpoint_period->value, 600);

  EXPECT_EQ(c.resources.slots_per_trial, 8);
  EXPECT_EQ(c.resources.slots_per_node, 4);
  EXPECT_EQ(c.resources.nodes(), 2);
  EXPECT_EQ(c.resources.cpus_per_slot, 6);
  EXPECT_EQ(c.resources.gpus_per_slot, 1);
  EXPECT_EQ(c.resources.memory_per_node_bytes, 1536ull << 30);
  EXPECT_EQ(c.resources.max_excluded_nodes, 3);

  EXPECT_EQ(c.optimizations.aggregation_frequency, 4);
  EXPECT_FALSE(c.optimizations.average_training_metrics);
  EXPECT_EQ(c.optimizations.bucket_cap_mb, 12.5);
  EXPECT_EQ(c.optimizations.gradient_compression, GradientCompression::kBFloat16);
  EXPECT_EQ(c.optimizations.collective_timeout_seconds, 600);
  EXPECT_EQ(c.optimizations.replica_check_period, 500);
  EXPECT_EQ(c.optimizations.network_interface, "ib0");
  EXPECT_FALSE(c.optimizations.huge_pages);
  EXPECT_EQ(c.reproducibility.experiment_seed, 4294967295u);

  EXPECT_EQ(c.checkpoint_storage.host_path, "/scratch/ckpt");
  EXPECT_EQ(c.checkpoint_storage.save_trial_latest, 3);
  EXPECT_EQ(c.checkpoint_storage.save_trial_best, 0);
  EXPECT_FALSE(c.checkpoint_storage.async);
  EXPECT_TRUE(c.checkpoint_storage.group_readable);
  EXPECT_EQ(c.checkpoint_storage.auto_overhead, 0.02);
  EXPECT_EQ(c.checkpoint_storage.auto_max_interval_seconds, 600);
  EXPECT_EQ(c.checkpoint_levels.memory_period.value, 10);
  EXPECT_EQ(c.checkpoint_levels.memory_period.unit, LengthUnit::kBatches);
  EXPECT_EQ(c.checkpoint_levels.memory_dir, "/dev/shm");
  EXPECT_EQ(c.checkpoint_levels.memory_max_share, 0.3);
  EXPECT_FALSE(c.auto_checkpoint_period);
  EXPECT_EQ(c.max_restarts, 0);
  EXPECT_EQ(c.scheduling_unit, 50);
  EXPECT_EQ(c.optimizations.bucket_cap_mb, 12.5);
  EXPECT_EQ(c.launcher.prefix, (std::vector<std::string>{"numactl", "--interleave=all"}));
  EXPECT_EQ(c.launcher.mpirun_args, (std::vector<std::string>{"--mca", "btl", "^openib"}));
  EXPECT_EQ(c.launcher.mpi, LauncherConfig::Mpi::kSrun);
  EXPECT_EQ(c.launcher.srun_args, (std::vector<std::string>{"--network=sn_single"}));
  EXPECT_EQ(c.launcher.hang_timeout_seconds, 1200);
  EXPECT_TRUE(c.profiling.enabled);
  EXPECT_EQ(c.profiling.begin_on_batch, 20);
  EXPECT_EQ(c.profiling.last_batch(), 24);
  EXPECT_EQ(c.profiling.system_metrics_period_seconds, 30);

  EXPECT_EQ(c.scheduler.type, "slurm");
  EXPECT_EQ(c.scheduler.option("partition"), "gpu-long");
  EXPECT_EQ(c.scheduler.account, "proj.42");
  EXPECT_EQ(c.scheduler.option("qos"), "high");
  EXPECT_EQ(c.scheduler.time_limit_seconds, ((24 + 12) * 60 + 30) * 60);
  EXPECT_EQ(c.scheduler.preemption_grace_seconds, 600);
  EXPECT_THAT(c.scheduler.modules, ElementsAre("gcc/12.2", "openmpi/4.1.4+cuda"));
  ASSERT_EQ(c.scheduler.environment.size(), 2u);
  EXPECT_EQ(c.scheduler.environment[1].name, "TOKEN");
  EXPECT_EQ(c.scheduler.environment[1].value, "${env:MY_TOKEN}");
  EXPECT_THAT(c.scheduler.extra_directives, ElementsAre("--exclusive", "--constraint=a100"));

  ASSERT_NE(c.data.find("shards"), nullptr);
  EXPECT_EQ(c.data.find("shards")->items().size(), 2u);
  EXPECT_EQ(c.stage.to, DataStage::To::kPath);
  EXPECT_EQ(c.stage.path, "/local/scratch");
  EXPECT_EQ(c.stage.keys, (std::vector<std::string>{"url"}));
  ASSERT_EQ(c.environment.size(), 2u);
  EXPECT_EQ(c.environment[0].name, "OMP_NUM_THREADS");
  EXPECT_EQ(c.environment[0].value, "6");
  EXPECT_EQ(c.environment[1].value, "");
  EXPECT_EQ(c.container.image, "docker://nvcr.io/nvidia/pytorch:24.01-py3");
  EXPECT_EQ(c.container.runtime, Container::Runtime::kApptainer);
  EXPECT_EQ(c.container.binds, (std::vector<std::string>{"/scratch/data:/data:ro", "/opt/site:/opt/site"}));
}

TEST(ExperimentConfig, PbsSchedulerKeys) {
  const ExperimentConfig c = parse_ok(std::string(kMinimal) +
                                      "scheduler: {type: pbs, queue: workq@pbs01, account: p1, "
                                      "time_limit: 12h, preemption_grace: 90s}\n");
  EXPECT_EQ(c.scheduler.type, "pbs");
  EXPECT_EQ(c.scheduler.option("queue"), "workq@pbs01");
  EXPECT_EQ(c.scheduler.time_limit_seconds, 12 * 3600);
  EXPECT_EQ(c.scheduler.preemption_grace_seconds, 90);
}

TEST(ExperimentConfig, DataStageNamesWhereAndWhatAndRefusesTheRest) {
  EXPECT_EQ(parse_ok(kMinimal).stage.to, DataStage::To::kNone);
  const auto with = [](const std::string& data) { return std::string(kMinimal) + "data: " + data + "\n"; };
  EXPECT_EQ(parse_ok(with("{train: /d/t.h5, stage: node_local}")).stage.to, DataStage::To::kNodeLocal);
  EXPECT_EQ(parse_ok(with("{train: /d/t.h5, stage: shm}")).stage.to, DataStage::To::kShm);
  const ExperimentConfig c = parse_ok(with("{train: /d/t.h5, val: /d/v.h5, stage: {keys: [val]}}"));
  EXPECT_EQ(c.stage.to, DataStage::To::kNodeLocal) << "to: node_local by default";
  EXPECT_EQ(c.stage.keys, (std::vector<std::string>{"val"}));
  EXPECT_EQ(parse_ok(with("{stage: {to: /local//x/}}")).stage.path, "/local/x/");
  EXPECT_EQ(parse_ok(with("{train: /d/t.h5, stage: ~}")).stage.to, DataStage::To::kNone);
  EXPECT_THAT(one_error(with("{stage: $TMPDIR}")),
              HasSubstr("exp.yaml:4:15: data.stage: is \"$TMPDIR\"; write node_local (the node's $TMPDIR, else /tmp)"));
  EXPECT_THAT(one_error(with("{stage: {to: shm, keys: [nope]}}")),
              HasSubstr("data.stage.keys: names \"nope\", which is not a key of data holding a path"));
  EXPECT_THAT(one_error(with("{stage: {to: shm, kees: [a]}}")), HasSubstr("data.stage.kees"));
}

TEST(ExperimentConfig, EntrypointForms) {
  auto argv = parse_ok("name: t\nentrypoint: ./train --epochs 3\nsearcher: {name: single, metric: "
                       "l, max_length: {batches: 1}}\n").entrypoint;
  EXPECT_EQ(argv.kind, Entrypoint::Kind::kExecutable);
  EXPECT_THAT(argv.argv, ElementsAre("./train", "--epochs", "3"));
  auto list = parse_ok("name: t\nentrypoint: [./train, a b, \"x'y\"]\nsearcher: {name: single, "
                       "metric: l, max_length: {batches: 1}}\n").entrypoint;
  EXPECT_THAT(list.argv, ElementsAre("./train", "a b", "x'y"));
}

// --- every class of error names file, line, column and key path ------------------------------

TEST(ConfigErrors, NegativeSlotsMatchesTheDocumentedExample) {
  EXPECT_EQ(one_error(std::string(kMinimal) + "resources:\n  slots_per_trial: -2\n"),
            "exp.yaml:5:20: resources.slots_per_trial: must be a positive integer, got \"-2\"");
}

TEST(ConfigErrors, UnknownKeySuggestsTheClosestKnownKey) {
  EXPECT_EQ(one_error(std::string(kMinimal) + "resources:\n  slot_per_trial: 2\n"),
            "exp.yaml:5:3: resources.slot_per_trial: unknown key; did you mean 'slots_per_trial'?");
  EXPECT_EQ(one_error(std::string(kMinimal) + "max_restart: 2\n"),
            "exp.yaml:4:1: max_restart: unknown key; did you mean 'max_restarts'?");
}

TEST(ConfigErrors, UnknownKeyWithNoCloseMatchListsTheKeys) {
  EXPECT_THAT(one_error(std::string(kMinimal) + "optimizations: {zzz: 1}\n"),
              HasSubstr("exp.yaml:4:17: optimizations.zzz: unknown key; the keys here are: "
                        "aggregation_frequency, average_training_metrics, bucket_cap_mb, "
                        "tensor_fusion_threshold, average_aggregated_gradients, auto_tune_tensor_fusion, "
                        "mixed_precision, gradient_compression, collective_timeout, replica_check_period, "
                        "network_interface, huge_pages, adaptive_batch_size"));
}

TEST(ConfigErrors, LauncherMpi) {
  const std::string base = kMinimal;
  EXPECT_EQ(one_error(base + "launcher: {mpi: mpiexec}\n"),
            "exp.yaml:4:17: launcher.mpi: is \"mpiexec\"; write mpirun (Open MPI's, the default) or srun (Slurm's, "
            "with PMIx, inside a Slurm job)");
}

TEST(ConfigErrors, MinSlotsPerTrial) {
  const std::string base = kMinimal;
  EXPECT_EQ(one_error(base + "resources: {slots_per_trial: 4, slots_per_node: 2, min_slots_per_trial: 6}\n"),
            "exp.yaml:4:73: resources.min_slots_per_trial: is 6, more than slots_per_trial (4), the most a run "
            "takes; lower it");
  EXPECT_EQ(one_error(base + "resources: {slots_per_trial: 4, slots_per_node: 2, min_slots_per_trial: 1}\n"),
            "exp.yaml:4:73: resources.min_slots_per_trial: must be a multiple of slots_per_node (2): an elastic job "
            "is granted whole nodes");
  Diagnostics d;
  const auto c = parse_experiment_config(
      parse_config_text(base + "resources: {slots_per_trial: 8, slots_per_node: 2, min_slots_per_trial: 4}\n",
                        "exp.yaml", d), d);
  ASSERT_TRUE(d.empty()) << d.to_string();
  EXPECT_TRUE(c.resources.elastic());
  EXPECT_EQ(c.resources.min_nodes(), 2);
  EXPECT_EQ(c.resources.nodes(), 4);
  EXPECT_FALSE(parse_experiment_config(parse_config_text(base, "exp.yaml", d), d).resources.elastic());
}

TEST(ConfigErrors, AdaptiveBatchSize) {
  const std::string base = std::string(kMinimal) + "optimizations:\n  adaptive_batch_size: ";
  EXPECT_EQ(one_error(base + "{enabled: true}\n"),
            "exp.yaml:5:24: optimizations.adaptive_batch_size: enabled needs max_batch_size: the most records a step "
            "may take across the ranks, e.g. max_batch_size: 1024");
  EXPECT_EQ(one_error(base + "{enabled: true, max_batch_size: 64, local_batch_size_bounds: [32, 8]}\n"),
            "exp.yaml:5:85: optimizations.adaptive_batch_size.local_batch_size_bounds: [32, 8]: the lower bound is "
            "above the upper one; write [min, max]");
  EXPECT_THAT(one_error(base + "{enabled: true, max_batch_size: 64, local_batch_size_bounds: 8}\n"),
              HasSubstr("must be a list of two sizes, [min, max]"));
  EXPECT_THAT(one_error(base + "{enabled: true, max_batch_size: 64, scaling_rule: adascal}\n"),
              HasSubstr("unknown scaling rule \"adascal\"; use one of auto, adascale, adamscale, linear, sqrt, legw "
                        "(did you mean 'adascale'?)"));
  EXPECT_THAT(one_error(base + "{enabled: true, max_batch_size: 64, smoothing: 1}\n"), HasSubstr("must be below 1"));
  EXPECT_THAT(one_error(base + "{enabled: true, max_batch_size: 64}\n  aggregation_frequency: 2\n"),
              HasSubstr("chooses how many batches each step accumulates itself; remove "
                        "optimizations.aggregation_frequency"));
  EXPECT_THAT(one_error(base + "{enabled: true, max_batch_size: 64}\nengine: {train_batch_size: 8, "
                               "gradient_accumulation_steps: 2}\n"),
              HasSubstr("chooses how many micro-batches each step accumulates itself; remove "
                        "engine.gradient_accumulation_steps"));
  EXPECT_THAT(one_error(base + "{enabled: true, max_batch_size: 64}\nengine: {train_micro_batch_size_per_gpu: 4}\n"),
              HasSubstr("chooses each rank's micro-batch itself; remove engine.train_micro_batch_size_per_gpu, and "
                        "bound the micro-batch with local_batch_size_bounds: [min, 4]"));
  Diagnostics d;
  const auto c = parse_experiment_config(parse_config_text(base + "{enabled: true, max_batch_size: 64}\n", "exp.yaml", d), d);
  ASSERT_TRUE(d.empty()) << d.to_string();
  EXPECT_TRUE(c.optimizations.adaptive_batch_size.enabled);
  EXPECT_EQ(c.optimizations.adaptive_batch_size.scaling_rule, ScalingRule::kAuto);  // AdaptDL's choice, by optimizer
  EXPECT_EQ(c.optimizations.adaptive_batch_size.decision_interval, 50);
}

TEST(ConfigErrors, DuplicateKeys) {
  EXPECT_EQ(one_error(std::string(kMinimal) + "name: again\n"),
            "exp.yaml:4:1: name: duplicate key (first defined at line 1); remove one of them");
}

TEST(ConfigErrors, WrongTypes) {
  const std::string base = kMinimal;
  EXPECT_EQ(one_error(base + "resources: {slots_per_trial: four}\n"),
            "exp.yaml:4:30: resources.slots_per_trial: must be a positive integer, got \"four\"");
  EXPECT_EQ(one_error(base + "resources: {slots_per_trial: 2.5}\n"),
            "exp.yaml:4:30: resources.slots_per_trial: must be a positive integer, got \"2.5\"");
  EXPECT_EQ(one_error(base + "resources: {slots_per_trial: \"4\"}\n"),
            "exp.yaml:4:30: resources.slots_per_trial: must be a positive integer, got the "
            "string \"4\" (remove the quotes)");
  EXPECT_EQ(one_error(base + "resources: 4\n"),
            "exp.yaml:4:12: resources: must be a map, got \"4\"; e.g. `resources: "
            "{slots_per_trial: 4}`");
  EXPECT_EQ(one_error(base + "checkpoint_storage: {async: yes}\n"),
            "exp.yaml:4:29: checkpoint_storage.async: must be true or false, got \"yes\"");
  EXPECT_EQ(one_error(base + "description: [a]\n"),
            "exp.yaml:4:14: description: must be a string, got a list");
  EXPECT_EQ(one_error(base + "optimizations: {bucket_cap_mb: big}\n"),
            "exp.yaml:4:32: optimizations.bucket_cap_mb: must be a number, got \"big\"");
}

TEST(ConfigErrors, NanAndInfinityAreNotNumbers) {
  const std::string base = kMinimal;
  EXPECT_EQ(one_error(base + "optimizations: {bucket_cap_mb: .nan}\n"),
            "exp.yaml:4:32: optimizations.bucket_cap_mb: must be a finite number, got \".nan\"");
  EXPECT_EQ(one_error(base + "optimizations: {bucket_cap_mb: -.inf}\n"),
            "exp.yaml:4:32: optimizations.bucket_cap_mb: must be a finite number, got \"-.inf\"");
  EXPECT_THAT(one_error(base + "max_restarts: nan\n"),
              HasSubstr("max_restarts: must be a non-negative integer, got \"nan\" (not a finite number)"));
}

TEST(ConfigErrors, NegativeZeroAndAbsurdNumbers) {
  const std::string base = kMinimal;
  EXPECT_EQ(one_error(base + "max_restarts: -1\n"),
            "exp.yaml:4:15: max_restarts: must be a non-negative integer, got \"-1\"");
  EXPECT_EQ(one_error(base + "resources: {max_excluded_nodes: -1}\n"),
            "exp.yaml:4:33: resources.max_excluded_nodes: must be a non-negative integer, got \"-1\"");
  EXPECT_EQ(one_error(base + "resources: {spare_nodes: -1}\n"),
            "exp.yaml:4:26: resources.spare_nodes: must be a non-negative integer, got \"-1\"");
  EXPECT_EQ(one_error(base + "resources: {slots_per_trial: 4, slots_per_node: 2, min_slots_per_trial: 2, spare_nodes: 1}\n"),
            "exp.yaml:4:89: resources.spare_nodes: an elastic job (min_slots_per_trial) runs on every node it is "
            "granted, so none is spare; keep one of spare_nodes and min_slots_per_trial");
  EXPECT_EQ(one_error(base + "resources: {cpus_per_slot: 0}\n"),
            "exp.yaml:4:28: resources.cpus_per_slot: must be a positive integer, got \"0\"");
  EXPECT_EQ(one_error(base + "resources: {gpus_per_slot: 1000}\n"),
            "exp.yaml:4:28: resources.gpus_per_slot: must be at most 64, got \"1000\"");
  EXPECT_EQ(one_error(base + "optimizations: {bucket_cap_mb: 0}\n"),
            "exp.yaml:4:32: optimizations.bucket_cap_mb: must be greater than 0, got \"0\"");
  EXPECT_EQ(one_error(base + "reproducibility: {experiment_seed: 4294967296}\n"),
            "exp.yaml:4:36: reproducibility.experiment_seed: must be at most 4294967295, got "
            "\"4294967296\"");
  EXPECT_EQ(one_error(base + "records_per_epoch: 99999999999999999999999\n"),
            "exp.yaml:4:20: records_per_epoch: must be a positive integer, got "
            "\"99999999999999999999999\"");
}

TEST(ConfigErrors, MissingRequiredKeys) {
  const auto errors = errors_of("description: nothing else\n");
  EXPECT_THAT(errors, ElementsAre(
      "exp.yaml:1:1: name: required key is missing; add it, e.g. `name: mnist-cnn`",
      "exp.yaml:1:1: entrypoint: required key is missing; add it, e.g. `entrypoint: ./my_trial`",
      "exp.yaml:1:1: searcher: required key is missing; add it, e.g. `searcher: {name: single, "
      "metric: validation_loss, max_length: {batches: 1000}}`"));
  EXPECT_EQ(one_error("name: t\nentrypoint: ./t\nsearcher:\n  name: single\n  max_length: {batches: 1}\n"),
            "exp.yaml:4:3: searcher.metric: required key is missing; add it, e.g. `metric: "
            "validation_loss`");
}

TEST(ConfigErrors, AllErrorsAreReportedAtOnce) {
  const auto errors = errors_of(std::string(kMinimal) +
                                "resources: {slots_per_trial: 0, gpus_per_slot: -1}\n"
                                "max_restarts: lots\nfoo: 1\n");
  ASSERT_EQ(errors.size(), 4u) << testing::PrintToString(errors);
  EXPECT_THAT(errors[0], HasSubstr("exp.yaml:4:30: resources.slots_per_trial"));
  EXPECT_THAT(errors[1], HasSubstr("exp.yaml:4:48: resources.gpus_per_slot"));
  EXPECT_THAT(errors[2], HasSubstr("exp.yaml:5:15: max_restarts"));
  EXPECT_THAT(errors[3], HasSubstr("exp.yaml:6:1: foo: unknown key"));
}

TEST(ConfigErrors, Lengths) {
  const std::string head = "name: t\nentrypoint: ./t\n";
  EXPECT_EQ(one_error(head + "searcher: {name: single, metric: l, max_length: {batchs: 10}}\n"),
            "exp.yaml:3:50: searcher.max_length.batchs: unknown unit; use one of batches, epochs "
            "or records (did you mean 'batches'?)");
  EXPECT_EQ(one_error(head + "searcher: {name: single, metric: l, max_length: 100}\n"),
            "exp.yaml:3:49: searcher.max_length: must be a map with exactly one of batches, "
            "epochs or records, e.g. {batches: 1000}; got \"100\"");
  EXPECT_THAT(one_error(head + "searcher: {name: single, metric: l, max_length: {seconds: 10}}\n"),
              HasSubstr("searcher.max_length.seconds: unknown unit"));
  EXPECT_EQ(one_error(std::string(kMinimal) + "min_checkpoint_period: {batches: 1, epochs: 2}\n"),
            "exp.yaml:4:24: min_checkpoint_period: must be a map with exactly one of batches, "
            "epochs, records or seconds, e.g. {batches: 1000}; got 2 keys");
  EXPECT_EQ(one_error(std::string(kMinimal) + "min_validation_period: {epochs: 0}\n"),
            "exp.yaml:4:33: min_validation_period.epochs: must be a positive integer, got \"0\"");
}

TEST(ConfigErrors, Searchers) {
  const std::string head = "name: t\nentrypoint: ./t\n";
  EXPECT_EQ(one_error(head + "searcher: {name: randm, metric: l, max_length: {batches: 1}}\n"),
            "exp.yaml:3:18: searcher.name: unknown searcher \"randm\"; use one of single, grid, "
            "random, adaptive_asha, async_halving (did you mean 'random'?)");
  // One error for an unknown name: the keys are not also checked against the default searcher.
  EXPECT_EQ(one_error(head + "searcher: {name: grdi, metric: l, max_trials: 4, max_length: {batches: 1}}\n"),
            "exp.yaml:3:18: searcher.name: unknown searcher \"grdi\"; use one of single, grid, random, "
            "adaptive_asha, async_halving (did you mean 'grid'?)");
  EXPECT_EQ(one_error(head + "searcher: {name: random, metric: l, max_length: {batches: 1}}\n"),
            "exp.yaml:3:11: searcher.max_trials: required key is missing for the random "
            "searcher; add it, e.g. `max_trials: 16`");
  EXPECT_THAT(one_error(head + "searcher: {name: single, metric: l, max_trials: 3, max_length: {batches: 1}}\n"),
              HasSubstr("exp.yaml:3:49: searcher.max_trials: the single searcher runs exactly one trial"));
  EXPECT_THAT(one_error(head + "searcher: {name: grid, metric: l, max_length: {batches: 1}}\n"
                               "hyperparameters: {lr: {type: double, minval: 0.1, maxval: 1}}\n"),
              HasSubstr("exp.yaml:4:23: hyperparameters.lr: the grid searcher needs `count`"));
}

TEST(ExperimentConfig, TheAdaptiveSearchersReadTheirKeysAndWriteThemBack) {
  std::ifstream in(HPCTRIAL_SOURCE_DIR "/tests/unit/core/data/every_key_asha.yaml");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ExperimentConfig c = parse_ok(text);
  const auto check = [](const ExperimentConfig& c) {
    EXPECT_EQ(c.searcher.name, Searcher::Name::kAdaptiveAsha);
    EXPECT_TRUE(c.searcher.adaptive());
    EXPECT_EQ(c.searcher.mode, Searcher::Mode::kStandard);
    EXPECT_EQ(c.searcher.divisor, 4);
    EXPECT_EQ(c.searcher.max_rungs, 5);
    EXPECT_EQ(c.searcher.bracket_rungs, (std::vector<int>{4, 3}));
    EXPECT_FALSE(c.searcher.stop_once);
    EXPECT_EQ(c.searcher.max_trials, 64);
  };
  check(c);
  check(parse_ok(to_yaml(c)));
  // Each trial sampled as random samples it.
  c.reproducibility.experiment_seed = 9;
  EXPECT_EQ(trial_count(c), 64);
  ExperimentConfig random = c;
  random.searcher.name = Searcher::Name::kRandom;
  EXPECT_EQ(trial_config(c, 5).hyperparameters[0].second.value.text(),
            trial_config(random, 5).hyperparameters[0].second.value.text());
  const ExperimentConfig halving =
      parse_ok("name: t\nentrypoint: ./t\nsearcher: {name: async_halving, metric: l, max_length: {epochs: 9}, "
               "max_trials: 8, num_rungs: 3, divisor: 3, stop_once: true}\n");
  EXPECT_EQ(halving.searcher.num_rungs, 3);
  EXPECT_EQ(halving.searcher.divisor, 3);
  EXPECT_TRUE(halving.searcher.stop_once);
  EXPECT_EQ(parse_ok(to_yaml(halving)).searcher.num_rungs, 3);
}

TEST(ConfigErrors, AdaptiveSearchers) {
  const std::string head = "name: t\nentrypoint: ./t\nsearcher: {metric: l, max_length: {batches: 64}, ";
  EXPECT_EQ(one_error(head + "name: random, max_trials: 4, divisor: 3}\n"),
            "exp.yaml:3:88: searcher.divisor: the random searcher has no divisor; it is a key of adaptive_asha and "
            "async_halving");
  EXPECT_EQ(one_error(head + "name: async_halving, max_trials: 4}\n"),
            "exp.yaml:3:11: searcher.num_rungs: required key is missing for the async_halving searcher; add it, e.g. "
            "`num_rungs: 3`");
  EXPECT_THAT(one_error(head + "name: adaptive_asha, max_trials: 4, num_rungs: 2}\n"),
              HasSubstr("searcher.num_rungs: the adaptive_asha searcher has no num_rungs; it belongs to the other "
                        "adaptive searcher"));
  EXPECT_THAT(one_error(head + "name: adaptive_asha}\n"),
              HasSubstr("searcher.max_trials: required key is missing for the adaptive_asha searcher"));
  EXPECT_THAT(one_error(head + "name: adaptive_asha, max_trials: 4, divisor: 1}\n"), HasSubstr("searcher.divisor:"));
  EXPECT_THAT(one_error(head + "name: adaptive_asha, max_trials: 4, mode: fast}\n"),
              HasSubstr("searcher.mode: unknown mode \"fast\""));
  EXPECT_THAT(one_error(head + "name: adaptive_asha, max_trials: 4, bracket_rungs: 3}\n"),
              HasSubstr("searcher.bracket_rungs: must be a list of rung counts"));
}

TEST(ConfigErrors, Hyperparameters) {
  const std::string base = kMinimal;
  EXPECT_EQ(one_error(base + "hyperparameters: {lr: {type: doubel, minval: 0, maxval: 1}}\n"),
            "exp.yaml:4:30: hyperparameters.lr.type: unknown hyperparameter type \"doubel\"; use "
            "one of const, int, double, log, categorical (did you mean 'double'?)");
  EXPECT_THAT(one_error(base + "hyperparameters: {lr: {type: double, minval: 1, maxval: 0.5}}\n"),
              HasSubstr("exp.yaml:4:23: hyperparameters.lr: minval (1) must be less than maxval (0.5)"));
  EXPECT_EQ(one_error(base + "hyperparameters: {n: {type: int, minval: 1.5, maxval: 4}}\n"),
            "exp.yaml:4:42: hyperparameters.n.minval: must be an integer, got \"1.5\"");
  EXPECT_EQ(one_error(base + "hyperparameters: {a: {type: categorical, vals: []}}\n"),
            "exp.yaml:4:48: hyperparameters.a.vals: must be a non-empty list of choices, e.g. "
            "[32, 64, 128]; got a list");
  EXPECT_EQ(one_error(base + "hyperparameters: {a: {type: log, minval: 1, maxval: 2, base: 1}}\n"),
            "exp.yaml:4:62: hyperparameters.a.base: must not be 1 (every power of 1 is 1); e.g. base: 10");
  EXPECT_EQ(one_error(base + "hyperparameters: {a: {type: const}}\n"),
            "exp.yaml:4:22: hyperparameters.a.val: required key is missing; add it, e.g. `val: 0.01`");
  EXPECT_EQ(one_error(base + "hyperparameters: {a: {type: int, minval: 1, maxval: 3, cnt: 2}}\n"),
            "exp.yaml:4:56: hyperparameters.a.cnt: unknown key; did you mean 'count'?");
  EXPECT_THAT(one_error(base + "hyperparameters: {a: }\n"),
              HasSubstr("hyperparameters.a: has no value"));
}

TEST(ConfigErrors, GlobalBatchSizeNeedsARecordPerSlot) {
  EXPECT_EQ(one_error(std::string(kMinimal) + "resources: {slots_per_trial: 3}\n"
                                              "hyperparameters: {global_batch_size: 2}\n"),
            "exp.yaml:5:38: hyperparameters.global_batch_size: must be an integer of at least "
            "resources.slots_per_trial (3), got \"2\"");
  // Not a multiple of the slots is allowed: the remainder is dropped with a warning at start.
  const std::string text = std::string(kMinimal) + "resources: {slots_per_trial: 3}\n"
                                                   "hyperparameters: {global_batch_size: 100}\n";
  EXPECT_EQ(parse_ok(text).resources.slots_per_trial, 3);
}

TEST(ConfigErrors, GradientCompressionAndCollectiveTimeout) {
  const std::string base = kMinimal;
  EXPECT_EQ(parse_ok(base + "optimizations: {gradient_compression: true}\n")
                .optimizations.gradient_compression,
            GradientCompression::kFloat16);
  EXPECT_EQ(parse_ok(base + "optimizations: {gradient_compression: false}\n")
                .optimizations.gradient_compression,
            GradientCompression::kNone);
  EXPECT_EQ(parse_ok(base + "optimizations: {gradient_compression: fp16}\n")
                .optimizations.gradient_compression,
            GradientCompression::kFloat16);
  EXPECT_THAT(one_error(base + "optimizations: {gradient_compression: fp8}\n"),
              HasSubstr("optimizations.gradient_compression: unknown gradient compression \"fp8\"; use "
                        "one of none, fp16, bf16"));
  EXPECT_THAT(one_error(base + "optimizations: {replica_check_period: -1}\n"),
              HasSubstr("optimizations.replica_check_period: must be"));
  EXPECT_EQ(parse_ok(base + "optimizations: {network_interface: ib0}\n").optimizations.network_interface, "ib0");
  EXPECT_EQ(one_error(base + "optimizations: {network_interface: 'eth0; rm'}\n"),
            "exp.yaml:4:36: optimizations.network_interface: \"eth0; rm\" is not a network interface's name (at most "
            "15 letters, digits, '_', '.', ':' or '-', as `ip link` lists them: ib0, eth1, enp65s0f0)");
  EXPECT_THAT(one_error(base + "optimizations: {collective_timeout: 0s}\n"),
              HasSubstr("optimizations.collective_timeout: must be between 00:00:01 and"));
}

TEST(ConfigErrors, Profiling) {
  const std::string base = kMinimal;
  const ExperimentConfig defaults = parse_ok(base);
  EXPECT_FALSE(defaults.profiling.enabled);
  EXPECT_EQ(defaults.profiling.begin_on_batch, 1);
  EXPECT_EQ(defaults.profiling.last_batch(), 10) << "ten batches from begin_on_batch";
  EXPECT_EQ(defaults.profiling.system_metrics_period_seconds, 60);
  EXPECT_EQ(parse_ok(base + "profiling: {begin_on_batch: 5}\n").profiling.last_batch(), 14);
  EXPECT_EQ(parse_ok(base + "profiling: {system_metrics_period: 0s}\n").profiling.system_metrics_period_seconds, 0);
  EXPECT_THAT(one_error(base + "profiling: {begin_on_batch: 8, end_after_batch: 3}\n"),
              HasSubstr("profiling.end_after_batch: must not come before begin_on_batch (8), got \"3\""));
  EXPECT_THAT(one_error(base + "profiling: {begin_on_batch: 0}\n"),
              HasSubstr("profiling.begin_on_batch: must be"));
  EXPECT_THAT(one_error(base + "profiling: {enabled: sometimes}\n"), HasSubstr("profiling.enabled:"));
  EXPECT_THAT(one_error(base + "profiling: {sync_timings: true}\n"), HasSubstr("profiling.sync_timings: unknown key"));
}

TEST(ConfigErrors, Resources) {
  const std::string base = kMinimal;
  EXPECT_EQ(one_error(base + "resources: {slots_per_trial: 6, slots_per_node: 4}\n"),
            "exp.yaml:4:49: resources.slots_per_node: slots_per_trial (6) must be a multiple of "
            "slots_per_node (4) so every node runs the same number of ranks; use slots_per_trial 4 or 8");
  EXPECT_THAT(one_error(base + "resources: {slots_per_trial: 2, slots_per_node: 4}\n"),
              HasSubstr("resources.slots_per_node: is 4, more than slots_per_trial (2)"));
  EXPECT_EQ(one_error(base + "resources: {memory_per_node: 64}\n"),
            "exp.yaml:4:30: resources.memory_per_node: \"64\" has no unit (Slurm reads megabytes, "
            "PBS bytes); write e.g. 512M, 64G or 1.5T (binary units: 1G = 1024M)");
  EXPECT_THAT(one_error(base + "resources: {memory_per_node: 64Q}\n"),
              HasSubstr("resources.memory_per_node: \"64Q\" has an unknown unit \"Q\""));
}

TEST(ConfigErrors, Durations) {
  const std::string base = kMinimal;
  EXPECT_EQ(one_error(base + "scheduler: {time_limit: 90}\n"),
            "exp.yaml:4:25: scheduler.time_limit: \"90\" a bare number is ambiguous (Slurm reads "
            "minutes, PBS seconds); add a unit: write e.g. 90s, 45m, 2h, 1d, 02:00:00 or 1-12:00:00");
  EXPECT_THAT(one_error(base + "scheduler: {time_limit: \"01:75:00\"}\n"),
              HasSubstr("scheduler.time_limit: \"01:75:00\" has 75 minutes; minutes must be below 60"));
  EXPECT_EQ(one_error(base + "scheduler: {time_limit: 10m, preemption_grace: 15m}\n"),
            "exp.yaml:4:48: scheduler.preemption_grace: preemption_grace (00:15:00) must be "
            "shorter than time_limit (00:10:00), or the trial is asked to stop before it starts");
  EXPECT_THAT(one_error(base + "scheduler: {preemption_grace: 20h}\n"),
              HasSubstr("scheduler.preemption_grace: must be between 00:00:10 and 18:12:15"));
}

// Determined's optimization keys: an alias where hpctrial has the concept, and a located refusal
// that says what to do where it has not.
TEST(ConfigErrors, DeterminedOptimizationKeys) {
  const std::string base = kMinimal;
  EXPECT_EQ(parse_ok(base + "optimizations: {tensor_fusion_threshold: 64}\n").optimizations.bucket_cap_mb, 64);
  EXPECT_EQ(one_error(base + "optimizations: {bucket_cap_mb: 25, tensor_fusion_threshold: 64}\n"),
            "exp.yaml:4:61: optimizations.tensor_fusion_threshold: is Determined's name for bucket_cap_mb, which "
            "is also set; keep one of them");
  EXPECT_THAT(one_error(base + "optimizations: {average_aggregated_gradients: false}\n"),
              HasSubstr("optimizations.average_aggregated_gradients: false (summing aggregated gradients) is not "
                        "supported: hpctrial averages them; to step with their sum, multiply the learning rate"));
  EXPECT_THAT(one_error(base + "optimizations: {auto_tune_tensor_fusion: true}\n"),
              HasSubstr("optimizations.auto_tune_tensor_fusion: is not supported: set the bucket size with "
                        "bucket_cap_mb"));
  EXPECT_THAT(one_error(base + "optimizations: {mixed_precision: O1}\n"),
              HasSubstr("optimizations.mixed_precision: \"O1\" (Apex AMP) is not supported"));
  EXPECT_THAT(one_error(base + "scheduling_unit: 0\n"), HasSubstr("scheduling_unit: must be"));
}

TEST(ConfigErrors, Schedulers) {
  const std::string base = kMinimal;
  // Which names and options each scheduler has is the registry's (scheduler_test.cpp).
  EXPECT_EQ(one_error(base + "scheduler: {type: [slurm]}\n"),
            "exp.yaml:4:19: scheduler.type: must be a string, got a list");
  EXPECT_THAT(one_error(base + "scheduler: {account: \"gpu; rm -rf /\"}\n"),
              HasSubstr("scheduler.account: must be a name of letters, digits"));
  EXPECT_EQ(one_error(base + "scheduler: {modules: [\"gcc 12\"]}\n"),
            "exp.yaml:4:23: scheduler.modules[0]: is not a module name (letters, digits and . _ + "
            "/ -), got \"gcc 12\"");
  EXPECT_EQ(one_error(base + "scheduler: {extra_directives: [\"#SBATCH --exclusive\"]}\n"),
            "exp.yaml:4:32: scheduler.extra_directives[0]: must be an option such as --exclusive "
            "or -l place=scatter (without the #SBATCH / #PBS prefix), got \"#SBATCH --exclusive\"");
  EXPECT_THAT(one_error(base + "scheduler: {extra_directives: [\"--a\\n--b\"]}\n"),
              HasSubstr("scheduler.extra_directives[0]: contains a control character"));
}

TEST(ConfigErrors, EnvironmentVariables) {
  const std::string base = kMinimal;
  EXPECT_EQ(one_error(base + "environment: {1X: a}\n"),
            "exp.yaml:4:15: environment.1X: is not a valid variable name; use letters, digits and "
            "'_', not starting with a digit");
  EXPECT_EQ(one_error(base + "environment: {HPCTRIAL_RANK: a}\n"),
            "exp.yaml:4:15: environment.HPCTRIAL_RANK: variables starting with HPCTRIAL_ are set "
            "by hpctrial itself; choose another name");
  EXPECT_THAT(one_error(base + "scheduler: {environment: {A: \"${HOME}\"}}\n"),
              HasSubstr("scheduler.environment.A: has \"${HOME}\"; the only substitution is ${env:NAME}"));
  EXPECT_THAT(one_error(base + "environment: {A: \"${env:X\"}\n"),
              HasSubstr("environment.A: has an unterminated \"${\""));
  EXPECT_EQ(one_error(base + "environment: {A: }\n"),
            "exp.yaml:4:15: environment.A: must be a string, got null; write \"\" for an empty value");
}

TEST(ConfigErrors, Entrypoints) {
  const std::string tail = "searcher: {name: single, metric: l, max_length: {batches: 1}}\n";
  EXPECT_THAT(one_error("name: t\nentrypoint: ./train --name \"a b\"\n" + tail),
              HasSubstr("exp.yaml:2:13: entrypoint: contains quotes or backslashes; hpctrial runs "
                        "the entrypoint without a shell"));
  EXPECT_THAT(one_error("name: t\nentrypoint: ./lib.so:1Trial\n" + tail),
              HasSubstr("entrypoint: looks like a trial library but is not LIBRARY.so:TrialClass"));
  EXPECT_EQ(one_error("name: t\nentrypoint: []\n" + tail),
            "exp.yaml:2:13: entrypoint: must not be empty; e.g. [./my_trial, --verbose]");
}

TEST(ConfigErrors, Strings) {
  const std::string tail = "entrypoint: ./t\nsearcher: {name: single, metric: l, max_length: {batches: 1}}\n";
  EXPECT_EQ(one_error("name: \"a\\nb\"\n" + tail),
            "exp.yaml:1:7: name: contains a control character (newline, carriage return or "
            "similar); write it on one line");
  EXPECT_EQ(one_error("name: \"\"\n" + tail), "exp.yaml:1:7: name: must not be empty");
  EXPECT_EQ(one_error("name:\n" + tail),
            "exp.yaml:1:1: name: must be a string, got null (an empty value)");
  EXPECT_THAT(one_error("name: " + std::string(200, 'x') + "\n" + tail),
              HasSubstr("name: is 200 characters; keep it to 128"));
}

TEST(ExperimentConfig, CheckpointPeriodIsAutoNoneOrALength) {
  EXPECT_TRUE(parse_ok(std::string(kMinimal) + "min_checkpoint_period: auto\n").auto_checkpoint_period);
  const ExperimentConfig none = parse_ok(std::string(kMinimal) + "min_checkpoint_period: none\n");
  EXPECT_FALSE(none.auto_checkpoint_period);
  EXPECT_FALSE(none.min_checkpoint_period.has_value());
  const ExperimentConfig length = parse_ok(std::string(kMinimal) + "min_checkpoint_period: {batches: 50}\n");
  EXPECT_FALSE(length.auto_checkpoint_period);
  EXPECT_EQ(length.min_checkpoint_period->value, 50);
  // Each form survives the effective config.
  for (const char* form : {"auto", "none", "{batches: 50}"}) {
    const ExperimentConfig c = parse_ok(std::string(kMinimal) + "min_checkpoint_period: " + form + "\n");
    const ExperimentConfig again = parse_ok(to_yaml(c));
    EXPECT_EQ(again.auto_checkpoint_period, c.auto_checkpoint_period) << form;
    EXPECT_EQ(again.min_checkpoint_period.has_value(), c.min_checkpoint_period.has_value()) << form;
  }
  EXPECT_THAT(one_error(std::string(kMinimal) + "checkpoint_storage: {auto_overhead: 0}\n"),
              HasSubstr("checkpoint_storage.auto_overhead"));
}

// The name is a directory: one safe path component, refused before anything is written.
TEST(ConfigErrors, NamesThatAreNotOneSafePathComponent) {
  const std::string tail = "entrypoint: ./t\nsearcher: {name: single, metric: l, max_length: {batches: 1}}\n";
  const std::string rule = "; it names the experiment's directory, so use letters, digits and . _ - +, starting "
                           "with a letter or digit (e.g. mnist-cnn)";
  EXPECT_EQ(one_error("name: ..\n" + tail), "exp.yaml:1:7: name: \"..\" starts with '.'" + rule);
  EXPECT_EQ(one_error("name: .hidden\n" + tail), "exp.yaml:1:7: name: \".hidden\" starts with '.'" + rule);
  EXPECT_EQ(one_error("name: a/b\n" + tail), "exp.yaml:1:7: name: \"a/b\" holds '/'" + rule);
  EXPECT_EQ(one_error("name: ../x\n" + tail), "exp.yaml:1:7: name: \"../x\" holds '/'" + rule);
  EXPECT_EQ(one_error("name: -rf\n" + tail), "exp.yaml:1:7: name: \"-rf\" starts with '-'" + rule);
  EXPECT_EQ(one_error("name: my run\n" + tail), "exp.yaml:1:7: name: \"my run\" holds a space" + rule);
  EXPECT_EQ(one_error("name: \"a$b\"\n" + tail), "exp.yaml:1:7: name: \"a$b\" holds '$'" + rule);
  for (const char* good : {"mnist-cnn", "lr_0.1", "v2+fp16", "A"}) {
    EXPECT_EQ(parse_ok(std::string("name: ") + good + "\n" + tail).name, good);
  }
}

TEST(ConfigErrors, CheckpointStorage) {
  const std::string base = kMinimal;
  EXPECT_EQ(one_error(base + "checkpoint_storage: {save_trial_latest: 0}\n"),
            "exp.yaml:4:41: checkpoint_storage.save_trial_latest: must be at least 1: a paused, "
            "preempted or requeued trial resumes from its latest checkpoint");
  EXPECT_EQ(one_error(base + "checkpoint_storage: {type: s3}\n"),
            "exp.yaml:4:28: checkpoint_storage.type: unknown storage type \"s3\"; use shared_fs");
}

TEST(ConfigErrors, WholeDocument) {
  EXPECT_EQ(one_error(""), "exp.yaml:1:1: is empty; an experiment config needs at least name, "
                           "entrypoint and searcher (see docs/config-reference.md)");
  EXPECT_EQ(one_error("- a\n- b\n"),
            "exp.yaml:1:1: must be a map of keys (name:, entrypoint:, ...), got a list");
  EXPECT_EQ(one_error("name: [a\n"),
            "exp.yaml:2:1: invalid YAML: end of sequence flow not found");
  EXPECT_THAT(one_error(std::string(kMinimal) + "---\nname: b\n"),
              HasSubstr("exp.yaml:5:1: holds 2 YAML documents"));
  EXPECT_EQ(one_error(std::string(kMinimal) + "? [a, b]\n: c\n"),
              "exp.yaml:4:3: a key must be a plain name, got a list or null as a key");
}

// --- files, templates and overrides ------------------------------------------------------------

TEST(LoadExperimentConfig, ReportsFileLineAndAllErrorsAsOneConfigError) {
  TempDir dir;
  const std::string path = dir.write("exp.yaml", std::string(kMinimal) +
                                                     "resources:\n  slots_per_trial: -2\nfoo: 1\n");
  try {
    load_experiment_config({path, "", {}});
    FAIL() << "an invalid config loaded";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              path + ":5:20: resources.slots_per_trial: must be a positive integer, got \"-2\"\n" +
                  path + ":6:1: foo: unknown key; the keys here are: name, description, entrypoint, "
                         "hyperparameters, inference, searcher, records_per_epoch, min_validation_period, "
                         "min_checkpoint_period, resources, optimizations, engine, reproducibility, "
                         "checkpoint_storage, checkpoint_levels, profiling, launcher, scheduler, scheduling_unit, "
                         "max_restarts, context, data, environment");
  }
}

TEST(LoadExperimentConfig, MissingFileNamesThePath) {
  try {
    load_experiment_config({"/nonexistent/exp.yaml", "", {}});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "/nonexistent/exp.yaml: cannot read: No such file or directory (check the path)");
  }
}

TEST(LoadExperimentConfig, TemplateMergesLikeDetermined) {
  TempDir dir;
  const std::string tmpl = dir.write("site.yaml", R"(scheduler:
  type: slurm
  partition: batch
  modules: [gcc/12]
  environment: {A: "1", B: "2"}
resources: {slots_per_node: 2}
max_restarts: 9
)");
  const std::string config = dir.write("exp.yaml", std::string(kMinimal) + R"(scheduler:
  partition: gpu
  modules: [openmpi/4.1]
  environment: {B: "3"}
resources: {slots_per_trial: 4}
)");
  const ExperimentConfig c = load_experiment_config({config, tmpl, {}});
  EXPECT_EQ(c.scheduler.type, "slurm");  // from the template
  EXPECT_EQ(c.scheduler.option("partition"), "gpu");                     // the config's scalar wins
  EXPECT_THAT(c.scheduler.modules, ElementsAre("gcc/12", "openmpi/4.1"));  // lists concatenate
  ASSERT_EQ(c.scheduler.environment.size(), 2u);               // maps merge recursively
  EXPECT_EQ(c.scheduler.environment[0].value, "1");
  EXPECT_EQ(c.scheduler.environment[1].value, "3");
  EXPECT_EQ(c.resources.slots_per_trial, 4);
  EXPECT_EQ(c.resources.slots_per_node, 2);
  EXPECT_EQ(c.max_restarts, 9);
}

TEST(LoadExperimentConfig, HostPathIsRelativeToTheFileThatSaysIt) {
  TempDir dir;
  const std::string tmpl = dir.write("site/site.yaml", "checkpoint_storage: {host_path: ckpt}\n");
  const std::string config = dir.write("exp/exp.yaml", kMinimal);
  EXPECT_EQ(load_experiment_config({config, "", {"checkpoint_storage.host_path=/abs/../x"}})
                .checkpoint_storage.host_path,
            "/x");
  EXPECT_EQ(load_experiment_config({config, tmpl, {}}).checkpoint_storage.host_path,
            (dir.path() / "site" / "ckpt").string());
  const std::string own = dir.write("exp/own.yaml", std::string(kMinimal) +
                                                        "checkpoint_storage: {host_path: ../c}\n");
  EXPECT_EQ(load_experiment_config({own, "", {}}).checkpoint_storage.host_path,
            (dir.path() / "c").string());
  EXPECT_EQ(one_error(std::string(kMinimal) + "checkpoint_storage: {host_path: ~/c}\n"),
            "exp.yaml:4:33: checkpoint_storage.host_path: \"~/c\" starts with '~', which hpctrial "
            "does not expand (there is no shell); write the full path, e.g. /home/you/...");
}

TEST(LoadExperimentConfig, AFineTuningsSourceIsAbsoluteAndItsTrialNeedsAnExperiment) {
  TempDir dir;
  const std::string config = dir.write("exp/exp.yaml", "name: t\nentrypoint: ./trial\nsearcher: {name: single, "
                                                       "metric: loss, max_length: {batches: 10}, source_checkpoint: "
                                                       "../base, source_trial_id: 2}\n");
  const ExperimentConfig c = load_experiment_config({config, "", {}});
  EXPECT_EQ(c.searcher.source_checkpoint, (dir.path() / "base").string());
  EXPECT_EQ(c.searcher.source_trial_id, 2);
  // Round trip through the effective config.
  const std::string written = dir.write("effective.yaml", to_yaml(c));
  const ExperimentConfig again = load_experiment_config({written, "", {}});
  EXPECT_EQ(again.searcher.source_checkpoint, c.searcher.source_checkpoint);
  EXPECT_EQ(again.searcher.source_trial_id, 2);
  EXPECT_THAT(one_error("name: t\nentrypoint: ./trial\nsearcher: {name: single, metric: loss, max_length: "
                        "{batches: 10}, source_trial_id: 2}\n"),
              HasSubstr("searcher.source_trial_id: names a trial of the experiment directory "
                        "searcher.source_checkpoint names"));
}

// inference: in place of a searcher: its checkpoint made absolute, a single trial, the section
// round-tripped through the effective config; a searcher beside it, or a progress period in
// epochs, is refused where it is written.
TEST(LoadExperimentConfig, AnInferenceExperimentHasNoSearcher) {
  TempDir dir;
  const std::string config = dir.write("exp/exp.yaml", "name: p\nentrypoint: ./trial\ninference: {checkpoint: "
                                                       "../trained, trial_id: 1, batch_size: 512, progress_period: "
                                                       "{batches: 20}}\n");
  const ExperimentConfig c = load_experiment_config({config, "", {}});
  ASSERT_TRUE(c.inference.has_value());
  EXPECT_EQ(c.inference->checkpoint, (dir.path() / "trained").string());
  EXPECT_EQ(c.inference->trial_id, 1);
  EXPECT_EQ(c.inference->batch_size, 512);
  EXPECT_EQ(c.inference->progress_period.unit, LengthUnit::kBatches);
  EXPECT_EQ(c.inference->progress_period.value, 20);
  EXPECT_EQ(c.searcher.name, Searcher::Name::kSingle);
  EXPECT_EQ(c.searcher.max_trials, 1);
  const std::string written = dir.write("effective.yaml", to_yaml(c));
  const ExperimentConfig again = load_experiment_config({written, "", {}});
  ASSERT_TRUE(again.inference.has_value());
  EXPECT_EQ(again.inference->checkpoint, c.inference->checkpoint);
  EXPECT_EQ(again.inference->batch_size, 512);
  EXPECT_EQ(to_yaml(again), to_yaml(c));
  const ExperimentConfig defaults =
      load_experiment_config({dir.write("d.yaml", "name: p\nentrypoint: ./t\ninference: {checkpoint: /c}\n"), "", {}});
  EXPECT_EQ(defaults.inference->progress_period.unit, LengthUnit::kSeconds);
  EXPECT_EQ(defaults.inference->progress_period.value, 30);
  EXPECT_FALSE(defaults.inference->batch_size.has_value());

  EXPECT_THAT(one_error("name: p\nentrypoint: ./t\ninference: {checkpoint: /c}\nsearcher: {name: single, metric: "
                        "loss, max_length: {batches: 1}}\n"),
              HasSubstr("exp.yaml:4:11: searcher: an inference experiment (inference:) runs one trial"));
  EXPECT_THAT(one_error("name: p\nentrypoint: ./t\ninference: {checkpoint: /c, progress_period: {epochs: 1}}\n"),
              HasSubstr("inference.progress_period"));
  EXPECT_THAT(one_error("name: p\nentrypoint: ./t\ninference: {batch_size: 8}\n"),
              HasSubstr("inference.checkpoint: required key is missing"));
  EXPECT_THAT(one_error("name: p\nentrypoint: ./t\ninference: {checkpoint: /c, batch_size: 0}\n"),
              HasSubstr("inference.batch_size"));
}

TEST(LoadExperimentConfig, SetOverridesAreTypedByTheSchema) {
  TempDir dir;
  const std::string config = dir.write("exp.yaml", kMinimal);
  const ExperimentConfig c = load_experiment_config(
      {config, "", {"resources.slots_per_trial=4", "scheduler.modules=[gcc/12, openmpi]",
                    "name=renamed", "searcher.max_length={epochs: 2}", "data.new.deep=3",
                    "hyperparameters.lr=0.5", "checkpoint_storage.async=false"}});
  EXPECT_EQ(c.resources.slots_per_trial, 4);
  EXPECT_THAT(c.scheduler.modules, ElementsAre("gcc/12", "openmpi"));
  EXPECT_EQ(c.name, "renamed");
  EXPECT_EQ(c.searcher.max_length.unit, LengthUnit::kEpochs);
  ASSERT_NE(c.data.find("new"), nullptr);
  EXPECT_EQ(c.data.find("new")->find("deep")->text(), "3");
  ASSERT_EQ(c.hyperparameters.size(), 1u);
  EXPECT_EQ(c.hyperparameters[0].second.value.text(), "0.5");
  EXPECT_FALSE(c.checkpoint_storage.async);
}

TEST(LoadExperimentConfig, BadOverridesNameTheOverride) {
  TempDir dir;
  const std::string config = dir.write("exp.yaml", kMinimal);
  auto error_of = [&](const std::string& assignment) {
    try {
      load_experiment_config({config, "", {assignment}});
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  EXPECT_EQ(error_of("resources.slots_per_trial=-2"),
            "--set resources.slots_per_trial=-2: resources.slots_per_trial: must be a "
            "positive integer, got \"-2\"");
  EXPECT_EQ(error_of("resources.slot_per_trial=2"),
            "--set resources.slot_per_trial=2: resources.slot_per_trial: unknown key; did you "
            "mean 'slots_per_trial'?");
  EXPECT_EQ(error_of("resources"),
            "--set resources: expected KEY.PATH=VALUE, e.g. --set resources.slots_per_trial=4");
  EXPECT_EQ(error_of("resources..x=1"),
            "--set resources..x=1: resources..x: empty key in the path; write keys separated by "
            "single dots, e.g. scheduler.time_limit=2h");
  EXPECT_THAT(error_of("name.first=a"),
              HasSubstr("--set name.first=a: name.first: cannot set a key inside name, which is a "
                        "string (" + config + ":1:7)"));
  EXPECT_THAT(error_of("data.x=[1, 2"), HasSubstr("data.x: the value is not valid YAML"));
}

TEST(LoadExperimentConfig, EffectiveConfigRoundTrips) {
  for (const std::string& text : {std::string(kMinimal), every_key_yaml()}) {
    Diagnostics d;
    const ExperimentConfig first = parse_experiment_config(parse_config_text(text, "a.yaml", d), d);
    ASSERT_TRUE(d.empty()) << d.to_string();
    const std::string yaml = to_yaml(first);
    const ExperimentConfig second = parse_experiment_config(parse_config_text(yaml, "b.yaml", d), d);
    ASSERT_TRUE(d.empty()) << d.to_string() << "\n" << yaml;
    EXPECT_EQ(to_yaml(second), yaml);
  }
}

TEST(LoadExperimentConfig, EffectiveConfigKeepsQuotedStringsStrings) {
  const ExperimentConfig c = parse_ok(std::string(kMinimal) +
                                      "hyperparameters: {code: \"007\", n: 7}\ndata: {flag: \"true\"}\n");
  const std::string yaml = to_yaml(c);
  EXPECT_THAT(yaml, HasSubstr("code: \"007\""));
  EXPECT_THAT(yaml, HasSubstr("n: 7"));
  EXPECT_THAT(yaml, HasSubstr("flag: \"true\""));
}


TEST(EngineConfig, BatchSizesFollowDeepSpeedsRule) {
  std::string error;
  EngineConfig e;
  e.train_micro_batch_size_per_gpu = 4;
  e.gradient_accumulation_steps = 3;
  auto b = resolve_engine_batch(e, std::nullopt, 2, error);
  ASSERT_TRUE(b) << error;
  EXPECT_EQ(b->train_batch_size, 24);
  EXPECT_EQ(b->micro_batch_size, 4);
  EXPECT_EQ(b->accumulation_steps, 3);

  // Two sizes given: the third is derived.
  e = EngineConfig{};
  e.train_batch_size = 32;
  e.gradient_accumulation_steps = 2;
  b = resolve_engine_batch(e, std::nullopt, 4, error);
  ASSERT_TRUE(b) << error;
  EXPECT_EQ(b->micro_batch_size, 4);
  e = EngineConfig{};
  e.train_batch_size = 32;
  e.train_micro_batch_size_per_gpu = 2;
  b = resolve_engine_batch(e, std::nullopt, 4, error);
  ASSERT_TRUE(b) << error;
  EXPECT_EQ(b->accumulation_steps, 4);

  // hyperparameters.global_batch_size wins over train_batch_size, as Determined overwrites a
  // DeepSpeed config.
  e = EngineConfig{};
  e.train_batch_size = 32;
  e.gradient_accumulation_steps = 2;
  b = resolve_engine_batch(e, 64, 4, error);
  ASSERT_TRUE(b) << error;
  EXPECT_EQ(b->train_batch_size, 64);
  EXPECT_EQ(b->micro_batch_size, 8);

  // Only the total: no accumulation.
  b = resolve_engine_batch(EngineConfig{}, 12, 3, error);
  ASSERT_TRUE(b) << error;
  EXPECT_EQ(b->micro_batch_size, 4);
  EXPECT_EQ(b->accumulation_steps, 1);
}

TEST(EngineConfig, InconsistentBatchSizesSayWhatToChange) {
  std::string error;
  EngineConfig e;
  e.train_batch_size = 30;
  e.train_micro_batch_size_per_gpu = 4;
  e.gradient_accumulation_steps = 2;
  EXPECT_FALSE(resolve_engine_batch(e, std::nullopt, 4, error));
  EXPECT_EQ(error, "train_batch_size is 30 but train_micro_batch_size_per_gpu (4) x gradient_accumulation_steps (2) "
                   "x ranks (4) is 32; change one of them, or leave one out to have it derived");
  e.gradient_accumulation_steps.reset();
  EXPECT_FALSE(resolve_engine_batch(e, std::nullopt, 4, error));
  EXPECT_EQ(error, "train_batch_size (30) is not a multiple of train_micro_batch_size_per_gpu (4) x ranks (4) = 16; "
                   "make it a multiple, e.g. 16");
  EXPECT_FALSE(resolve_engine_batch(EngineConfig{}, 10, 4, error));
  EXPECT_EQ(error, "hyperparameters.global_batch_size (which sets train_batch_size) (10) is not a multiple of the 4 "
                   "ranks; make it a multiple, e.g. 8");
  EXPECT_FALSE(resolve_engine_batch(EngineConfig{}, std::nullopt, 4, error));
  EXPECT_THAT(error, HasSubstr("sets no batch size"));
}

TEST(EngineConfig, SectionIsReadAndWrittenBack) {
  const ExperimentConfig c = parse_ok(std::string(kMinimal) +
                                      "resources: {slots_per_trial: 2}\n"
                                      "engine:\n"
                                      "  train_micro_batch_size_per_gpu: 4\n"
                                      "  gradient_accumulation_steps: 2\n"
                                      "  gradient_clipping: 1.5\n"
                                      "  zero_optimization: {stage: 3, reduce_bucket_size: 1000, sub_group_size: 64,\n"
                                      "    stage3_param_persistence_threshold: 1e4, stage3_model_persistence_threshold: 0,\n"
                                      "    stage3_prefetch_bucket_size: 2e6, stage3_max_live_parameters: 3e6, stage3_max_reuse_distance: 0,\n"
                                      "    offload_optimizer: {device: nvme, nvme_path: /local/nvme, buffer_count: 2},\n"
                                      "    offload_param: {device: cpu}}\n"
                                      "  bf16: {enabled: true}\n");
  ASSERT_TRUE(c.engine);
  EXPECT_TRUE(c.engine->bf16);
  EXPECT_EQ(c.engine->train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.engine->gradient_accumulation_steps, 2);
  EXPECT_FALSE(c.engine->train_batch_size);
  EXPECT_EQ(c.engine->gradient_clipping, 1.5);
  EXPECT_EQ(c.engine->zero_stage, 3);
  EXPECT_EQ(c.engine->reduce_bucket_size, 1000);
  const ExperimentConfig again = parse_ok(to_yaml(c));
  ASSERT_TRUE(again.engine);
  EXPECT_EQ(again.engine->train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(again.engine->gradient_accumulation_steps, 2);
  EXPECT_EQ(again.engine->gradient_clipping, 1.5);
  EXPECT_EQ(again.engine->zero_stage, 3);
  EXPECT_EQ(again.engine->reduce_bucket_size, 1000);
  EXPECT_EQ(again.engine->sub_group_size, 64);
  EXPECT_EQ(again.engine->param_persistence_threshold, 10000);
  EXPECT_EQ(again.engine->model_persistence_threshold, 0);
  EXPECT_EQ(again.engine->prefetch_bucket_size, 2'000'000);
  EXPECT_EQ(again.engine->max_live_parameters, 3'000'000);
  EXPECT_EQ(again.engine->max_reuse_distance, 0);
  EXPECT_EQ(again.engine->offload_optimizer.device, "nvme");
  EXPECT_EQ(again.engine->offload_optimizer.nvme_path, "/local/nvme");
  EXPECT_EQ(again.engine->offload_optimizer.buffer_count, 2);
  EXPECT_EQ(again.engine->offload_param.device, "cpu");
  EXPECT_TRUE(again.engine->bf16);
  EXPECT_EQ(parse_ok(std::string(kMinimal) + "engine: {train_micro_batch_size_per_gpu: 4}\n").engine->reduce_bucket_size,
            500000000);
  EXPECT_FALSE(parse_ok(std::string(kMinimal) + "engine: {train_micro_batch_size_per_gpu: 4}\n").engine->bf16);
  EXPECT_FALSE(parse_ok(kMinimal).engine);
  EXPECT_FALSE(parse_ok(to_yaml(parse_ok(kMinimal))).engine);
}

TEST(EngineConfig, Fp16SectionIsReadAndWrittenBack) {
  std::ifstream in(HPCTRIAL_SOURCE_DIR "/tests/unit/core/data/every_key_fp16.yaml");
  std::stringstream text;
  text << in.rdbuf();
  const ExperimentConfig c = parse_ok(text.str());
  for (const ExperimentConfig& config : {c, parse_ok(to_yaml(c))}) {
    ASSERT_TRUE(config.engine);
    const auto& fp16 = config.engine->fp16;
    EXPECT_TRUE(fp16.enabled);
    EXPECT_EQ(fp16.loss_scale, 0);
    EXPECT_EQ(fp16.initial_scale_power, 12);
    EXPECT_EQ(fp16.loss_scale_window, 500);
    EXPECT_EQ(fp16.hysteresis, 3);
    EXPECT_TRUE(fp16.consecutive_hysteresis);
    EXPECT_EQ(fp16.min_loss_scale, 0.5);
  }
  // DeepSpeed's defaults.
  const auto defaults = parse_ok(std::string(kMinimal) + "engine: {train_micro_batch_size_per_gpu: 4}\n").engine->fp16;
  EXPECT_FALSE(defaults.enabled);
  EXPECT_EQ(defaults.loss_scale, 0);
  EXPECT_EQ(defaults.initial_scale_power, 16);
  EXPECT_EQ(defaults.loss_scale_window, 1000);
  EXPECT_EQ(defaults.hysteresis, 2);
  EXPECT_EQ(defaults.min_loss_scale, 1);
}

// DeepSpeed reads its fp16 section in two ways: with none of the dynamic scale's keys its
// DynamicLossScaler's own defaults (2^32, hysteresis 1), with any of them the config's (2^16,
// hysteresis 2).
TEST(EngineConfig, Fp16AloneTakesDeepSpeedsScalerDefaultsAndAnyKeyTheConfigs) {
  const std::string gpu = std::string(kMinimal) + "resources: {gpus_per_slot: 1}\n";
  const ExperimentConfig read = parse_ok(gpu + "engine: {train_batch_size: 64, fp16: {enabled: true}}\n");
  for (const ExperimentConfig& alone : {read, parse_ok(to_yaml(read))}) {
    const auto& fp16 = alone.engine->fp16;
    EXPECT_EQ(fp16.initial_scale_power, 32);
    EXPECT_EQ(fp16.hysteresis, 1);
    EXPECT_EQ(fp16.loss_scale_window, 1000);
    EXPECT_FALSE(fp16.consecutive_hysteresis);
    EXPECT_EQ(fp16.min_loss_scale, 1);
  }
  for (const char* key : {"initial_scale_power: 16", "loss_scale_window: 1000", "hysteresis: 2", "min_loss_scale: 1",
                          "consecutive_hysteresis: false"}) {
    const auto fp16 = parse_ok(gpu + "engine: {train_batch_size: 64, fp16: {enabled: true, " + key + "}}\n").engine->fp16;
    EXPECT_EQ(fp16.initial_scale_power, 16) << key;
    EXPECT_EQ(fp16.hysteresis, 2) << key;
  }
}

TEST(EngineConfig, PipelineSectionIsReadAndWrittenBack) {
  const ExperimentConfig c = parse_ok(std::string(kMinimal) +
                                      "resources: {slots_per_trial: 8}\n"
                                      "engine:\n"
                                      "  train_batch_size: 64\n"
                                      "  gradient_accumulation_steps: 4\n"
                                      "  pipeline: {stages: 4, partition_method: [0, 2, 5, 7, 9], "
                                      "activation_checkpoint_interval: 2}\n");
  for (const ExperimentConfig& config : {c, parse_ok(to_yaml(c))}) {
    ASSERT_TRUE(config.engine);
    const auto& pipeline = config.engine->pipeline;
    EXPECT_EQ(pipeline.stages, 4);
    EXPECT_EQ(pipeline.partition_method, "explicit");
    EXPECT_EQ(pipeline.bounds, (std::vector<std::int64_t>{0, 2, 5, 7, 9}));
    EXPECT_EQ(pipeline.activation_checkpoint_interval, 2);
  }
  const auto uniform = parse_ok(std::string(kMinimal) + "resources: {slots_per_trial: 2}\n"
                                "engine: {train_batch_size: 8, pipeline: {stages: 2, partition_method: uniform}}\n");
  EXPECT_EQ(uniform.engine->pipeline.partition_method, "uniform");
  EXPECT_EQ(parse_ok(to_yaml(uniform)).engine->pipeline.partition_method, "uniform");
  const auto typed = parse_ok(std::string(kMinimal) + "resources: {slots_per_trial: 2}\n"
                              "engine: {train_batch_size: 8, pipeline: {stages: 2, partition_method: \"type:block\"}}\n");
  EXPECT_EQ(typed.engine->pipeline.partition_method, "type:block");
  EXPECT_EQ(parse_ok(to_yaml(typed)).engine->pipeline.partition_method, "type:block");
  const auto defaults = parse_ok(std::string(kMinimal) + "engine: {train_micro_batch_size_per_gpu: 4}\n").engine->pipeline;
  EXPECT_EQ(defaults.stages, 1);
  EXPECT_EQ(defaults.partition_method, "parameters");
  EXPECT_EQ(defaults.activation_checkpoint_interval, 0);
  // The batch rule counts the data-parallel replicas: 8 ranks of 4 stages are 2 replicas.
  std::string error;
  EXPECT_EQ(engine_replicas(*c.engine, 8, error), 2);
  EXPECT_FALSE(engine_replicas(*c.engine, 6, error));
  EXPECT_THAT(error, HasSubstr("pipeline.stages (4) does not divide the 6 ranks"));
}

TEST(ConfigErrors, PipelineMistakesAreLocated) {
  const std::string base = std::string(kMinimal) + "resources: {slots_per_trial: 4}\n";
  EXPECT_THAT(one_error(base + "engine: {train_batch_size: 8, pipeline: {stages: 3}}\n"),
              HasSubstr("engine.pipeline: pipeline.stages (3) does not divide the 4 ranks into data-parallel replicas "
                        "of a whole pipeline; make the ranks a multiple of the stages (resources.slots_per_trial: 4)"));
  EXPECT_THAT(one_error(base + "engine: {train_batch_size: 7, pipeline: {stages: 2}}\n"),
              HasSubstr("train_batch_size (7) is not a multiple of the 2 ranks; make it a multiple, e.g. 6 (with "
                        "resources.slots_per_trial: 4, 2 data-parallel replica(s) of 2 pipeline stages)"));
  EXPECT_THAT(one_error(base + "engine: {train_batch_size: 8, pipeline: {stages: 2, partition_method: balanced}}\n"),
              HasSubstr("engine.pipeline.partition_method: must be parameters (balance the parameter counts), uniform "
                        "(balance the layer counts), type:REGEX (balance the layers whose name REGEX finds, e.g. "
                        "type:block) or a list of bounds, e.g. [0, 4, 8]; got \"balanced\""));
  EXPECT_THAT(one_error(base + "engine: {train_batch_size: 8, pipeline: {stages: 2, partition_method: \"type:(\"}}\n"),
              HasSubstr("type: needs a regular expression of the layers to balance, e.g. type:block; \"(\" is not one"));
  EXPECT_THAT(one_error(base + "engine: {train_batch_size: 8, pipeline: {stages: 2, partition_method: \"type:\"}}\n"),
              HasSubstr("type: needs a regular expression"));
  EXPECT_THAT(one_error(base + "engine: {train_batch_size: 8, pipeline: {stages: 2, partition_method: [0, 3, 3]}}\n"),
              HasSubstr("the bounds must increase"));
  EXPECT_THAT(one_error(base + "engine: {train_batch_size: 8, pipeline: {stages: 2, partition_method: [0, 3, 5, 7]}}\n"),
              HasSubstr("partition_method lists 4 bounds, which make 3 stage(s), but stages is 2"));
  EXPECT_THAT(one_error(base + "engine: {train_batch_size: 8, pipeline: {stages: 2, checkpoint: 1}}\n"),
              HasSubstr("engine.pipeline.checkpoint"));
  // DeepSpeed's PipelineEngine refuses ZeRO-2 and ZeRO-3 alike, and so does the config here.
  for (const char* stage : {"2", "3"}) {
    EXPECT_THAT(one_error(base + "engine: {train_batch_size: 8, pipeline: {stages: 2}, zero_optimization: {stage: " +
                          stage + "}}\n"),
                HasSubstr("engine.pipeline: a pipeline accumulates each micro-batch's gradients in its stage until the "
                          "schedule ends, which the partitioned gradients of ZeRO-2 and ZeRO-3 cannot (DeepSpeed "
                          "refuses them too: \"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism\"); set "
                          "zero_optimization.stage to 0 or 1"))
        << "stage " << stage;
  }
}

// offload_optimizer: a device it knows, nvme with a path, and a stage, device and engine it works with.
TEST(ConfigErrors, OffloadMistakesAreLocated) {
  const std::string base = std::string(kMinimal) + "engine: {train_micro_batch_size_per_gpu: 4, zero_optimization: ";
  EXPECT_EQ(one_error(base + "{stage: 3, offload_optimizer: {device: gpu}}}\n"),
            "exp.yaml:4:103: engine.zero_optimization.offload_optimizer.device: is 'gpu'; use none, cpu or nvme");
  EXPECT_THAT(one_error(base + "{stage: 3, offload_optimizer: {device: nvme}}}\n"),
              HasSubstr("engine.zero_optimization.offload_optimizer: device nvme needs nvme_path: a directory on each "
                        "node's local disk"));
  EXPECT_THAT(one_error(base + "{stage: 3, offload_optimizer: {device: nvme, nvme_path: /x, pin_memory: true}}}\n"),
              HasSubstr("engine.zero_optimization.offload_optimizer.pin_memory"));
  EXPECT_THAT(one_error(base + "{stage: 3, offload_optimizer: {device: nvme, nvme_path: /x, buffer_count: 0}}}\n"),
              HasSubstr("engine.zero_optimization.offload_optimizer.buffer_count: must be a positive integer"));
  EXPECT_THAT(one_error(base + "{stage: 0, offload_optimizer: {device: cpu}}}\n"),
              HasSubstr("engine.zero_optimization.offload_optimizer: offloads ZeRO's optimizer state, and "
                        "zero_optimization.stage is 0; set stage 1, 2 or 3"));
  EXPECT_THAT(one_error(base + "{stage: 2, offload_optimizer: {device: nvme, nvme_path: /x}}}\n"
                        "resources: {gpus_per_slot: 1}\n"),
              HasSubstr("is for a model on the CPU in this version"));
  EXPECT_THAT(one_error(std::string(kMinimal) + "resources: {slots_per_trial: 2}\nengine: {train_batch_size: 8, "
                        "pipeline: {stages: 2}, zero_optimization: {stage: 1, offload_optimizer: {device: cpu}}}\n"),
              HasSubstr("engine.zero_optimization.offload_optimizer: with engine.pipeline is not supported yet"));
  EXPECT_THAT(one_error(base + "{stage: 3, offload_optimizer: {device: nvme, nvme_path: /x}}}\n"
                        "checkpoint_levels: {memory: {period: {batches: 10}}}\n"),
              HasSubstr("on nvme with checkpoint_levels.memory is not supported yet"));
  EXPECT_THAT(one_error(base + "{stage: 3, sub_group_size: 0}}\n"),
              HasSubstr("engine.zero_optimization.sub_group_size: must be a positive integer"));
  EXPECT_THAT(one_error(base + "{stage: 3, stage3_param_persistence_threshold: -1}}\n"),
              HasSubstr("engine.zero_optimization.stage3_param_persistence_threshold: must be a non-negative integer"));
  EXPECT_THAT(one_error(base + "{stage: 3, stage3_model_persistence_threshold: 1.5}}\n"),
              HasSubstr("engine.zero_optimization.stage3_model_persistence_threshold: must be a non-negative integer"));
  EXPECT_THAT(one_error(base + "{stage: 3, stage3_prefetch_bucket_size: -5}}\n"),
              HasSubstr("engine.zero_optimization.stage3_prefetch_bucket_size: must be a non-negative integer"));
  EXPECT_THAT(one_error(base + "{stage: 3, stage3_max_live_parameters: many}}\n"),
              HasSubstr("engine.zero_optimization.stage3_max_live_parameters: must be a non-negative integer"));
  EXPECT_THAT(one_error(base + "{stage: 3, stage3_max_reuse_distance: -1}}\n"),
              HasSubstr("engine.zero_optimization.stage3_max_reuse_distance: must be a non-negative integer"));
  // offload_param: stage 3 only, no buffer_count, and on nvme in the optimizer state's swap file.
  EXPECT_THAT(one_error(base + "{stage: 2, offload_param: {device: cpu}}}\n"),
              HasSubstr("engine.zero_optimization.offload_param: offloads the parameters' parts, and only ZeRO stage 3 "
                        "partitions the parameters (zero_optimization.stage is 2); set stage 3"));
  EXPECT_THAT(one_error(base + "{stage: 3, offload_param: {device: cpu, buffer_count: 5}}}\n"),
              HasSubstr("engine.zero_optimization.offload_param.buffer_count: unknown key; the keys here are: device, "
                        "nvme_path"));
  EXPECT_THAT(one_error(base + "{stage: 3, offload_optimizer: {device: nvme, nvme_path: /x}, offload_param: {device: "
                        "nvme}}}\n"),
              HasSubstr("offload_param: device nvme needs nvme_path: a directory on each node's local disk, where "
                        "each rank keeps a swap file of its parts of the parameters"));
  EXPECT_THAT(one_error(base + "{stage: 3, offload_param: {device: nvme, nvme_path: /x}}}\n"),
              HasSubstr("offload_param: on nvme keeps each rank's parts of the parameters in its optimizer state's "
                        "swap file, and offload_optimizer.device is none; set offload_optimizer: {device: nvme, "
                        "nvme_path: /x} too"));
  EXPECT_THAT(one_error(base + "{stage: 3, offload_optimizer: {device: nvme, nvme_path: /x}, offload_param: {device: "
                        "nvme, nvme_path: /y}}}\n"),
              HasSubstr("offload_param: nvme_path /y is not offload_optimizer's (/x)"));
  EXPECT_THAT(one_error(base + "{stage: 3, offload_param: {device: cpu}}}\nresources: {gpus_per_slot: 1}\n"),
              HasSubstr("offload_param: is for a model on the CPU in this version"));
}

TEST(ConfigErrors, EngineMistakesAreLocated) {
  EXPECT_EQ(one_error(std::string(kMinimal) + "engine: {train_micro_batch_size_per_gpu: 4, zero_optimization: {stage: 5}}\n"),
            "exp.yaml:4:72: engine.zero_optimization.stage: must be at most 3, got \"5\"");
  EXPECT_EQ(one_error(std::string(kMinimal) +
                      "engine: {train_micro_batch_size_per_gpu: 4, zero_optimization: {stage: 2, reduce_bucket_size: 0}}\n"),
            "exp.yaml:4:95: engine.zero_optimization.reduce_bucket_size: must be a positive integer, got \"0\"");
  EXPECT_EQ(one_error(std::string(kMinimal) + "engine: {train_micro_batch_size_per_gpu: 4, fp16: {enabled: true}}\n"),
            "exp.yaml:4:61: engine.fp16.enabled: float16 training needs a GPU (LibTorch's CPU autocast computes in "
            "bfloat16 only) and resources.gpus_per_slot is 0; set resources.gpus_per_slot, or use `bf16: {enabled: "
            "true}` on the CPU");
  EXPECT_EQ(one_error(std::string(kMinimal) +
                      "resources: {gpus_per_slot: 1}\n"
                      "engine: {train_micro_batch_size_per_gpu: 4, bf16: {enabled: true}, fp16: {enabled: true}}\n"),
            "exp.yaml:5:84: engine.fp16.enabled: fp16 and bf16 are both enabled; choose one: bf16 (float32's range, "
            "no loss scaling; the CPU and GPUs) or fp16 (GPUs, with dynamic loss scaling)");
  EXPECT_EQ(one_error(std::string(kMinimal) + "engine: {train_micro_batch_size_per_gpu: 4, fp16: {hysteresis: 0}}\n"),
            "exp.yaml:4:64: engine.fp16.hysteresis: must be a positive integer, got \"0\"");
  EXPECT_THAT(one_error(std::string(kMinimal) +
                        "engine: {train_micro_batch_size_per_gpu: 4, fp16: {initial_scale_power: 2, min_loss_scale: 8}}\n"),
              HasSubstr("engine.fp16: min_loss_scale (8) is above the initial scale 2^initial_scale_power (4)"));
  EXPECT_THAT(one_error(std::string(kMinimal) + "engine: {train_micro_batch_size_per_gpu: 4, fp16: {scale: 8}}\n"),
              HasSubstr("engine.fp16.scale"));
  EXPECT_THAT(one_error(std::string(kMinimal) + "engine: {train_micro_batch_size_per_gpu: 4, bf16: {enabled: yes please}}\n"),
              HasSubstr("engine.bf16.enabled"));
  EXPECT_EQ(one_error(std::string(kMinimal) +
                      "hyperparameters: {global_batch_size: 30}\n"
                      "resources: {slots_per_trial: 2}\n"
                      "engine:\n"
                      "  train_micro_batch_size_per_gpu: 4\n"
                      "  gradient_accumulation_steps: 2\n"),
            "exp.yaml:7:3: engine: hyperparameters.global_batch_size (which sets train_batch_size) is 30 but "
            "train_micro_batch_size_per_gpu (4) x gradient_accumulation_steps (2) x ranks (2) is 16; change one of "
            "them, or leave one out to have it derived (with resources.slots_per_trial: 2)");
  EXPECT_EQ(one_error(std::string(kMinimal) +
                      "optimizations: {aggregation_frequency: 4}\n"
                      "engine: {train_micro_batch_size_per_gpu: 4}\n"),
            "exp.yaml:4:40: optimizations.aggregation_frequency: an engine trial accumulates gradients over "
            "engine.gradient_accumulation_steps micro-batches; remove aggregation_frequency and set "
            "engine.gradient_accumulation_steps: 4");
  EXPECT_THAT(one_error(std::string(kMinimal) + "engine: {train_micro_batch_size_per_gpu: 4, bf17: {enabled: true}}\n"),
              HasSubstr("engine.bf17: unknown key"));
  EXPECT_THAT(one_error(std::string(kMinimal) + "engine: {gradient_clipping: -1, train_batch_size: 4}\n"),
              HasSubstr("engine.gradient_clipping:"));
  EXPECT_THAT(one_error(std::string(kMinimal) + "engine: {}\n"), HasSubstr("engine: sets no batch size"));
}

// checkpoint_levels.memory: a period in batches or seconds, or auto (the default); the directory is absolute; the share
// of the node's memory is below 0.9.
TEST(ExperimentConfig, TheMemoryLevelsMistakesNameTheirKeys) {
  const std::string base = std::string(kMinimal) + "checkpoint_levels:\n  memory: ";
  EXPECT_EQ(one_error(base + "{period: often}\n"),
            "exp.yaml:5:20: checkpoint_levels.memory.period: must be auto, {batches: N} or {seconds: N}");
  EXPECT_THAT(one_error(base + "{period: {epochs: 1}}\n"),
              HasSubstr("checkpoint_levels.memory.period.epochs: unknown unit; use one of batches or seconds"));
  EXPECT_THAT(one_error(base + "{period: {batches: 0}}\n"),
              HasSubstr("checkpoint_levels.memory.period.batches: must be a positive integer"));
  EXPECT_THAT(one_error(base + "{period: {batches: 5}, dir: shm}\n"),
              HasSubstr("checkpoint_levels.memory.dir: must be an absolute directory on each node, e.g. /dev/shm"));
  EXPECT_THAT(one_error(base + "{period: {batches: 5}, max_share: 1.5}\n"),
              HasSubstr("checkpoint_levels.memory.max_share: "));
  EXPECT_THAT(one_error(base + "{period: {batches: 5}, partner: true}\n"),
              HasSubstr("checkpoint_levels.memory.partner: unknown key"));
  const ExperimentConfig ok = parse_ok(base + "{period: {batches: 5}}\n");
  EXPECT_EQ(ok.checkpoint_levels.memory_period.value, 5);
  EXPECT_EQ(ok.checkpoint_levels.memory_dir, "/dev/shm");
  EXPECT_EQ(ok.checkpoint_levels.memory_max_share, 0.25);
  EXPECT_EQ(to_yaml(parse_ok(to_yaml(ok))), to_yaml(ok)) << "config show reads back as itself";
  EXPECT_THAT(to_yaml(ok), HasSubstr("checkpoint_levels:\n  memory:\n    period: {batches: 5}\n"));
  const ExperimentConfig timed = parse_ok(base + "{period: {seconds: 30}}\n");
  EXPECT_EQ(timed.checkpoint_levels.memory_period.unit, LengthUnit::kSeconds);
  EXPECT_EQ(timed.checkpoint_levels.memory_period.value, 30);
  EXPECT_THAT(to_yaml(timed), HasSubstr("    period: {seconds: 30}\n"));
  EXPECT_EQ(to_yaml(parse_ok(to_yaml(timed))), to_yaml(timed));
  // Without a period, or with `auto`: as often as the copies' cost allows.
  for (const char* text : {"{dir: /dev/shm}\n", "{period: auto}\n", "{}\n"}) {
    const ExperimentConfig automatic = parse_ok(base + text);
    EXPECT_TRUE(automatic.checkpoint_levels.memory()) << text;
    EXPECT_TRUE(automatic.checkpoint_levels.memory_auto) << text;
    EXPECT_THAT(to_yaml(automatic), HasSubstr("    period: auto\n")) << text;
    EXPECT_EQ(to_yaml(parse_ok(to_yaml(automatic))), to_yaml(automatic)) << text;
  }
  EXPECT_FALSE(parse_ok(kMinimal).checkpoint_levels.memory());
}

// checkpoint_levels.partner: a boolean, off by default, and only with the memory level it copies.
TEST(ExperimentConfig, ThePartnerLevelNeedsTheMemoryLevel) {
  const std::string base = std::string(kMinimal) + "checkpoint_levels:\n";
  EXPECT_EQ(one_error(base + "  partner: true\n"),
            "exp.yaml:5:12: checkpoint_levels.partner: sends each rank's copies in node memory to another node: it "
            "needs checkpoint_levels.memory too");
  EXPECT_THAT(one_error(base + "  memory: {}\n  partner: often\n"), HasSubstr("checkpoint_levels.partner: "));
  const ExperimentConfig on = parse_ok(base + "  memory: {period: {batches: 5}}\n  partner: true\n");
  EXPECT_TRUE(on.checkpoint_levels.partner);
  EXPECT_THAT(to_yaml(on), HasSubstr("    max_share: 0.25\n  partner: true\n"));
  EXPECT_EQ(to_yaml(parse_ok(to_yaml(on))), to_yaml(on)) << "config show reads back as itself";
  EXPECT_FALSE(parse_ok(base + "  memory: {}\n").checkpoint_levels.partner);
  EXPECT_FALSE(parse_ok(base + "  partner: false\n").checkpoint_levels.memory());
}

}  // namespace
}  // namespace hpctrial::core
