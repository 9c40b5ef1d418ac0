// The checks across the experiment schema's sections: the hyperparameters against the
// resources, the engine section against the rest.
#include "config_schema.h"

#include "hpctrial/core/error.h"

namespace hpctrial::core::detail {

// Cross-section checks that need several sections at once.
void check_hyperparameters(const ExperimentConfig& config, const ConfigNode& root, Diagnostics& d) {
  const ConfigNode* hps = root.find("hyperparameters");
  if (hps == nullptr) return;
  for (const auto& [name, hp] : config.hyperparameters) {
    const ConfigNode* node = hps->find(name);
    const std::string path = "hyperparameters." + name;
    if (config.searcher.name == Searcher::Name::kGrid && hp.count == 0 &&
        (hp.type == Hyperparameter::Type::kInt || hp.type == Hyperparameter::Type::kDouble ||
         hp.type == Hyperparameter::Type::kLog)) {
      report(*node, path, d,
             "the grid searcher needs `count` on every int, double and log range (how many grid "
             "points); add e.g. count: 4");
    }
    if (name == "global_batch_size" && hp.type == Hyperparameter::Type::kConst) {
      const std::string& text = hp.value.text();
      const auto value = hp.value.is_scalar() && !hp.value.quoted() ? detail::parse_int(text)
                                                                     : std::nullopt;
      // Not a multiple of the slots: each slot trains global // slots records a batch, and the
      // trial says so once when it starts (as Determined does).
      if (!value || *value < config.resources.slots_per_trial) {
        report(hp.value, path, d,
               "must be an integer of at least resources.slots_per_trial (" +
                   std::to_string(config.resources.slots_per_trial) + "), got " + describe(hp.value));
      }
    }
  }
}

namespace {

// The node of zero_optimization's `key`, or the engine section's where it is not written.
const ConfigNode& zero_node(const ConfigNode& engine, const char* key) {
  const ConfigNode* zero = engine.find("zero_optimization");
  const ConfigNode* node = zero != nullptr ? zero->find(key) : nullptr;
  return node != nullptr ? *node : engine;
}

// offload_optimizer: at a ZeRO stage, on the CPU, without a pipeline.
void check_offload(const ExperimentConfig& config, const ConfigNode& engine, Diagnostics& d) {
  if (config.engine->offload_optimizer.device != "none") {
    const ConfigNode& at = zero_node(engine, "offload_optimizer");
    const std::string key = "engine.zero_optimization.offload_optimizer";
    if (config.engine->zero_stage == 0) {
      report(at, key, d,
             "offloads ZeRO's optimizer state, and zero_optimization.stage is 0; set stage 1, 2 or 3 (or remove "
             "offload_optimizer)");
    } else if (config.resources.gpus_per_slot > 0) {
      report(at, key, d,
             "is for a model on the CPU in this version (its optimizer state in host memory, or swapped to nvme_path); "
             "a model on a GPU keeps its state on the GPU: set resources.gpus_per_slot: 0, or remove offload_optimizer");
    } else if (config.engine->pipeline.stages > 1) {
      report(at, key, d, "with engine.pipeline is not supported yet; train without the pipeline, or remove offload_optimizer");
    } else if (config.engine->offload_optimizer.device == "nvme" && config.checkpoint_levels.memory()) {
      report(at, key, d,
             "on nvme with checkpoint_levels.memory is not supported yet (the copies in node memory would hold the "
             "state the offload keeps out of it); remove checkpoint_levels.memory, or offload_optimizer");
    }
  }
}

// offload_param: at stage 3 (DeepSpeed's rule: only stage 3 partitions the parameters), on the
// CPU; on nvme, in the optimizer state's swap file.
void check_offload_param(const ExperimentConfig& config, const ConfigNode& engine, Diagnostics& d) {
  const auto& param = config.engine->offload_param;
  const auto& optimizer = config.engine->offload_optimizer;
  if (param.device == "none") return;
  const ConfigNode& at = zero_node(engine, "offload_param");
  const std::string key = "engine.zero_optimization.offload_param";
  if (config.engine->zero_stage != 3) {
    report(at, key, d,
           "offloads the parameters' parts, and only ZeRO stage 3 partitions the parameters (zero_optimization.stage "
           "is " + std::to_string(config.engine->zero_stage) + "); set stage 3, or remove offload_param");
  } else if (config.resources.gpus_per_slot > 0) {
    report(at, key, d,
           "is for a model on the CPU in this version; set resources.gpus_per_slot: 0, or remove offload_param");
  } else if (param.device == "nvme" && optimizer.device != "nvme") {
    report(at, key, d,
           "on nvme keeps each rank's parts of the parameters in its optimizer state's swap file, and "
           "offload_optimizer.device is " + optimizer.device + "; set offload_optimizer: {device: nvme, nvme_path: " +
               (param.nvme_path.empty() ? std::string("...") : param.nvme_path) + "} too, or offload_param.device: none");
  } else if (param.device == "nvme" && !param.nvme_path.empty() && param.nvme_path != optimizer.nvme_path) {
    report(at, key, d,
           "nvme_path " + param.nvme_path + " is not offload_optimizer's (" + optimizer.nvme_path +
               "): a rank keeps its parts of the parameters in its optimizer state's swap file; give both the same "
               "directory");
  }
}

}  // namespace

void check_engine(const ExperimentConfig& config, const ConfigNode& root, Diagnostics& d) {
  if (!config.engine) return;
  const ConfigNode* engine = root.find("engine");
  if (engine == nullptr) return;
  if (config.optimizations.aggregation_frequency != 1) {
    const ConfigNode* opt = root.find("optimizations");
    const ConfigNode* n = opt != nullptr ? opt->find("aggregation_frequency") : nullptr;
    report(n != nullptr ? *n : *engine, "optimizations.aggregation_frequency", d,
           "an engine trial accumulates gradients over engine.gradient_accumulation_steps micro-batches; remove "
           "aggregation_frequency and set engine.gradient_accumulation_steps: " +
               std::to_string(config.optimizations.aggregation_frequency));
  }
  if (config.engine->fp16.enabled) {
    const ConfigNode* fp16 = engine->find("fp16");
    const ConfigNode* enabled = fp16 != nullptr ? fp16->find("enabled") : nullptr;
    const ConfigNode& at = enabled != nullptr ? *enabled : *engine;
    if (config.engine->bf16) {
      report(at, "engine.fp16.enabled", d,
             "fp16 and bf16 are both enabled; choose one: bf16 (float32's range, no loss scaling; the CPU and "
             "GPUs) or fp16 (GPUs, with dynamic loss scaling)");
    } else if (config.resources.gpus_per_slot == 0) {
      report(at, "engine.fp16.enabled", d,
             "float16 training needs a GPU (LibTorch's CPU autocast computes in bfloat16 only) and "
             "resources.gpus_per_slot is 0; set resources.gpus_per_slot, or use `bf16: {enabled: true}` on the CPU");
    }
  }
  check_offload(config, *engine, d);
  check_offload_param(config, *engine, d);
  if (config.engine->pipeline.stages > 1) {
    const ConfigNode* pipeline = engine->find("pipeline");
    const ConfigNode& at = pipeline != nullptr ? *pipeline : *engine;
    if (config.engine->zero_stage >= 2) {
      report(at, "engine.pipeline", d,
             "a pipeline accumulates each micro-batch's gradients in its stage until the schedule ends, which "
             "the partitioned gradients of ZeRO-2 and ZeRO-3 cannot (DeepSpeed refuses them too: \"ZeRO-2 and "
             "ZeRO-3 are incompatible with pipeline parallelism\"); set zero_optimization.stage to 0 or 1");
    }
    if (config.engine->fp16.enabled) {
      report(at, "engine.pipeline", d,
             "hpctrial's pipeline does not scale losses yet, so fp16 cannot train in it; use `bf16: {enabled: true}` "
             "(no loss scaling needed), or train without the pipeline");
    }
  }
  // A searched global_batch_size is checked by each trial when it starts.
  std::optional<std::int64_t> global_batch_size;
  for (const auto& [name, hp] : config.hyperparameters) {
    if (name != "global_batch_size") continue;
    if (hp.type != Hyperparameter::Type::kConst) return;
    global_batch_size = hp.value.is_scalar() && !hp.value.quoted() ? parse_int(hp.value.text()) : std::nullopt;
    if (!global_batch_size) return;  // reported by check_hyperparameters
  }
  std::string error;
  const int slots = config.resources.slots_per_trial;
  const auto replicas = engine_replicas(*config.engine, slots, error);
  if (!replicas) {
    const ConfigNode* pipeline = engine->find("pipeline");
    report(pipeline != nullptr ? *pipeline : *engine, "engine.pipeline", d,
           error + " (resources.slots_per_trial: " + std::to_string(slots) + ")");
    return;
  }
  if (!resolve_engine_batch_sizes(*config.engine, global_batch_size, *replicas, error)) {
    const std::string pipeline = config.engine->pipeline.stages > 1
                                     ? ", " + std::to_string(*replicas) + " data-parallel replica(s) of " +
                                           std::to_string(config.engine->pipeline.stages) + " pipeline stages"
                                     : std::string();
    report(*engine, "engine", d, error + " (with resources.slots_per_trial: " + std::to_string(slots) + pipeline + ")");
  }
}

}  // namespace hpctrial::core::detail
