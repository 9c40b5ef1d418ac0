#include "state/checkpointing.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <set>

#include "hpctrial/build_config.h"
#include "hpctrial/checkpoint/model_state.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/text.h"
#include "state/pipeline_checkpoint.h"
#include "state/sharded_checkpoint.h"
#include "state/state_io.h"
#include "parallel/zero.h"

namespace hpctrial::trainer::detail {
namespace {

using json = nlohmann::json;

// Beside an optimizer's state: whose shards of a ZeRO optimizer it is (mark_shard_of).
const std::string kShardOf = "/shard_of";

std::string hex(std::uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof text, "%08x", value);
  return text;
}

json parse(const checkpoint::Contents& contents, const std::string& name, const std::string& path) {
  try {
    return json::parse(contents.at(name, path).text());
  } catch (const json::exception& e) {
    throw CheckpointError(path + ": " + name + " is not valid JSON: " + e.what());
  }
}

// The hyperparameters that differ, as "name: old -> new" lines.
std::string differences(const json& before, const json& now) {
  std::string out;
  std::set<std::string> names;
  for (auto it = before.begin(); it != before.end(); ++it) names.insert(it.key());
  for (auto it = now.begin(); it != now.end(); ++it) names.insert(it.key());
  for (const auto& name : names) {
    const json a = before.contains(name) ? before.at(name) : json("(none)");
    const json b = now.contains(name) ? now.at(name) : json("(none)");
    if (a != b) out += (out.empty() ? "" : ", ") + name + ": " + a.dump() + " -> " + b.dump();
  }
  return out;
}

// One value a batch, any value a metric can take (core::json_number).
json period_values_json(const std::map<std::string, std::vector<double>>& period) {
  json out = json::object();
  for (const auto& [name, values] : period) {
    json list = json::array();
    for (double v : values) list.push_back(core::json_number(v));
    out[name] = std::move(list);
  }
  return out;
}

std::map<std::string, std::vector<double>> period_values_of(const json& period, const std::string& path) {
  std::map<std::string, std::vector<double>> out;
  if (!period.is_object()) throw CheckpointError(path + ": progress's period_values is not a map: " + period.dump());
  for (auto it = period.begin(); it != period.end(); ++it) {
    if (!it.value().is_array()) throw CheckpointError(path + ": progress's period_values." + it.key() + " is not a list");
    auto& values = out[it.key()];
    for (const auto& v : it.value()) {
      const auto number = core::number_of(v);
      if (!number) throw CheckpointError(path + ": progress's period_values." + it.key() + " holds " + v.dump());
      values.push_back(*number);
    }
  }
  return out;
}

}  // namespace

namespace {

// The wrapped models' tensors and the optimizers' state, under `part`.
void add_model_state(checkpoint::Contents& c, Deferred* deferred, TrialContext& context, const std::string& part,
                     const checkpoint::Contents* whole_optimizers) {
  const auto& models = context.models();
  for (std::size_t i = 0; i < models.size(); ++i) {
    const std::string prefix = part + "model/" + std::to_string(i) + "/";
    for (const auto& item : models[i]->named_parameters()) add_or_defer(c, deferred, prefix + item.key(), item.value());
    for (const auto& item : models[i]->named_buffers()) add_tensor(c, prefix + item.key(), item.value());
    // Every submodule, those without tensors too: an exported model's archive holds them all, as
    // torch::load(model, ...) reads every one.
    json modules = json::array();
    for (const auto& item : models[i]->named_modules("", /*include_self=*/false)) modules.push_back(item.key());
    c.add_text(part + "meta/modules/" + std::to_string(i), modules.dump());
  }
  const auto& optimizers = context.optimizers();
  for (std::size_t i = 0; i < optimizers.size(); ++i) {
    const std::string prefix = part + "optimizer/" + std::to_string(i);
    if (whole_optimizers != nullptr && whole_optimizers->find(prefix + "/type") != nullptr) {
      for (const auto& d : whole_optimizers->datasets) {
        if (d.name.rfind(prefix + "/", 0) == 0) c.datasets.push_back(d);  // shares the gathered buffer
      }
      continue;
    }
    save_optimizer(c, prefix, *optimizers[i], deferred);
    // A part's optimizer state by the names of its parameters: another partition finds it (the
    // loop adds them for ZeRO's, whose parameters are its own).
    if (!part.empty()) {
      c.add_text(prefix + "/param_names", parameter_names(context, parameter_groups(*optimizers[i], nullptr)).dump());
    }
  }
}

// A rank's own shards of a ZeRO optimizer's state (mark_shard_of): this rank's, of as many ranks,
// into an optimizer that ZeRO shards here too.
void check_shard_of(const checkpoint::Contents& contents, const std::string& prefix, const std::string& path,
                    TrialContext& context, bool sharded_here) {
  const json mark = parse(contents, prefix + kShardOf, path);
  const int rank = context.distributed().rank, ranks = context.distributed().size;
  const auto field = [&](const char* key) {
    return mark.is_object() && mark.contains(key) && mark.at(key).is_number_integer() ? mark.at(key) : json();
  };
  if (field("rank") != json(rank) || field("ranks") != json(ranks) || !sharded_here) {
    throw CheckpointError(path + " holds the shards of " + prefix + " of rank " + field("rank").dump() + " of " +
                          field("ranks").dump() + " ranks, and this is rank " +
                          std::to_string(rank) + " of " + std::to_string(ranks) +
                          (sharded_here ? std::string() : " with the optimizer whole") +
                          ": a rank's copy of its own resumes that rank alone");
  }
}

}  // namespace

