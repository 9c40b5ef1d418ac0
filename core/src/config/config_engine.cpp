// The reader of the experiment schema's engine section (DeepSpeed's keys) and its batch sizes.
#include "config_schema.h"

#include <fmt/core.h>

#include <cmath>
#include <limits>
#include <regex>

#include "hpctrial/core/error.h"

namespace hpctrial::core::detail {

namespace {

// engine.pipeline: {stages: 4, partition_method: parameters | uniform | type:REGEX | [0, 3, 6, 8],
// activation_checkpoint_interval: 0}.
void read_pipeline(const ConfigNode& node, const std::string& path, Diagnostics& d, EngineConfig::Pipeline& p) {
  if (!expect_map(node, path, d, "pipeline: {stages: 2}")) return;
  MapReader r(&node, path, d);
  if (const ConfigNode* n = r.get("stages")) {
    if (auto v = read_int(*n, r.path("stages"), d, 1, kMaxSlots)) p.stages = static_cast<int>(*v);
  }
  if (const ConfigNode* n = r.get("partition_method")) {
    if (n->is_sequence()) {
      // Explicit bounds: 0, each later stage's first layer, then the number of layers.
      p.partition_method = "explicit";
      for (const ConfigNode& item : n->items()) {
        const auto v = read_int(item, r.path("partition_method"), d, 0, kMaxLength);
        if (!v) return;
        if (!p.bounds.empty() && *v <= p.bounds.back()) {
          report(item, r.path("partition_method"), d,
                 "the bounds must increase: each stage holds at least one layer, e.g. [0, 4, 8]");
          return;
        }
        p.bounds.push_back(*v);
      }
      if (p.bounds.size() < 2 || p.bounds.front() != 0) {
        report(*n, r.path("partition_method"), d,
               "explicit bounds start at 0 and end with the number of layers, one more than the stages, e.g. [0, 4, 8]");
      }
    } else if (auto v = read_string(*n, r.path("partition_method"), d)) {
      const bool type = v->rfind("type:", 0) == 0;
      std::string bad_regex;
      if (type) {
        try {
          (void)std::regex(v->substr(5), std::regex::ECMAScript | std::regex::icase);
        } catch (const std::regex_error& e) {
          bad_regex = e.what();
        }
      }
      if (*v != "parameters" && *v != "uniform" && !type) {
        report(*n, r.path("partition_method"), d,
               "must be parameters (balance the parameter counts), uniform (balance the layer counts), type:REGEX "
               "(balance the layers whose name REGEX finds, e.g. type:block) or a list of bounds, e.g. [0, 4, 8]; "
               "got \"" + *v + "\"");
      } else if (type && (v->size() == 5 || !bad_regex.empty())) {
        report(*n, r.path("partition_method"), d,
               "type: needs a regular expression of the layers to balance, e.g. type:block" +
                   (bad_regex.empty() ? std::string() : "; \"" + v->substr(5) + "\" is not one: " + bad_regex));
      } else {
        p.partition_method = *v;
      }
    }
  }
  if (const ConfigNode* n = r.get("activation_checkpoint_interval")) {
    if (auto v = read_int(*n, r.path("activation_checkpoint_interval"), d, 0, 1'000'000)) {
      p.activation_checkpoint_interval = static_cast<int>(*v);
    }
  }
  r.finish();
  if (p.partition_method == "explicit" && p.bounds.size() >= 2 && static_cast<int>(p.bounds.size()) != p.stages + 1) {
    report(node, path, d,
           "partition_method lists " + std::to_string(p.bounds.size()) + " bounds, which make " +
               std::to_string(p.bounds.size() - 1) + " stage(s), but stages is " + std::to_string(p.stages) +
               "; give stages + 1 bounds");
  }
}

// offload_optimizer, or (`param`) offload_param, which has no buffer_count: its parts are read
// a gather's at a time.
void read_offload(const ConfigNode& node, const std::string& path, Diagnostics& d, EngineConfig::Offload& o,
                  bool param) {
  const std::string name = param ? "offload_param" : "offload_optimizer";
  if (!expect_map(node, path, d, name + ": {device: nvme, nvme_path: /local/scratch}")) return;
  MapReader r(&node, path, d);
  if (const ConfigNode* n = r.get("device")) {
    if (auto v = read_string(*n, r.path("device"), d)) {
      if (*v == "none" || *v == "cpu" || *v == "nvme") {
        o.device = *v;
      } else {
        report(*n, r.path("device"), d, "is '" + *v + "'; use none, cpu or nvme");
      }
    }
  }
  read_path(r, "nvme_path", o.nvme_path);
  if (const ConfigNode* n = param ? nullptr : r.get("buffer_count")) {
    if (auto v = read_int(*n, r.path("buffer_count"), d, 1, 1'000'000)) o.buffer_count = static_cast<int>(*v);
  }
  r.finish();
  if (o.device == "nvme" && o.nvme_path.empty()) {
    report(node, path, d,
           std::string("device nvme needs nvme_path: a directory on each node's local disk, where each rank keeps a "
                       "swap file of its ") +
               (param ? "parts of the parameters" : "optimizer state"));
  }
}

void read_zero(const ConfigNode& node, const std::string& path, Diagnostics& d, EngineConfig& e) {
  if (!expect_map(node, path, d, "zero_optimization: {stage: 2}")) return;
  MapReader z(&node, path, d);
  if (const ConfigNode* stage = z.get("stage")) {
    if (auto v = read_int(*stage, z.path("stage"), d, 0, 3)) e.zero_stage = static_cast<int>(*v);
  }
  if (const ConfigNode* size = z.get("reduce_bucket_size")) {
    if (auto v = read_int(*size, z.path("reduce_bucket_size"), d, 1, kMaxLength)) e.reduce_bucket_size = *v;
  }
  if (const ConfigNode* size = z.get("sub_group_size")) {
    if (auto v = read_int(*size, z.path("sub_group_size"), d, 1, kMaxLength)) e.sub_group_size = *v;
  }
  // Stage 3's counts of elements, DeepSpeed's keys.
  const std::pair<const char*, std::int64_t*> counts[] = {
      {"stage3_param_persistence_threshold", &e.param_persistence_threshold},
      {"stage3_model_persistence_threshold", &e.model_persistence_threshold},
      {"stage3_prefetch_bucket_size", &e.prefetch_bucket_size},
      {"stage3_max_live_parameters", &e.max_live_parameters},
      {"stage3_max_reuse_distance", &e.max_reuse_distance}};
  for (const auto& [key, into] : counts) {
    if (const ConfigNode* n = z.get(key)) {
      if (auto v = read_int(*n, z.path(key), d, 0, std::numeric_limits<std::int64_t>::max())) *into = *v;
    }
  }
  if (const ConfigNode* o = z.get("offload_optimizer")) {
    read_offload(*o, z.path("offload_optimizer"), d, e.offload_optimizer, false);
  }
  if (const ConfigNode* o = z.get("offload_param")) read_offload(*o, z.path("offload_param"), d, e.offload_param, true);
  z.finish();
}

}  // namespace

void read_engine(MapReader& r, EngineConfig& e) {
  Diagnostics& d = r.diagnostics();
  for (const char* key : {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}) {
    if (const ConfigNode* n = r.get(key)) {
      const std::string k = key;
      auto& field = k == "train_batch_size" ? e.train_batch_size
                    : k == "train_micro_batch_size_per_gpu" ? e.train_micro_batch_size_per_gpu
                                                            : e.gradient_accumulation_steps;
      field = read_int(*n, r.path(key), d, 1, kMaxLength);
    }
  }
  if (const ConfigNode* n = r.get("gradient_clipping")) {
    if (auto v = read_double(*n, r.path("gradient_clipping"), d, 0, 1e30, false)) e.gradient_clipping = *v;
  }
  if (const ConfigNode* n = r.get("zero_optimization")) read_zero(*n, r.path("zero_optimization"), d, e);
  if (const ConfigNode* n = r.get("bf16")) {
    if (expect_map(*n, r.path("bf16"), d, "bf16: {enabled: true}")) {
      MapReader b(n, r.path("bf16"), d);
      if (const ConfigNode* enabled = b.get("enabled")) {
        if (auto v = read_bool(*enabled, b.path("enabled"), d)) e.bf16 = *v;
      }
      b.finish();
    }
  }
  if (const ConfigNode* n = r.get("pipeline")) read_pipeline(*n, r.path("pipeline"), d, e.pipeline);
  if (const ConfigNode* n = r.get("fp16")) {
    if (expect_map(*n, r.path("fp16"), d, "fp16: {enabled: true}")) {
      MapReader f(n, r.path("fp16"), d);
      auto& fp16 = e.fp16;
      if (const ConfigNode* v = f.get("enabled")) {
        if (auto x = read_bool(*v, f.path("enabled"), d)) fp16.enabled = *x;
      }
      if (const ConfigNode* v = f.get("loss_scale")) {
        if (auto x = read_double(*v, f.path("loss_scale"), d, 0, 1e30, false)) fp16.loss_scale = *x;
      }
      if (const ConfigNode* v = f.get("initial_scale_power")) {
        if (auto x = read_int(*v, f.path("initial_scale_power"), d, 0, 100)) fp16.initial_scale_power = static_cast<int>(*x);
      }
      if (const ConfigNode* v = f.get("loss_scale_window")) {
        if (auto x = read_int(*v, f.path("loss_scale_window"), d, 1, kMaxLength)) fp16.loss_scale_window = *x;
      }
      if (const ConfigNode* v = f.get("hysteresis")) {
        if (auto x = read_int(*v, f.path("hysteresis"), d, 1, 1'000'000)) fp16.hysteresis = static_cast<int>(*x);
      }
      if (const ConfigNode* v = f.get("consecutive_hysteresis")) {
        if (auto x = read_bool(*v, f.path("consecutive_hysteresis"), d)) fp16.consecutive_hysteresis = *x;
      }
      if (const ConfigNode* v = f.get("min_loss_scale")) {
        if (auto x = read_double(*v, f.path("min_loss_scale"), d, 0, 1e30, true)) fp16.min_loss_scale = *x;
      }
      // As DeepSpeed reads it: with none of the dynamic scale's keys, its DynamicLossScaler's
      // own defaults, not those of the config's keys.
      const bool keyed = f.get("initial_scale_power") || f.get("loss_scale_window") || f.get("hysteresis") ||
                         f.get("consecutive_hysteresis") || f.get("min_loss_scale");
      if (!keyed) {
        fp16.initial_scale_power = 32;
        fp16.hysteresis = 1;
      }
      if (fp16.min_loss_scale > std::ldexp(1.0, fp16.initial_scale_power)) {
        report(*n, r.path("fp16"), d,
               fmt::format("min_loss_scale ({}) is above the initial scale 2^initial_scale_power ({}); lower "
                           "min_loss_scale or raise initial_scale_power",
                           fp16.min_loss_scale, std::ldexp(1.0, fp16.initial_scale_power)));
      }
      f.finish();
    }
  }
  r.finish();
}

std::optional<EngineBatch> resolve_engine_batch_sizes(const EngineConfig& engine,
                                                      std::optional<std::int64_t> global_batch_size, int ranks,
                                                      std::string& error) {
  const auto total = global_batch_size ? global_batch_size : engine.train_batch_size;
  const auto& micro = engine.train_micro_batch_size_per_gpu;
  const auto& steps = engine.gradient_accumulation_steps;
  const char* total_name =
      global_batch_size ? "hyperparameters.global_batch_size (which sets train_batch_size)" : "train_batch_size";
  EngineBatch b;
  if (total && micro && steps) {
    if (*micro * *steps * ranks != *total) {
      error = fmt::format("{} is {} but train_micro_batch_size_per_gpu ({}) x gradient_accumulation_steps ({}) x "
                          "ranks ({}) is {}; change one of them, or leave one out to have it derived",
                          total_name, *total, *micro, *steps, ranks, *micro * *steps * ranks);
      return std::nullopt;
    }
    b = {*total, *micro, *steps};
  } else if (total && (micro || steps)) {
    const std::int64_t known = (micro ? *micro : *steps) * ranks;
    if (*total % known != 0) {
      error = fmt::format("{} ({}) is not a multiple of {} ({}) x ranks ({}) = {}; make it a multiple, e.g. {}",
                          total_name, *total, micro ? "train_micro_batch_size_per_gpu" : "gradient_accumulation_steps",
                          micro ? *micro : *steps, ranks, known, std::max(known, *total / known * known));
      return std::nullopt;
    }
    b = {*total, micro ? *micro : *total / known, steps ? *steps : *total / known};
  } else if (total) {
    if (*total % ranks != 0) {
      error = fmt::format("{} ({}) is not a multiple of the {} ranks; make it a multiple, e.g. {}", total_name, *total,
                          ranks, std::max<std::int64_t>(ranks, *total / ranks * ranks));
      return std::nullopt;
    }
    b = {*total, *total / ranks, 1};
  } else if (micro) {
    b = {*micro * (steps ? *steps : 1) * ranks, *micro, steps ? *steps : 1};
  } else {
    error = "sets no batch size; set train_batch_size or train_micro_batch_size_per_gpu (or "
            "hyperparameters.global_batch_size)";
    return std::nullopt;
  }
  return b;
}

}  // namespace hpctrial::core::detail
