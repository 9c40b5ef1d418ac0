// The effective config: every key written out, defaults included, in the reference's order.
#include <yaml-cpp/yaml.h>

#include <fmt/core.h>

#include "config_emit.h"
#include "hpctrial/core/experiment_config.h"

namespace hpctrial::core {
namespace {

void emit_node(YAML::Emitter& out, const ConfigNode& node) { detail::emit_yaml(out, node); }

void emit_length(YAML::Emitter& out, const Length& length) {
  out << YAML::Flow << YAML::BeginMap << YAML::Key << std::string(to_string(length.unit))
      << YAML::Value << length.value << YAML::EndMap;
}

std::string number(double value) { return fmt::format("{}", value); }

void emit_hyperparameter(YAML::Emitter& out, const Hyperparameter& hp) {
  switch (hp.type) {
    case Hyperparameter::Type::kConst:
      emit_node(out, hp.value);
      return;
    case Hyperparameter::Type::kNested:
      out << YAML::BeginMap;
      for (const auto& [name, child] : hp.nested) {
        out << YAML::Key << name << YAML::Value;
        emit_hyperparameter(out, child);
      }
      out << YAML::EndMap;
      return;
    case Hyperparameter::Type::kCategorical:
      out << YAML::BeginMap << YAML::Key << "type" << YAML::Value << "categorical" << YAML::Key
          << "vals" << YAML::Value << YAML::BeginSeq;
      for (const auto& v : hp.vals) emit_node(out, v);
      out << YAML::EndSeq << YAML::EndMap;
      return;
    case Hyperparameter::Type::kInt:
    case Hyperparameter::Type::kDouble:
    case Hyperparameter::Type::kLog:
      out << YAML::BeginMap << YAML::Key << "type" << YAML::Value << std::string(to_string(hp.type));
      if (hp.type == Hyperparameter::Type::kInt) {
        out << YAML::Key << "minval" << YAML::Value << static_cast<long long>(hp.minval)
            << YAML::Key << "maxval" << YAML::Value << static_cast<long long>(hp.maxval);
      } else {
        out << YAML::Key << "minval" << YAML::Value << number(hp.minval) << YAML::Key << "maxval"
            << YAML::Value << number(hp.maxval);
      }
      if (hp.type == Hyperparameter::Type::kLog) {
        out << YAML::Key << "base" << YAML::Value << number(hp.base);
      }
      if (hp.count > 0) out << YAML::Key << "count" << YAML::Value << hp.count;
      out << YAML::EndMap;
      return;
  }
}

void emit_environment(YAML::Emitter& out, const std::vector<EnvVar>& environment, const Container& container = {}) {
  if (environment.empty() && container.image.empty()) out << YAML::Flow;
  out << YAML::BeginMap;
  for (const auto& var : environment) {
    out << YAML::Key << var.name << YAML::Value << YAML::DoubleQuoted << var.value;
  }
  if (!container.image.empty()) {
    out << YAML::Key << "image" << YAML::Value << YAML::DoubleQuoted << container.image;
    out << YAML::Key << "container_runtime" << YAML::Value << runtime_name(container.runtime);
    out << YAML::Key << "bind" << YAML::Value << YAML::Flow << YAML::BeginSeq;
    for (const auto& b : container.binds) out << YAML::DoubleQuoted << b;
    out << YAML::EndSeq;
  }
  out << YAML::EndMap;
}

void emit_strings(YAML::Emitter& out, const std::vector<std::string>& values) {
  out << YAML::BeginSeq;
  for (const auto& v : values) out << v;
  out << YAML::EndSeq;
}

void emit_entrypoint(YAML::Emitter& out, const Entrypoint& entrypoint) {
  out << YAML::Key << "entrypoint" << YAML::Value;
  if (entrypoint.kind == Entrypoint::Kind::kLibrary) {
    out << entrypoint.library + ":" + entrypoint.trial_class;
  } else {
    out << YAML::Flow;
    emit_strings(out, entrypoint.argv);
  }
}

void emit_hyperparameters(YAML::Emitter& out, const ExperimentConfig& c) {
  out << YAML::Key << "hyperparameters" << YAML::Value;
  if (c.hyperparameters.empty()) out << YAML::Flow;
  out << YAML::BeginMap;
  for (const auto& [name, hp] : c.hyperparameters) {
    out << YAML::Key << name << YAML::Value;
    emit_hyperparameter(out, hp);
  }
  out << YAML::EndMap;
}

void emit_inference(YAML::Emitter& out, const Inference& inference) {
  out << YAML::Key << "inference" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "checkpoint" << YAML::Value << YAML::DoubleQuoted << inference.checkpoint;
  if (inference.trial_id) out << YAML::Key << "trial_id" << YAML::Value << *inference.trial_id;
  if (inference.batch_size) out << YAML::Key << "batch_size" << YAML::Value << *inference.batch_size;
  out << YAML::Key << "progress_period" << YAML::Value;
  emit_length(out, inference.progress_period);
  out << YAML::EndMap;
}

void emit_searcher(YAML::Emitter& out, const Searcher& searcher) {
  out << YAML::Key << "searcher" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "name" << YAML::Value << std::string(to_string(searcher.name));
  out << YAML::Key << "metric" << YAML::Value << YAML::DoubleQuoted << searcher.metric;
  out << YAML::Key << "smaller_is_better" << YAML::Value << searcher.smaller_is_better;
  out << YAML::Key << "max_length" << YAML::Value;
  emit_length(out, searcher.max_length);
  if (searcher.name != Searcher::Name::kGrid) {
    out << YAML::Key << "max_trials" << YAML::Value << searcher.max_trials;
  }
  out << YAML::Key << "max_concurrent_trials" << YAML::Value << searcher.max_concurrent_trials;
  if (searcher.adaptive()) {
    out << YAML::Key << "divisor" << YAML::Value << number(searcher.divisor);
    out << YAML::Key << "stop_once" << YAML::Value << searcher.stop_once;
  }
  if (searcher.name == Searcher::Name::kAdaptiveAsha) {
    out << YAML::Key << "mode" << YAML::Value << std::string(to_string(searcher.mode));
    out << YAML::Key << "max_rungs" << YAML::Value << searcher.max_rungs;
    if (!searcher.bracket_rungs.empty()) {
      out << YAML::Key << "bracket_rungs" << YAML::Value << YAML::Flow << searcher.bracket_rungs;
    }
  }
  if (searcher.name == Searcher::Name::kAsyncHalving) out << YAML::Key << "num_rungs" << YAML::Value << searcher.num_rungs;
  if (!searcher.source_checkpoint.empty()) {
    out << YAML::Key << "source_checkpoint" << YAML::Value << YAML::DoubleQuoted << searcher.source_checkpoint;
  }
  if (searcher.source_trial_id) out << YAML::Key << "source_trial_id" << YAML::Value << *searcher.source_trial_id;
  out << YAML::EndMap;
}

// records_per_epoch, min_validation_period and min_checkpoint_period.
void emit_periods(YAML::Emitter& out, const ExperimentConfig& c) {
  if (c.records_per_epoch > 0) {
    out << YAML::Key << "records_per_epoch" << YAML::Value << c.records_per_epoch;
  }
  if (c.min_validation_period) {
    out << YAML::Key << "min_validation_period" << YAML::Value;
    emit_length(out, *c.min_validation_period);
  }
  if (c.min_checkpoint_period) {
    out << YAML::Key << "min_checkpoint_period" << YAML::Value;
    emit_length(out, *c.min_checkpoint_period);
  } else {
    out << YAML::Key << "min_checkpoint_period" << YAML::Value << (c.auto_checkpoint_period ? "auto" : "none");
  }
}

void emit_resources(YAML::Emitter& out, const Resources& r) {
  out << YAML::Key << "resources" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "slots_per_trial" << YAML::Value << r.slots_per_trial;
  if (r.elastic()) out << YAML::Key << "min_slots_per_trial" << YAML::Value << r.min_slots_per_trial;
  out << YAML::Key << "slots_per_node" << YAML::Value << r.slots_per_node;
  out << YAML::Key << "cpus_per_slot" << YAML::Value << r.cpus_per_slot;
  out << YAML::Key << "gpus_per_slot" << YAML::Value << r.gpus_per_slot;
  out << YAML::Key << "max_excluded_nodes" << YAML::Value << r.max_excluded_nodes;
  out << YAML::Key << "spare_nodes" << YAML::Value << r.spare_nodes;
  if (r.memory_per_node_bytes) {
    out << YAML::Key << "memory_per_node" << YAML::Value << format_memory(*r.memory_per_node_bytes);
  }
  out << YAML::EndMap;
}

void emit_adaptive_batch(YAML::Emitter& out, const AdaptiveBatch& a) {
  out << YAML::Key << "adaptive_batch_size" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "enabled" << YAML::Value << true;
  out << YAML::Key << "max_batch_size" << YAML::Value << a.max_batch_size;
  if (a.max_local_batch > 0) {
    out << YAML::Key << "local_batch_size_bounds" << YAML::Value << YAML::Flow << YAML::BeginSeq
        << a.min_local_batch << a.max_local_batch << YAML::EndSeq;
  }
  out << YAML::Key << "gradient_accumulation" << YAML::Value << a.gradient_accumulation;
  out << YAML::Key << "scaling_rule" << YAML::Value << std::string(to_string(a.scaling_rule));
  out << YAML::Key << "legw_warmup_epochs" << YAML::Value << number(a.legw_warmup_epochs);
  out << YAML::Key << "decision_interval" << YAML::Value << a.decision_interval;
  out << YAML::Key << "smoothing" << YAML::Value << number(a.smoothing);
  out << YAML::EndMap;
}

void emit_optimizations(YAML::Emitter& out, const Optimizations& o) {
  out << YAML::Key << "optimizations" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "aggregation_frequency" << YAML::Value << o.aggregation_frequency;
  out << YAML::Key << "average_training_metrics" << YAML::Value << o.average_training_metrics;
  out << YAML::Key << "bucket_cap_mb" << YAML::Value << number(o.bucket_cap_mb);
  out << YAML::Key << "gradient_compression" << YAML::Value << std::string(to_string(o.gradient_compression));
  out << YAML::Key << "collective_timeout" << YAML::Value << YAML::DoubleQuoted
      << format_duration(o.collective_timeout_seconds);
  out << YAML::Key << "replica_check_period" << YAML::Value << o.replica_check_period;
  if (!o.network_interface.empty()) out << YAML::Key << "network_interface" << YAML::Value << o.network_interface;
  out << YAML::Key << "huge_pages" << YAML::Value << o.huge_pages;
  if (o.adaptive_batch_size.enabled) emit_adaptive_batch(out, o.adaptive_batch_size);
  out << YAML::EndMap;
}

void emit_engine(YAML::Emitter& out, const EngineConfig& e) {
  out << YAML::Key << "engine" << YAML::Value << YAML::BeginMap;
  if (e.train_batch_size) out << YAML::Key << "train_batch_size" << YAML::Value << *e.train_batch_size;
  if (e.train_micro_batch_size_per_gpu) {
    out << YAML::Key << "train_micro_batch_size_per_gpu" << YAML::Value << *e.train_micro_batch_size_per_gpu;
  }
  if (e.gradient_accumulation_steps) {
    out << YAML::Key << "gradient_accumulation_steps" << YAML::Value << *e.gradient_accumulation_steps;
  }
  out << YAML::Key << "gradient_clipping" << YAML::Value << number(e.gradient_clipping);
  out << YAML::Key << "zero_optimization" << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key << "stage"
      << YAML::Value << e.zero_stage << YAML::Key << "reduce_bucket_size" << YAML::Value << e.reduce_bucket_size
      << YAML::Key << "sub_group_size" << YAML::Value << e.sub_group_size << YAML::Key
      << "stage3_param_persistence_threshold" << YAML::Value << e.param_persistence_threshold << YAML::Key
      << "stage3_model_persistence_threshold" << YAML::Value << e.model_persistence_threshold << YAML::Key
      << "stage3_prefetch_bucket_size" << YAML::Value << e.prefetch_bucket_size << YAML::Key
      << "stage3_max_live_parameters" << YAML::Value << e.max_live_parameters << YAML::Key
      << "stage3_max_reuse_distance" << YAML::Value << e.max_reuse_distance << YAML::Key << "offload_optimizer"
      << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key << "device" << YAML::Value
      << e.offload_optimizer.device;
  if (!e.offload_optimizer.nvme_path.empty()) {
    out << YAML::Key << "nvme_path" << YAML::Value << e.offload_optimizer.nvme_path;
  }
  out << YAML::Key << "buffer_count" << YAML::Value << e.offload_optimizer.buffer_count << YAML::EndMap;
  out << YAML::Key << "offload_param" << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key << "device"
      << YAML::Value << e.offload_param.device;
  if (!e.offload_param.nvme_path.empty()) out << YAML::Key << "nvme_path" << YAML::Value << e.offload_param.nvme_path;
  out << YAML::EndMap << YAML::EndMap;
  out << YAML::Key << "bf16" << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key << "enabled"
      << YAML::Value << e.bf16 << YAML::EndMap;
  out << YAML::Key << "fp16" << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key << "enabled"
      << YAML::Value << e.fp16.enabled << YAML::Key << "loss_scale" << YAML::Value << number(e.fp16.loss_scale)
      << YAML::Key << "initial_scale_power" << YAML::Value << e.fp16.initial_scale_power << YAML::Key
      << "loss_scale_window" << YAML::Value << e.fp16.loss_scale_window << YAML::Key << "hysteresis"
      << YAML::Value << e.fp16.hysteresis << YAML::Key << "consecutive_hysteresis" << YAML::Value
      << e.fp16.consecutive_hysteresis << YAML::Key << "min_loss_scale" << YAML::Value
      << number(e.fp16.min_loss_scale) << YAML::EndMap;
  out << YAML::Key << "pipeline" << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key << "stages"
      << YAML::Value << e.pipeline.stages << YAML::Key << "partition_method" << YAML::Value;
  if (e.pipeline.partition_method == "explicit") {
    out << YAML::Flow << YAML::BeginSeq;
    for (const auto bound : e.pipeline.bounds) out << bound;
    out << YAML::EndSeq;
  } else {
    out << e.pipeline.partition_method;
  }
  out << YAML::Key << "activation_checkpoint_interval" << YAML::Value << e.pipeline.activation_checkpoint_interval
      << YAML::EndMap;
  out << YAML::EndMap;
}

void emit_reproducibility(YAML::Emitter& out, const ExperimentConfig& c) {
  out << YAML::Key << "reproducibility" << YAML::Value;
  if (!c.reproducibility.experiment_seed) out << YAML::Flow;
  out << YAML::BeginMap;
  if (c.reproducibility.experiment_seed) {
    out << YAML::Key << "experiment_seed" << YAML::Value << *c.reproducibility.experiment_seed;
  }
  out << YAML::EndMap;
}

void emit_checkpoint_storage(YAML::Emitter& out, const CheckpointStorage& s) {
  out << YAML::Key << "checkpoint_storage" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "type" << YAML::Value << s.type;
  if (!s.host_path.empty()) {
    out << YAML::Key << "host_path" << YAML::Value << YAML::DoubleQuoted << s.host_path;
  }
  out << YAML::Key << "save_trial_latest" << YAML::Value << s.save_trial_latest;
  out << YAML::Key << "save_trial_best" << YAML::Value << s.save_trial_best;
  out << YAML::Key << "async" << YAML::Value << s.async;
  out << YAML::Key << "group_readable" << YAML::Value << s.group_readable;
  out << YAML::Key << "auto_overhead" << YAML::Value << s.auto_overhead;
  out << YAML::Key << "auto_max_interval" << YAML::Value << format_duration(s.auto_max_interval_seconds);
  out << YAML::EndMap;
}

void emit_checkpoint_levels(YAML::Emitter& out, const CheckpointLevels& l) {
  if (!l.memory()) return;  // no level but the shared filesystem's
  out << YAML::Key << "checkpoint_levels" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "memory" << YAML::Value << YAML::BeginMap;
  if (l.memory_auto) {
    out << YAML::Key << "period" << YAML::Value << "auto";
  } else {
    out << YAML::Key << "period" << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key
        << std::string(to_string(l.memory_period.unit)) << YAML::Value << l.memory_period.value << YAML::EndMap;
  }
  out << YAML::Key << "dir" << YAML::Value << YAML::DoubleQuoted << l.memory_dir;
  out << YAML::Key << "max_share" << YAML::Value << l.memory_max_share;
  out << YAML::EndMap;
  out << YAML::Key << "partner" << YAML::Value << l.partner;
  out << YAML::EndMap;
}

void emit_profiling(YAML::Emitter& out, const ExperimentConfig& c) {
  out << YAML::Key << "profiling" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "enabled" << YAML::Value << c.profiling.enabled;
  out << YAML::Key << "begin_on_batch" << YAML::Value << c.profiling.begin_on_batch;
  out << YAML::Key << "end_after_batch" << YAML::Value << c.profiling.last_batch();
  out << YAML::Key << "system_metrics_period" << YAML::Value << YAML::DoubleQuoted
      << (c.profiling.system_metrics_period_seconds == 0 ? std::string("0s")
                                                          : format_duration(c.profiling.system_metrics_period_seconds));
  out << YAML::EndMap;
}

void emit_launcher(YAML::Emitter& out, const ExperimentConfig& c) {
  out << YAML::Key << "launcher" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "mpi" << YAML::Value << mpi_name(c.launcher.mpi);
  out << YAML::Key << "prefix" << YAML::Value << YAML::Flow;
  emit_strings(out, c.launcher.prefix);
  out << YAML::Key << "mpirun_args" << YAML::Value << YAML::Flow;
  emit_strings(out, c.launcher.mpirun_args);
  out << YAML::Key << "srun_args" << YAML::Value << YAML::Flow;
  emit_strings(out, c.launcher.srun_args);
  out << YAML::Key << "hang_timeout" << YAML::Value << YAML::DoubleQuoted
      << format_duration(c.launcher.hang_timeout_seconds);
  if (!c.launcher.startup_hook.empty()) {
    out << YAML::Key << "startup_hook" << YAML::Value << YAML::Flow;
    emit_strings(out, c.launcher.startup_hook);
  }
  out << YAML::EndMap;
}

void emit_scheduler(YAML::Emitter& out, const SchedulerConfig& sc) {
  out << YAML::Key << "scheduler" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "type" << YAML::Value << sc.type;
  // The scheduler's own options as written (a name each: check_scheduler_config), then the account.
  for (const ConfigEntry& option : sc.options) {
    const std::string value = sc.option(option.key);
    if (!option.value.is_scalar()) {
      out << YAML::Key << option.key << YAML::Value;
      emit_node(out, option.value);
    } else if (!value.empty()) {
      out << YAML::Key << option.key << YAML::Value << value;
    }
  }
  if (!sc.account.empty()) out << YAML::Key << "account" << YAML::Value << sc.account;
  if (sc.time_limit_seconds) {
    out << YAML::Key << "time_limit" << YAML::Value << YAML::DoubleQuoted
        << format_duration(*sc.time_limit_seconds);
  }
  out << YAML::Key << "preemption_grace" << YAML::Value << YAML::DoubleQuoted
      << format_duration(sc.preemption_grace_seconds);
  out << YAML::Key << "modules" << YAML::Value << YAML::Flow;
  emit_strings(out, sc.modules);
  out << YAML::Key << "environment" << YAML::Value;
  emit_environment(out, sc.environment);
  out << YAML::Key << "extra_directives" << YAML::Value << YAML::Flow;
  emit_strings(out, sc.extra_directives);
  out << YAML::EndMap;
}

}  // namespace

std::string to_yaml(const ExperimentConfig& c) {
  YAML::Emitter out;
  out.SetIndent(2);
  out << YAML::BeginMap;
  out << YAML::Key << "name" << YAML::Value << YAML::DoubleQuoted << c.name;
  out << YAML::Key << "description" << YAML::Value << YAML::DoubleQuoted << c.description;
  emit_entrypoint(out, c.entrypoint);
  emit_hyperparameters(out, c);
  if (c.inference) {
    emit_inference(out, *c.inference);
  } else {
    emit_searcher(out, c.searcher);
  }
  emit_periods(out, c);
  emit_resources(out, c.resources);
  emit_optimizations(out, c.optimizations);
  if (c.engine) emit_engine(out, *c.engine);
  emit_reproducibility(out, c);
  emit_checkpoint_storage(out, c.checkpoint_storage);
  emit_checkpoint_levels(out, c.checkpoint_levels);
  out << YAML::Key << "max_restarts" << YAML::Value << c.max_restarts;
  out << YAML::Key << "scheduling_unit" << YAML::Value << c.scheduling_unit;
  emit_profiling(out, c);
  emit_launcher(out, c);
  emit_scheduler(out, c.scheduler);
  if (!c.context.empty()) out << YAML::Key << "context" << YAML::Value << YAML::DoubleQuoted << c.context;
  out << YAML::Key << "data" << YAML::Value;
  emit_node(out, c.data);
  out << YAML::Key << "environment" << YAML::Value;
  emit_environment(out, c.environment, c.container);
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace hpctrial::core