checkpoint::Contents capture_part(TrialContext& context, const std::string& part,
                                  const checkpoint::Contents* whole_optimizers) {
  checkpoint::Contents c;
  add_model_state(c, nullptr, context, part, whole_optimizers);
  return c;
}

Snapshot capture(TrialContext& context, Trial& trial, const Callbacks& callbacks, const LoopState& loop,
                 const TrialIdentity& identity, bool defer, const checkpoint::Contents* whole_optimizers) {
  Snapshot snapshot;
  checkpoint::Contents& c = snapshot.contents;
  add_model_state(c, defer ? &snapshot.deferred : nullptr, context, identity.part, whole_optimizers);
  if (identity.parts > 1) {
    json parallel = {{"parts", identity.parts}};
    if (identity.pipeline) parallel["pipeline"] = true;
    c.add_text("meta/model_parallel", parallel.dump());
  }
  const auto& schedulers = context.lr_schedulers();
  for (std::size_t i = 0; i < schedulers.size(); ++i) {
    const std::int64_t count = scheduler_step_count(*schedulers[i].scheduler);
    c.add("scheduler/" + std::to_string(i) + "/step_count", checkpoint::DType::kInt64, {}, &count);
  }
  const auto& scalers = context.scalers();
  for (std::size_t i = 0; i < scalers.size(); ++i) c.add_text("scaler/" + std::to_string(i), scalers[i]->state_dict().dump());
  add_tensor(c, "rng/cpu", cpu_rng_state());
  if (context.device().is_cuda()) add_tensor(c, "rng/cuda", device_rng_state(context.device()));

  json progress = {{"batches", loop.batches_trained},
                   {"epochs", loop.epochs_trained},
                   {"records", loop.records_trained(identity.global_batch)},
                   {"global_batch_size", identity.global_batch},
                   {"restart_count", loop.restart_count},
                   {"last_validation_batches", loop.last_validation_batches},
                   {"last_report_batches", loop.last_report_batches},
                   {"period_batches", loop.period_batches},
                   {"period_values", period_values_json(loop.period_values)},
                   {"ended_by_trial", loop.ended_by_trial},
                   {"reducer_states", loop.reducer_states},
                   {"stream_positions", loop.stream_positions},
                   {"adaptive", loop.adaptive},
                   {"best_metric", loop.best_metric ? core::json_number(*loop.best_metric) : json(nullptr)}};
  c.add_text("progress", progress.dump());
  c.add_text("meta/config", identity.config_yaml);
  c.add_text("meta/hparams", identity.hparams.dump());
  json validation = json::object();
  for (const auto& [name, value] : loop.last_validation) validation[name] = value.to_json();
  c.add_text("meta/validation", validation.dump());
  json callback_states = json::object();
  for (const auto& [name, callback] : callbacks) callback_states[name] = callback->state_dict();
  c.add_text("callbacks", callback_states.dump());
  c.add_text("trial_state", trial.save_state().dump());
  if (!context.accumulators().empty()) c.add_text("accumulators", context.accumulators().state_dict().dump());

  c.attributes[checkpoint::kBatchesAttribute] = std::to_string(loop.batches_trained);
  const auto metric = loop.last_validation.find(identity.searcher_metric);
  if (loop.last_validation_batches == loop.batches_trained && metric != loop.last_validation.end()) {
    char text[40];
    std::snprintf(text, sizeof text, "%.17g", metric->second.number());
    c.attributes[checkpoint::kMetricAttribute] = text;
  }
  c.attributes["epochs"] = std::to_string(loop.epochs_trained);
  c.attributes["records"] = std::to_string(loop.records_trained(identity.global_batch));
  c.attributes["restart_count"] = std::to_string(loop.restart_count);
  c.attributes["hpctrial_version"] = HPCTRIAL_VERSION;
  c.attributes["created"] = core::utc_now_iso();
  c.attributes["world_size"] = std::to_string(identity.world_size);
  c.attributes["trial_id"] = std::to_string(identity.trial_id);
  if (!identity.code_digest.empty()) c.attributes["code_digest"] = identity.code_digest;
  c.attributes["experiment_id"] = identity.experiment_id;
  c.attributes["experiment_name"] = identity.experiment_name;
  c.attributes["config_crc32c"] = hex(checkpoint::crc32c(identity.config_yaml.data(), identity.config_yaml.size()));
  return snapshot;
}

