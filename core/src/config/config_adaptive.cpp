// The reader of optimizations.adaptive_batch_size (AdaptDL's adaptive batch size).
#include "config_schema.h"

namespace hpctrial::core {

std::string_view to_string(ScalingRule rule) { return detail::choice_name(detail::kScalingRules, rule); }

namespace detail {

void read_adaptive_batch(const ConfigNode& node, const std::string& path, Diagnostics& d, AdaptiveBatch& a) {
  if (!expect_map(node, path, d, "adaptive_batch_size: {enabled: true, max_batch_size: 1024}")) return;
  MapReader r(&node, path, d);
  if (const ConfigNode* n = r.get("enabled")) {
    if (auto v = read_bool(*n, r.path("enabled"), d)) a.enabled = *v;
  }
  if (const ConfigNode* n = r.get("max_batch_size")) {
    if (auto v = read_int(*n, r.path("max_batch_size"), d, 1, kMaxLength)) a.max_batch_size = *v;
  }
  if (const ConfigNode* n = r.get("local_batch_size_bounds")) {
    const std::string where = r.path("local_batch_size_bounds");
    if (!n->is_sequence() || n->items().size() != 2) {
      report(*n, where, d, "must be a list of two sizes, [min, max], e.g. local_batch_size_bounds: [8, 128]");
    } else {
      const auto low = read_int(n->items()[0], where + "[0]", d, 1, kMaxLength);
      const auto high = read_int(n->items()[1], where + "[1]", d, 1, kMaxLength);
      if (low && high && *low > *high) {
        report(*n, where, d, "[" + std::to_string(*low) + ", " + std::to_string(*high) +
                                 "]: the lower bound is above the upper one; write [min, max]");
      } else if (low && high) {
        a.min_local_batch = *low;
        a.max_local_batch = *high;
      }
    }
  }
  if (const ConfigNode* n = r.get("gradient_accumulation")) {
    if (auto v = read_bool(*n, r.path("gradient_accumulation"), d)) a.gradient_accumulation = *v;
  }
  if (const ConfigNode* n = r.get("scaling_rule")) {
    if (auto v = read_choice(*n, r.path("scaling_rule"), d, "scaling rule", kScalingRules)) a.scaling_rule = *v;
  }
  if (const ConfigNode* n = r.get("legw_warmup_epochs")) {
    if (auto v = read_double(*n, r.path("legw_warmup_epochs"), d, 0, 1e6, false)) a.legw_warmup_epochs = *v;
  }
  if (const ConfigNode* n = r.get("decision_interval")) {
    if (auto v = read_int(*n, r.path("decision_interval"), d, 1, kMaxLength)) a.decision_interval = *v;
  }
  if (const ConfigNode* n = r.get("smoothing")) {
    if (auto v = read_double(*n, r.path("smoothing"), d, 0, 1, false)) {
      if (*v >= 1) {
        report(*n, r.path("smoothing"), d, "must be below 1 (the weight of the past in the moving average), e.g. 0.999");
      } else {
        a.smoothing = *v;
      }
    }
  }
  r.finish();
}

void check_adaptive_batch(const ExperimentConfig& config, const ConfigNode& root, Diagnostics& d) {
  const AdaptiveBatch& a = config.optimizations.adaptive_batch_size;
  if (!a.enabled) return;
  const ConfigNode* opt = root.find("optimizations");
  const ConfigNode* section = opt != nullptr ? opt->find("adaptive_batch_size") : nullptr;
  if (section == nullptr) return;
  const std::string path = "optimizations.adaptive_batch_size";
  if (a.max_batch_size == 0) {
    report(*section, path, d, "enabled needs max_batch_size: the most records a step may take across the ranks, "
                              "e.g. max_batch_size: 1024");
  }
  if (config.engine && config.engine->pipeline.stages > 1) {
    report(*section, path, d, "measures the gradient noise across whole replicas of the model and reshapes every "
                              "rank's batch alike, which hpctrial does not do for a model in pipeline stages; turn "
                              "it off, or remove engine.pipeline");
  }
  if (config.optimizations.aggregation_frequency != 1) {
    report(*section, path, d, "chooses how many batches each step accumulates itself; remove "
                              "optimizations.aggregation_frequency, and set gradient_accumulation: true to let it "
                              "accumulate");
  }
  if (config.engine && config.engine->gradient_accumulation_steps && *config.engine->gradient_accumulation_steps != 1) {
    report(*section, path, d, "chooses how many micro-batches each step accumulates itself; remove "
                              "engine.gradient_accumulation_steps, and set gradient_accumulation: true to let it "
                              "accumulate");
  }
  if (config.engine && config.engine->train_micro_batch_size_per_gpu) {
    report(*section, path, d, "chooses each rank's micro-batch itself; remove engine.train_micro_batch_size_per_gpu, "
                              "and bound the micro-batch with local_batch_size_bounds: [min, " +
                                  std::to_string(*config.engine->train_micro_batch_size_per_gpu) + "]");
  }
}

}  // namespace detail
}  // namespace hpctrial::core
