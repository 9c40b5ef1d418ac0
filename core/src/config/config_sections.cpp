// The readers of the experiment schema's sections: searcher, resources, optimizations,
// checkpoint_storage and scheduler (launcher: config_launcher.cpp; engine: config_engine.cpp;
// the checks across sections are in config_checks.cpp).
#include "config_schema.h"

#include <fmt/core.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <regex>
#include <tuple>

#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/paths.h"
#include "hpctrial/core/text.h"

namespace hpctrial::core::detail {

namespace {

// A key of the adaptive searchers, given to another searcher: reported, and not read.
const ConfigNode* halving_key(MapReader& r, const Searcher& s, const char* key, bool ours) {
  const ConfigNode* n = r.get(key);
  if (n != nullptr && !ours) {
    report(*n, r.path(key), r.diagnostics(),
           std::string("the ") + std::string(to_string(s.name)) + " searcher has no " + key +
               (s.adaptive() ? "; it belongs to the other adaptive searcher" : "; it is a key of adaptive_asha and async_halving"));
    return nullptr;
  }
  return n;
}

// adaptive_asha's and async_halving's keys (Determined's names and defaults).
void read_halving(MapReader& r, Searcher& s) {
  Diagnostics& d = r.diagnostics();
  const bool adaptive_asha = s.name == Searcher::Name::kAdaptiveAsha, halving = s.name == Searcher::Name::kAsyncHalving;
  if (const ConfigNode* n = halving_key(r, s, "divisor", s.adaptive())) {
    if (auto v = read_double(*n, r.path("divisor"), d, 1, 1e6, true)) s.divisor = *v;
  }
  if (const ConfigNode* n = halving_key(r, s, "stop_once", s.adaptive())) {
    if (auto v = read_bool(*n, r.path("stop_once"), d)) s.stop_once = *v;
  }
  if (const ConfigNode* n = halving_key(r, s, "mode", adaptive_asha)) {
    if (auto v = read_choice(*n, r.path("mode"), d, "mode", kSearcherModes)) s.mode = *v;
  }
  if (const ConfigNode* n = halving_key(r, s, "max_rungs", adaptive_asha)) {
    if (auto v = read_int(*n, r.path("max_rungs"), d, 1, 64)) s.max_rungs = static_cast<int>(*v);
  }
  if (const ConfigNode* n = halving_key(r, s, "bracket_rungs", adaptive_asha)) {
    if (!n->is_sequence() || n->items().empty()) {
      report(*n, r.path("bracket_rungs"), d, "must be a list of rung counts, one a bracket, e.g. [4, 3, 2]");
    } else {
      for (std::size_t i = 0; i < n->items().size(); ++i) {
        const std::string path = r.path("bracket_rungs") + "[" + std::to_string(i) + "]";
        if (auto v = read_int(n->items()[i], path, d, 1, 64)) s.bracket_rungs.push_back(static_cast<int>(*v));
      }
    }
  }
  if (const ConfigNode* n = halving_key(r, s, "num_rungs", halving)) {
    if (auto v = read_int(*n, r.path("num_rungs"), d, 1, 64)) s.num_rungs = static_cast<int>(*v);
  } else if (halving && r.present()) {
    d.error(r.where(), r.path("num_rungs"), "required key is missing for the async_halving searcher; add it, e.g. "
                                            "`num_rungs: 3`");
  }
}

}  // namespace

void read_path(MapReader& r, const char* key, std::string& out) {
  Diagnostics& d = r.diagnostics();
  const ConfigNode* n = r.get(key);
  if (n == nullptr) return;
  const auto v = read_string(*n, r.path(key), d);
  if (!v) return;
  // Relative to the file that says it (a template's directory for a template's path); relative
  // to the working directory for --set.
  const SourceLocation& where = n->where();
  std::filesystem::path base = std::filesystem::current_path();
  if (where.line > 0 && std::filesystem::path(where.file).has_parent_path()) {
    base = std::filesystem::path(where.file).parent_path();
  }
  try {
    out = resolve_user_path(*v, base, r.path(key)).string();
  } catch (const ConfigError& e) {
    // The message already starts with the key path; keep only the reason.
    const std::string message = e.what();
    report(*n, r.path(key), d, message.substr(r.path(key).size() + 2));
  }
}

namespace {

// Fine-tuning: source_checkpoint, and source_trial_id, a trial of the experiment it names.
void read_source(MapReader& r, Searcher& s) {
  read_path(r, "source_checkpoint", s.source_checkpoint);
  if (const ConfigNode* n = r.get("source_trial_id")) {
    if (auto v = read_int(*n, r.path("source_trial_id"), r.diagnostics(), 0, kMaxTrials)) {
      s.source_trial_id = static_cast<int>(*v);
      if (s.source_checkpoint.empty()) {
        report(*n, r.path("source_trial_id"), r.diagnostics(),
               "names a trial of the experiment directory searcher.source_checkpoint names (hpctrial numbers "
               "trials per experiment); add it, e.g. `source_checkpoint: runs/pretrain`");
      }
    }
  }
}

}  // namespace

void read_searcher(MapReader& r, Searcher& s) {
  Diagnostics& d = r.diagnostics();
  // The checks that depend on the searcher are made only when its name is known: an unknown
  // name is one error, not one more for each key the default searcher would refuse.
  bool name_known = false;
  if (const ConfigNode* n = r.require("name", "name: single")) {
    if (auto v = read_choice(*n, r.path("name"), d, "searcher", kSearcherNames)) {
      s.name = *v;
      name_known = true;
    }
  }
  if (const ConfigNode* n = r.require("metric", "metric: validation_loss")) {
    if (auto v = read_string(*n, r.path("metric"), d)) s.metric = *v;
  }
  if (const ConfigNode* n = r.get("smaller_is_better")) {
    if (auto v = read_bool(*n, r.path("smaller_is_better"), d)) s.smaller_is_better = *v;
  }
  if (const ConfigNode* n = r.require("max_length", "max_length: {batches: 1000}")) {
    if (auto v = read_length(*n, r.path("max_length"), d,
                             {LengthUnit::kBatches, LengthUnit::kEpochs, LengthUnit::kRecords})) {
      s.max_length = *v;
    }
  }
  const ConfigNode* trials = r.get("max_trials");
  if (trials != nullptr) {
    if (auto v = read_int(*trials, r.path("max_trials"), d, 1, kMaxTrials)) {
      s.max_trials = *v;
      if (!name_known) {
        // reported with the name
      } else if (s.name == Searcher::Name::kSingle && *v != 1) {
        report(*trials, r.path("max_trials"), d,
               "the single searcher runs exactly one trial; remove max_trials or use the random "
               "searcher");
      } else if (s.name == Searcher::Name::kGrid) {
        report(*trials, r.path("max_trials"), d,
               "the grid searcher runs one trial per grid point; remove max_trials and set "
               "`count` on each hyperparameter range instead");
      }
    }
  } else if (name_known && (s.name == Searcher::Name::kRandom || s.adaptive()) && r.present()) {
    r.diagnostics().error(r.where(), r.path("max_trials"),
                          "required key is missing for the " + std::string(to_string(s.name)) +
                              " searcher; add it, e.g. `max_trials: 16`");
  }
  if (const ConfigNode* n = r.get("max_concurrent_trials")) {
    if (auto v = read_int(*n, r.path("max_concurrent_trials"), d, 1, kMaxTrials)) s.max_concurrent_trials = *v;
  }
  if (name_known) read_halving(r, s);
  read_source(r, s);
  r.finish();
}

void read_resources(MapReader& r, Resources& res) {
  Diagnostics& d = r.diagnostics();
  const ConfigNode* per_node = nullptr;
  if (const ConfigNode* n = r.get("slots_per_trial")) {
    if (auto v = read_int(*n, r.path("slots_per_trial"), d, 1, kMaxSlots)) res.slots_per_trial = static_cast<int>(*v);
  }
  bool per_node_ok = true;
  if ((per_node = r.get("slots_per_node"))) {
    auto v = read_int(*per_node, r.path("slots_per_node"), d, 1, kMaxSlots);
    per_node_ok = v.has_value();
    if (v) res.slots_per_node = static_cast<int>(*v);
  }
  if (per_node == nullptr) res.slots_per_node = res.slots_per_trial;
  const ConfigNode* min_slots = r.get("min_slots_per_trial");
  if (min_slots != nullptr) {
    if (auto v = read_int(*min_slots, r.path("min_slots_per_trial"), d, 1, kMaxSlots)) {
      res.min_slots_per_trial = static_cast<int>(*v);
    }
  }
  if (const ConfigNode* n = r.get("cpus_per_slot")) {
    if (auto v = read_int(*n, r.path("cpus_per_slot"), d, 1, kMaxCpusPerSlot)) res.cpus_per_slot = static_cast<int>(*v);
  }
  if (const ConfigNode* n = r.get("gpus_per_slot")) {
    if (auto v = read_int(*n, r.path("gpus_per_slot"), d, 0, kMaxGpusPerSlot)) res.gpus_per_slot = static_cast<int>(*v);
  }
  if (const ConfigNode* n = r.get("max_excluded_nodes")) {
    if (auto v = read_int(*n, r.path("max_excluded_nodes"), d, 0, kMaxSlots)) res.max_excluded_nodes = static_cast<int>(*v);
  }
  const ConfigNode* spares = r.get("spare_nodes");
  const auto spare_nodes = spares ? read_int(*spares, r.path("spare_nodes"), d, 0, kMaxSlots) : std::nullopt;
  if (spare_nodes) res.spare_nodes = static_cast<int>(*spare_nodes);
  if (const ConfigNode* n = r.get("memory_per_node")) {
    if (auto text = read_string(*n, r.path("memory_per_node"), d)) {
      std::string reason;
      if (auto bytes = parse_memory(*text, &reason)) {
        if (*bytes < (1u << 20)) {
          report(*n, r.path("memory_per_node"), d, "must be at least 1M, got " + describe(*n));
        } else {
          res.memory_per_node_bytes = bytes;
        }
      } else {
        report(*n, r.path("memory_per_node"), d, describe(*n) + " " + reason);
      }
    }
  }
  if (per_node != nullptr && per_node_ok) {
    if (res.slots_per_node > res.slots_per_trial) {
      report(*per_node, r.path("slots_per_node"), d,
             "is " + std::to_string(res.slots_per_node) + ", more than slots_per_trial (" +
                 std::to_string(res.slots_per_trial) + "); a trial uses at most slots_per_trial "
                 "slots, so lower slots_per_node");
    } else if (res.slots_per_trial % res.slots_per_node != 0) {
      const int lower = res.slots_per_trial / res.slots_per_node * res.slots_per_node;
      const int upper = lower + res.slots_per_node;
      report(*per_node, r.path("slots_per_node"), d,
             "slots_per_trial (" + std::to_string(res.slots_per_trial) +
                 ") must be a multiple of slots_per_node (" + std::to_string(res.slots_per_node) +
                 ") so every node runs the same number of ranks; use slots_per_trial " +
                 (lower > 0 ? std::to_string(lower) + " or " : "") + std::to_string(upper));
    }
  }
  if (min_slots != nullptr && res.min_slots_per_trial > 0) {
    if (res.min_slots_per_trial > res.slots_per_trial) {
      report(*min_slots, r.path("min_slots_per_trial"), d,
             "is " + std::to_string(res.min_slots_per_trial) + ", more than slots_per_trial (" +
                 std::to_string(res.slots_per_trial) + "), the most a run takes; lower it");
    } else if (res.min_slots_per_trial % res.slots_per_node != 0) {
      report(*min_slots, r.path("min_slots_per_trial"), d,
             "must be a multiple of slots_per_node (" + std::to_string(res.slots_per_node) +
                 "): an elastic job is granted whole nodes");
    }
  }
  if (spares != nullptr && res.spare_nodes > 0 && res.elastic()) {
    report(*spares, r.path("spare_nodes"), d,
           "an elastic job (min_slots_per_trial) runs on every node it is granted, so none is spare; keep one "
           "of spare_nodes and min_slots_per_trial");
  }
  r.finish();
}

void read_optimizations(MapReader& r, Optimizations& o) {
  Diagnostics& d = r.diagnostics();
  if (const ConfigNode* n = r.get("aggregation_frequency")) {
    if (auto v = read_int(*n, r.path("aggregation_frequency"), d, 1, kMaxAggregation)) o.aggregation_frequency = *v;
  }
  if (const ConfigNode* n = r.get("average_training_metrics")) {
    if (auto v = read_bool(*n, r.path("average_training_metrics"), d)) o.average_training_metrics = *v;
  }
  // Determined's name for the bucket size is accepted as an alias.
  const ConfigNode* cap = r.get("bucket_cap_mb");
  const ConfigNode* fusion = r.get("tensor_fusion_threshold");
  if (cap != nullptr && fusion != nullptr) {
    report(*fusion, r.path("tensor_fusion_threshold"), d,
           "is Determined's name for bucket_cap_mb, which is also set; keep one of them");
  } else if (const ConfigNode* n = cap != nullptr ? cap : fusion) {
    const std::string key = cap != nullptr ? "bucket_cap_mb" : "tensor_fusion_threshold";
    if (auto v = read_double(*n, r.path(key), d, 0, kMaxBucketCapMb, true)) o.bucket_cap_mb = *v;
  }
  // Determined's settings that hpctrial has no counterpart for yet: their neutral value is
  // accepted, any other refused with what to do instead.
  if (const ConfigNode* n = r.get("average_aggregated_gradients")) {
    if (auto v = read_bool(*n, r.path("average_aggregated_gradients"), d); v && !*v) {
      report(*n, r.path("average_aggregated_gradients"), d,
             "false (summing aggregated gradients) is not supported: hpctrial averages them; to step with "
             "their sum, multiply the learning rate by aggregation_frequency");
    }
  }
  if (const ConfigNode* n = r.get("auto_tune_tensor_fusion")) {
    if (auto v = read_bool(*n, r.path("auto_tune_tensor_fusion"), d); v && *v) {
      report(*n, r.path("auto_tune_tensor_fusion"), d,
             "is not supported: set the bucket size with bucket_cap_mb (benchmarks/allreduce measures the "
             "sizes on your network), or remove it");
    }
  }
  if (const ConfigNode* n = r.get("mixed_precision")) {
    if (auto v = read_string(*n, r.path("mixed_precision"), d); v && *v != "O0") {
      report(*n, r.path("mixed_precision"), d,
             "\"" + *v + "\" (Apex AMP) is not supported by the PyTorchTrial-style trial; use O0 or remove it, and "
             "cast to half precision in train_batch yourself");
    }
  }
  if (const ConfigNode* n = r.get("gradient_compression")) {
    // Determined's boolean form is kept: true is fp16.
    if (n->is_scalar() && !n->quoted() && (n->text() == "true" || n->text() == "false")) {
      o.gradient_compression = n->text() == "true" ? GradientCompression::kFloat16 : GradientCompression::kNone;
    } else if (auto v = read_choice(*n, r.path("gradient_compression"), d, "gradient compression",
                                    kCompressions)) {
      o.gradient_compression = *v;
    }
  }
  if (const ConfigNode* n = r.get("collective_timeout")) {
    if (auto v = read_duration(*n, r.path("collective_timeout"), d, 1, kMaxCollectiveTimeout)) {
      o.collective_timeout_seconds = *v;
    }
  }
  if (const ConfigNode* n = r.get("replica_check_period")) {
    if (auto v = read_int(*n, r.path("replica_check_period"), d, 0, std::int64_t{1} << 40)) o.replica_check_period = *v;
  }
  if (const ConfigNode* n = r.get("network_interface")) {
    if (auto v = read_string(*n, r.path("network_interface"), d)) {
      // A name as the kernel allows one (IFNAMSIZ), in the characters interface names use.
      const bool valid = !v->empty() && v->size() < 16 &&
                         v->find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-") ==
                             std::string::npos;
      if (valid) {
        o.network_interface = *v;
      } else {
        report(*n, r.path("network_interface"), d,
               "\"" + *v + "\" is not a network interface's name (at most 15 letters, digits, '_', '.', ':' or '-', "
               "as `ip link` lists them: ib0, eth1, enp65s0f0)");
      }
    }
  }
  if (const ConfigNode* n = r.get("huge_pages")) {
    if (auto v = read_bool(*n, r.path("huge_pages"), d)) o.huge_pages = *v;
  }
  if (const ConfigNode* n = r.get("adaptive_batch_size")) read_adaptive_batch(*n, r.path("adaptive_batch_size"), d, o.adaptive_batch_size);
  r.finish();
}

void read_checkpoint_storage(MapReader& r, CheckpointStorage& c) {
  Diagnostics& d = r.diagnostics();
  if (const ConfigNode* n = r.get("type")) {
    read_choice(*n, r.path("type"), d, "storage type", kStorageTypes);
  }
  read_path(r, "host_path", c.host_path);
  const ConfigNode* latest = r.get("save_trial_latest");
  if (latest != nullptr) {
    if (auto v = read_int(*latest, r.path("save_trial_latest"), d, 0, 100000)) {
      if (*v == 0) {
        report(*latest, r.path("save_trial_latest"), d,
               "must be at least 1: a paused, preempted or requeued trial resumes from its "
               "latest checkpoint");
      } else {
        c.save_trial_latest = static_cast<int>(*v);
      }
    }
  }
  if (const ConfigNode* n = r.get("save_trial_best")) {
    if (auto v = read_int(*n, r.path("save_trial_best"), d, 0, 100000)) c.save_trial_best = static_cast<int>(*v);
  }
  if (const ConfigNode* n = r.get("async")) {
    if (auto v = read_bool(*n, r.path("async"), d)) c.async = *v;
  }
  if (const ConfigNode* n = r.get("group_readable")) {
    if (auto v = read_bool(*n, r.path("group_readable"), d)) c.group_readable = *v;
  }
  if (const ConfigNode* n = r.get("auto_overhead")) {
    if (auto v = read_double(*n, r.path("auto_overhead"), d, 0.0, 0.5, true)) c.auto_overhead = *v;
  }
  if (const ConfigNode* n = r.get("auto_max_interval")) {
    if (auto v = read_duration(*n, r.path("auto_max_interval"), d, 1, 7 * 24 * 3600)) c.auto_max_interval_seconds = *v;
  }
  r.finish();
}

void read_profiling(MapReader& r, Profiling& p) {
  Diagnostics& d = r.diagnostics();
  if (const ConfigNode* n = r.get("enabled")) {
    if (auto v = read_bool(*n, r.path("enabled"), d)) p.enabled = *v;
  }
  if (const ConfigNode* n = r.get("begin_on_batch")) {
    if (auto v = read_int(*n, r.path("begin_on_batch"), d, 1, kMaxLength)) p.begin_on_batch = *v;
  }
  if (const ConfigNode* n = r.get("end_after_batch"); n != nullptr && !n->is_null()) {
    if (auto v = read_int(*n, r.path("end_after_batch"), d, 1, kMaxLength)) {
      if (*v < p.begin_on_batch) {
        report(*n, r.path("end_after_batch"), d,
               "must not come before begin_on_batch (" + std::to_string(p.begin_on_batch) + "), got " + describe(*n));
      } else {
        p.end_after_batch = *v;
      }
    }
  }
  if (const ConfigNode* n = r.get("system_metrics_period")) {
    if (auto v = read_duration(*n, r.path("system_metrics_period"), d, 0, kMaxCollectiveTimeout)) {
      p.system_metrics_period_seconds = *v;
    }
  }
  r.finish();
}

void read_scheduler(MapReader& r, SchedulerConfig& s) {
  Diagnostics& d = r.diagnostics();
  // Which scheduler names exist is the registry's to say (check_scheduler_config); here a name.
  if (const ConfigNode* n = r.get("type")) {
    s.written_at["type"] = n->where();
    if (auto v = read_string(*n, r.path("type"), d)) s.type = *v;
  }
  if (const ConfigNode* n = r.get("account")) {
    s.written_at["account"] = n->where();
    if (auto v = read_scheduler_name(*n, r.path("account"), d, false)) s.account = *v;
  }
  const ConfigNode* limit = r.get("time_limit");
  if (limit != nullptr) {
    s.time_limit_seconds = read_duration(*limit, r.path("time_limit"), d, 60, kMaxTimeLimit);
  }
  const ConfigNode* grace = r.get("preemption_grace");
  if (grace != nullptr) {
    if (auto v = read_duration(*grace, r.path("preemption_grace"), d, 10, kMaxGrace)) {
      s.preemption_grace_seconds = *v;
    }
  }
  if (s.time_limit_seconds && s.preemption_grace_seconds >= *s.time_limit_seconds) {
    const ConfigNode& at = grace != nullptr ? *grace : *limit;
    report(at, r.path(grace != nullptr ? "preemption_grace" : "time_limit"), d,
           "preemption_grace (" + format_duration(s.preemption_grace_seconds) +
               ") must be shorter than time_limit (" + format_duration(*s.time_limit_seconds) +
               "), or the trial is asked to stop before it starts");
  }
  if (const ConfigNode* n = r.get("modules")) {
    if (auto list = read_string_list(*n, r.path("modules"), d)) {
      for (std::size_t i = 0; i < list->size(); ++i) {
        if (!full_match((*list)[i], "[A-Za-z0-9._+/-]+")) {
          report(n->items()[i], r.path("modules") + "[" + std::to_string(i) + "]", d,
                 "is not a module name (letters, digits and . _ + / -), got " +
                     describe(n->items()[i]));
        } else {
          s.modules.push_back((*list)[i]);
        }
      }
    }
  }
  s.environment = read_environment(r.get("environment"), r.path("environment"), d);
  if (const ConfigNode* n = r.get("extra_directives")) {
    if (auto list = read_string_list(*n, r.path("extra_directives"), d)) {
      for (std::size_t i = 0; i < list->size(); ++i) {
        if ((*list)[i].front() != '-') {
          report(n->items()[i], r.path("extra_directives") + "[" + std::to_string(i) + "]", d,
                 "must be an option such as --exclusive or -l place=scatter (without the "
                 "#SBATCH / #PBS prefix), got " + describe(n->items()[i]));
        } else {
          s.extra_directives.push_back((*list)[i]);
        }
      }
    }
  }
  // The rest belongs to one scheduler or another: the registry vets them (check_scheduler_config).
  s.options = r.rest();
  for (const ConfigEntry& option : s.options) s.written_at[option.key] = option.value.where();
}

}  // namespace hpctrial::core::detail