namespace {

// The loop's counters and metrics from `progress` and meta/validation.
void read_progress(const checkpoint::Contents& contents, const std::string& path, LoopState& loop) {
  const json progress = parse(contents, "progress", path);
  try {
    loop.batches_trained = progress.at("batches").get<std::int64_t>();
    loop.epochs_trained = progress.at("epochs").get<std::int64_t>();
    loop.restart_count = progress.at("restart_count").get<std::int64_t>();
    loop.last_validation_batches = progress.at("last_validation_batches").get<std::int64_t>();
    loop.last_report_batches = progress.at("last_report_batches").get<std::int64_t>();
    loop.period_batches = progress.at("period_batches").get<std::int64_t>();
    loop.period_values = period_values_of(progress.at("period_values"), path);
    loop.ended_by_trial = progress.value("ended_by_trial", false);  // absent before it existed
    loop.reducer_states = progress.contains("reducer_states") ? progress.at("reducer_states") : json();
    loop.stream_positions = progress.contains("stream_positions") ? progress.at("stream_positions") : json();
    loop.adaptive = progress.contains("adaptive") ? progress.at("adaptive") : json();
    const json& best = progress.at("best_metric");
    loop.best_metric = best.is_null() ? std::nullopt : core::number_of(best);
    if (!best.is_null() && !loop.best_metric) throw CheckpointError(path + ": progress's best_metric is " + best.dump());
    const json validation = parse(contents, "meta/validation", path);
    if (!validation.is_null() && !validation.is_object()) {
      throw CheckpointError(path + ": meta/validation is not a map of metrics: " + validation.dump());
    }
    loop.last_validation.clear();
    if (validation.is_object()) {
      for (const auto& [name, value] : validation.items()) loop.last_validation.emplace(name, MetricValue(value));
    }
  } catch (const json::exception& e) {
    throw CheckpointError(path + ": progress is malformed: " + e.what());
  } catch (const IoError& e) {
    throw CheckpointError(e.what());
  }
  if (loop.batches_trained < 0) throw CheckpointError(path + ": progress has a negative batch count");
}

// "'name' (id X, trial N)", or what the attributes lack.
std::string who(const std::string& name, const std::string& id, const std::string& trial) {
  return "'" + (name.empty() ? std::string("?") : name) + "' (id " + (id.empty() ? std::string("none") : id) +
         ", trial " + trial + ")";
}

std::string attribute(const checkpoint::Contents& contents, const char* name) {
  const auto it = contents.attributes.find(name);
  return it == contents.attributes.end() ? std::string() : it->second;
}

// A parameter that a sharded optimizer of `sharded` partitions (ZeRO-3): this rank's part of it
// read from its dataset's range, or the dataset as it is (`own_parts`: a rank's own copy). False
// for another, or one the checkpoint lacks.
bool load_partitioned(const checkpoint::Contents& contents, const std::string& name, const torch::Tensor& parameter,
                      const std::string& path, const ShardedOptimizers& sharded, bool own_parts) {
  for (const auto& [index, optimizer] : sharded) {
    if (!optimizer->partitions_parameters()) continue;
    const auto at = optimizer->locate(parameter);
    const checkpoint::Dataset* d = contents.find(name);
    if (!at || d == nullptr) continue;
    own_parts ? optimizer->load_own_part(at->first, at->second, *d, path)
              : optimizer->load_part(at->first, at->second, *d, path);
    return true;
  }
  return false;
}

// Every wrapped model's parameters and buffers (at ZeRO stage 3, this rank's parts of those
// `sharded` partitions); a model tensor in the checkpoint that no model has is refused.
void restore_model_tensors(const checkpoint::Contents& contents, const std::string& path, TrialContext& context,
                           const std::string& part, const ShardedOptimizers& sharded = {}) {
  const auto& models = context.models();
  // A rank's own copy: of a stage-3 optimizer's shards, with this rank's parts of its parameters.
  const bool own_parts = contents.find(part + kParameterParts + kShardOf) != nullptr;
  if (own_parts) check_shard_of(contents, part + kParameterParts, path, context, !sharded.empty());
  for (const auto& [index, optimizer] : sharded) {
    if (!own_parts && optimizer->partitions_parameters() &&
        contents.find(part + "optimizer/" + std::to_string(index) + kShardOf) != nullptr) {
      throw CheckpointError(path + " holds a rank's own shards of a ZeRO-3 optimizer without its parts of the parameters");
    }
  }
  std::set<std::string> expected;
  for (std::size_t i = 0; i < models.size(); ++i) {
    const std::string prefix = part + "model/" + std::to_string(i) + "/";
    for (auto& item : models[i]->named_parameters()) {
      if (!load_partitioned(contents, prefix + item.key(), item.value(), path, sharded, own_parts)) {
        load_into(contents, prefix + item.key(), item.value(), path);
      }
      expected.insert(prefix + item.key());
    }
    for (auto& item : models[i]->named_buffers()) {
      load_into(contents, prefix + item.key(), item.value(), path);
      expected.insert(prefix + item.key());
    }
  }
  for (const auto& d : contents.datasets) {
    if (d.name.rfind(part + "model/", 0) == 0 && expected.count(d.name) == 0) {
      throw ConfigError(path + " has " + d.name + ", which the model has not: the model changed since the "
                        "checkpoint (a different architecture or hyperparameters)");
    }
  }
  for (const auto& [index, optimizer] : sharded) {
    if (own_parts && optimizer->partitions_parameters()) optimizer->gather_persistent();
  }
}

// A model split over ranks resumes on as many parts, each rank taking its own; a pipeline on any
// number of stages.
void check_model_parts(const checkpoint::Contents& contents, const std::string& path, const TrialIdentity& identity) {
  const auto [parts, pipeline] = checkpoint::model_parts(contents, path);
  if (parts == identity.parts || (pipeline && identity.pipeline)) return;
  const auto describe = [](int n) {
    return n == 1 ? std::string("a model whole on every rank") : "a model split into " + std::to_string(n) + " parts";
  };
  throw ConfigError(path + " holds " + describe(parts) + " (model parallelism), and this run's model-parallel unit "
                    "makes " + describe(identity.parts) + ": each rank resumes its own part, so resume with the "
                    "model-parallel layout that wrote it (the number of replicas may change)");
}

// Whether the file's `part` holds exactly the tensors of this rank's models: the part it wrote.
// A stage cut to fewer layers than it had (its part then holds others too) or to more is not.
bool holds_part(const checkpoint::Contents& contents, TrialContext& context, const std::string& part) {
  const auto& models = context.models();
  std::size_t tensors = 0;
  for (std::size_t i = 0; i < models.size(); ++i) {
    const std::string prefix = part + "model/" + std::to_string(i) + "/";
    for (const auto& item : models[i]->named_parameters()) {
      if (contents.find(prefix + item.key()) == nullptr) return false;
      ++tensors;
    }
    for (const auto& item : models[i]->named_buffers()) {
      if (contents.find(prefix + item.key()) == nullptr) return false;
      ++tensors;
    }
  }
  const std::string models_prefix = part + "model/";
  const auto in_part = std::count_if(contents.datasets.begin(), contents.datasets.end(), [&](const auto& d) {
    return d.name.compare(0, models_prefix.size(), models_prefix) == 0;
  });
  return static_cast<std::size_t>(in_part) == tensors;
}

// The wrapped GradScalers' states; one the checkpoint lacks keeps its initial scale.
void restore_grad_scalers(const checkpoint::Contents& contents, const std::string& path, TrialContext& context) {
  const auto& scalers = context.scalers();
  for (std::size_t i = 0; i < scalers.size(); ++i) {
    const std::string name = "scaler/" + std::to_string(i);
    if (contents.find(name) == nullptr) {
      // Written before loss scaling was turned on: the scale starts where a new run's does.
      core::log_warning("{} has no {}: the trial wraps more GradScalers than when it was saved; that one starts "
                        "from its initial scale {}", path, name, scalers[i]->get_scale());
      continue;
    }
    try {
      scalers[i]->load_state_dict(parse(contents, name, path));
    } catch (const ConfigError& e) {
      throw CheckpointError(path + ": " + name + " is malformed: " + e.what());
    }
  }
}

}  // namespace

void check_resumable(const checkpoint::Contents& contents, const std::string& path, const TrialIdentity& identity,
                     bool allow_config_change) {
  // Written before checkpoints named their experiment: only found in the experiment's own folder.
  const std::string id = attribute(contents, "experiment_id");
  const std::string trial = attribute(contents, "trial_id");
  const bool other_experiment = !id.empty() && !identity.experiment_id.empty() && id != identity.experiment_id;
  const bool other_trial = !trial.empty() && trial != std::to_string(identity.trial_id);
  if (other_experiment || other_trial) {
    throw ConfigError(path + " belongs to experiment " + who(attribute(contents, "experiment_name"), id, trial) +
                      ", not to this one, " +
                      who(identity.experiment_name, identity.experiment_id, std::to_string(identity.trial_id)) +
                      ": a run resumes only its own checkpoints. Move that file out of the directory, or run the "
                      "experiment it belongs to");
  }
  const json hparams = parse(contents, "meta/hparams", path);
  if (hparams != identity.hparams && !allow_config_change) {
    throw ConfigError(path + " was written with other hyperparameters (" + differences(hparams, identity.hparams) +
                      "); resume with the config that wrote it, or pass --allow-config-change");
  }
  LoopState scratch;
  read_progress(contents, path, scratch);
  for (const char* text : {"callbacks", "trial_state"}) parse(contents, text, path);
}

void restore_weights(const checkpoint::Contents& contents, const std::string& path, TrialContext& context,
                     const TrialIdentity& identity, const ShardedOptimizers& sharded) {
  const auto [parts, pipeline] = checkpoint::model_parts(contents, path);
  if (pipeline && has_pipeline_module(context)) {
    restore_model_tensors(repartition_weights(contents, path, context, identity.part), path, context, identity.part);
    return;
  }
  check_model_parts(contents, path, identity);
  restore_model_tensors(contents, path, context, identity.part, sharded);
}

checkpoint::ReadOptions resume_read_options(const ShardedOptimizers& sharded, const std::string& part, bool verify) {
  checkpoint::ReadOptions options;
  const bool partitioned = std::any_of(sharded.begin(), sharded.end(),
                                       [](const auto& entry) { return entry.second->partitions_parameters(); });
  if (!partitioned) return options;
  options.leave_unread = [model = part + "model/", optimizer = part + "optimizer/"](const std::string& name) {
    return name.rfind(model, 0) == 0 || name.rfind(optimizer, 0) == 0;
  };
  options.verify_unread = verify;
  return options;
}

void mark_shard_of(checkpoint::Contents& contents, const std::string& prefix, int rank, int ranks) {
  contents.add_text(prefix + kShardOf, json{{"rank", rank}, {"ranks", ranks}}.dump());
}

void restore(const checkpoint::Contents& file, const std::string& path, TrialContext& context, Trial& trial,
             const Callbacks& callbacks, LoopState& loop, const TrialIdentity& identity, bool allow_config_change,
             const ShardedOptimizers& sharded) {
  check_resumable(file, path, identity, allow_config_change);
  check_model_parts(file, path, identity);
  // A pipeline written on another number of stages, or cut elsewhere (another partition_method):
  // this stage's layers from wherever they are.
  const auto [parts, pipeline] = checkpoint::model_parts(file, path);
  const bool elsewhere = parts != identity.parts || (pipeline && identity.pipeline && !holds_part(file, context, identity.part));
  const auto repartitioned = elsewhere ? std::optional(repartition(file, path, context, sharded, identity.part,
                                                                   identity.parts, parts))
                                       : std::nullopt;
  const checkpoint::Contents& contents = repartitioned ? *repartitioned : file;
  if (repartitioned && context.distributed().rank == 0) {
    core::log_info("resuming a pipeline of {} stages from {}, written by {} stages", identity.parts, path, parts);
  }
  const json hparams = parse(contents, "meta/hparams", path);
  if (hparams != identity.hparams) {
    core::log_warning("resuming from {} with other hyperparameters ({}), as --allow-config-change allows", path,
                      differences(hparams, identity.hparams));
  }
  restore_model_tensors(contents, path, context, identity.part, sharded);
  const auto& optimizers = context.optimizers();
  for (std::size_t i = 0; i < optimizers.size(); ++i) {
    const std::string prefix = identity.part + "optimizer/" + std::to_string(i);
    if (contents.find(prefix + "/type") == nullptr) {
      throw ConfigError(path + " has no " + prefix + ": the trial wraps more optimizers than when it was saved");
    }
    const bool shards = contents.find(prefix + kShardOf) != nullptr;
    if (shards) check_shard_of(contents, prefix, path, context, sharded.count(i) != 0);
    if (const auto it = sharded.find(i); it != sharded.end() && !shards) {
      it->second->load_whole(contents, prefix, path);
    } else {
      load_optimizer(contents, prefix, *optimizers[i], path);
    }
  }
  const auto& schedulers = context.lr_schedulers();
  for (std::size_t i = 0; i < schedulers.size(); ++i) {
    const auto& d = contents.at("scheduler/" + std::to_string(i) + "/step_count", path);
    if (d.dtype != checkpoint::DType::kInt64 || d.nbytes() != 8) throw CheckpointError(path + ": a scheduler's step count is malformed");
    std::int64_t count = 0;
    std::memcpy(&count, d.data->data(), 8);
    scheduler_step_count(*schedulers[i].scheduler) = static_cast<unsigned>(count);
  }
  restore_grad_scalers(contents, path, context);
  set_cpu_rng_state(tensor_of(contents.at("rng/cpu", path)).clone());
  // A checkpoint from a CPU run resumed on a GPU (or the reverse) has no state for it: the
  // device generator keeps its seed.
  if (context.device().is_cuda() && contents.find("rng/cuda") != nullptr) {
    set_device_rng_state(context.device(), tensor_of(contents.at("rng/cuda", path)).clone());
  }

  read_progress(contents, path, loop);

  const json callback_states = parse(contents, "callbacks", path);
  for (const auto& [name, callback] : callbacks) {
    if (callback_states.contains(name)) callback->load_state_dict(callback_states.at(name));
  }
  if (contents.find("accumulators") != nullptr) {
    try {
      context.accumulators().load_state_dict(parse(contents, "accumulators", path));
    } catch (const ConfigError& e) {
      throw CheckpointError(path + ": accumulators is malformed: " + e.what());
    }
  }
  const json trial_state = parse(contents, "trial_state", path);
  if (!trial_state.is_null()) trial.load_state(trial_state);
}

}  // namespace hpctrial::trainer::detail
