// The experiment schema: every key, its type, default and limits. docs/config-reference.md
// documents the same keys; a test checks that the two agree.
#include "hpctrial/core/experiment_config.h"

#include <fmt/core.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <functional>
#include <regex>
#include <tuple>

#include "config_schema.h"
#include "config_values.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/paths.h"

namespace hpctrial::core {

using namespace detail;  // the schema's pieces (config_schema.h)

namespace {

// The name is a directory (runs/<name>, a folder in checkpoint_storage.host_path) and a job
// name: one path component of a portable set, never "." or "..", never an option's look.
std::string experiment_name_problem(const std::string& name) {
  if (name.empty()) return "";  // read_string reports it
  const auto bad = std::find_if(name.begin(), name.end(), [](unsigned char c) {
    return !(std::isalnum(c) || c == '.' || c == '_' || c == '-' || c == '+');
  });
  const std::string rule = "; it names the experiment's directory, so use letters, digits and . _ - +, "
                           "starting with a letter or digit (e.g. mnist-cnn)";
  if (bad != name.end()) {
    const unsigned char c = static_cast<unsigned char>(*bad);
    const std::string shown = c == ' ' ? "a space" : c == '/' ? "'/'" : std::isprint(c) ? "'" + std::string(1, *bad) + "'"
                                                                                        : "a character outside ASCII";
    return "\"" + name + "\" holds " + shown + rule;
  }
  if (!std::isalnum(static_cast<unsigned char>(name.front()))) return "\"" + name + "\" starts with '" + name.substr(0, 1) + "'" + rule;
  return "";
}

void read_name(MapReader& top, ExperimentConfig& config, Diagnostics& d) {
  if (const ConfigNode* n = top.require("name", "name: mnist-cnn")) {
    if (auto v = read_string(*n, "name", d)) {
      if (v->size() > kMaxNameLength) {
        report(*n, "name", d, "is " + std::to_string(v->size()) + " characters; keep it to " +
                                   std::to_string(kMaxNameLength));
      } else if (const std::string why = experiment_name_problem(*v); !why.empty()) {
        report(*n, "name", d, why);
      } else {
        config.name = *v;
      }
    }
  }
}

// description, entrypoint, hyperparameters and searcher: what the trial is and how it is searched.
void read_trial_keys(MapReader& top, ExperimentConfig& config, Diagnostics& d) {
  if (const ConfigNode* n = top.get("description")) {
    if (auto v = read_string(*n, "description", d, true)) config.description = *v;
  }
  if (const ConfigNode* n = top.require("entrypoint", "entrypoint: ./my_trial")) {
    if (auto v = read_entrypoint(*n, "entrypoint", d)) config.entrypoint = *v;
  }
  if (const ConfigNode* n = top.get("hyperparameters")) {
    if (!n->is_null() && detail::expect_map(*n, "hyperparameters", d, "hyperparameters: {lr: 0.01}")) {
      config.hyperparameters = read_hyperparameters(*n, "hyperparameters", d, 0);
    }
  }
  if (const ConfigNode* n = top.get("inference"); n != nullptr && !n->is_null()) {
    read_inference(top, *n, config);  // in place of a searcher
    return;
  }
  const ConfigNode* n = top.require(
      "searcher", "searcher: {name: single, metric: validation_loss, max_length: {batches: 1000}}");
  if (n != nullptr && detail::expect_map(*n, "searcher", d,
                                         "searcher: {name: single, metric: validation_loss, "
                                         "max_length: {batches: 1000}}")) {
    MapReader r(n, "searcher", d);
    read_searcher(r, config.searcher);
  }
}

// records_per_epoch, min_validation_period and min_checkpoint_period.
void read_periods(MapReader& top, ExperimentConfig& config, Diagnostics& d) {
  if (const ConfigNode* n = top.get("records_per_epoch")) {
    if (auto v = read_int(*n, "records_per_epoch", d, 1, kMaxLength)) config.records_per_epoch = *v;
  }
  const std::vector<LengthUnit> period_units = {LengthUnit::kBatches, LengthUnit::kEpochs,
                                                LengthUnit::kRecords, LengthUnit::kSeconds};
  if (const ConfigNode* n = top.get("min_validation_period")) {
    config.min_validation_period = read_length(*n, "min_validation_period", d, period_units);
  }
  if (const ConfigNode* n = top.get("min_checkpoint_period")) {
    if (n->is_scalar() && (n->text() == "auto" || n->text() == "none")) {
      config.auto_checkpoint_period = n->text() == "auto";
    } else {
      config.auto_checkpoint_period = false;
      config.min_checkpoint_period = read_length(*n, "min_checkpoint_period", d, period_units);
    }
  }
}

// The map-valued sections, from resources to scheduler; an absent or null section keeps its defaults.
void read_sections(MapReader& top, ExperimentConfig& config, Diagnostics& d) {
  struct Section {
    const char* key;
    const char* example;
    std::function<void(MapReader&)> read;
  };
  const Section sections[] = {
      {"resources", "resources: {slots_per_trial: 4}",
       [&](MapReader& r) { read_resources(r, config.resources); }},
      {"optimizations", "optimizations: {aggregation_frequency: 2}",
       [&](MapReader& r) { read_optimizations(r, config.optimizations); }},
      {"engine", "engine: {train_micro_batch_size_per_gpu: 8, zero_optimization: {stage: 2}}",
       [&](MapReader& r) {
         config.engine.emplace();
         read_engine(r, *config.engine);
       }},
      {"reproducibility", "reproducibility: {experiment_seed: 42}",
       [&](MapReader& r) {
         if (const ConfigNode* n = r.get("experiment_seed")) {
           if (auto v = read_int(*n, r.path("experiment_seed"), d, 0, 4294967295LL)) {
             config.reproducibility.experiment_seed = static_cast<std::uint32_t>(*v);
           }
         }
         r.finish();
       }},
      {"checkpoint_storage", "checkpoint_storage: {host_path: /scratch/me/checkpoints}",
       [&](MapReader& r) { read_checkpoint_storage(r, config.checkpoint_storage); }},
      {"checkpoint_levels", "checkpoint_levels: {memory: {period: {batches: 10}}}",
       [&](MapReader& r) { read_checkpoint_levels(r, config.checkpoint_levels); }},
      {"profiling", "profiling: {enabled: true, begin_on_batch: 20, end_after_batch: 24}",
       [&](MapReader& r) { read_profiling(r, config.profiling); }},
      {"launcher", "launcher: {prefix: [numactl, --interleave=all]}",
       [&](MapReader& r) { read_launcher(r, config.launcher); }},
      {"scheduler", "scheduler: {type: slurm, partition: gpu, time_limit: 4h}",
       [&](MapReader& r) { read_scheduler(r, config.scheduler); }},
  };
  for (const auto& section : sections) {
    const ConfigNode* n = top.get(section.key);
    if (n == nullptr || n->is_null()) continue;
    if (!detail::expect_map(*n, section.key, d, section.example)) continue;
    MapReader r(n, section.key, d);
    section.read(r);
  }
}

// data.stage: node_local, shm, an absolute directory, or {to: ..., keys: [...]}.
void read_data_stage(const ConfigNode& node, DataStage& stage, Diagnostics& d) {
  const std::string example = "data.stage: node_local, or data.stage: {to: /dev/shm, keys: [train, validation]}";
  const ConfigNode* to = &node;
  if (node.is_map()) {
    MapReader r(&node, "data.stage", d);
    to = r.get("to");
    if (const ConfigNode* keys = r.get("keys")) {
      if (auto v = read_string_list(*keys, "data.stage.keys", d)) stage.keys = *v;
    }
    r.finish();
    if (to == nullptr) {
      stage.to = DataStage::To::kNodeLocal;
      return;
    }
  }
  const std::string path = node.is_map() ? "data.stage.to" : "data.stage";
  const auto text = read_string(*to, path, d);
  if (!text) return;
  if (*text == "node_local") {
    stage.to = DataStage::To::kNodeLocal;
  } else if (*text == "shm") {
    stage.to = DataStage::To::kShm;
  } else if (!text->empty() && text->front() == '/') {
    try {
      stage.path = resolve_user_path(*text, "/", path).string();
      stage.to = DataStage::To::kPath;
    } catch (const ConfigError& e) {
      report(*to, path, d, std::string(e.what()).substr(path.size() + 2));
    }
  } else {
    report(*to, path, d, "is \"" + *text + "\"; write node_local (the node's $TMPDIR, else /tmp), shm (/dev/shm) or "
                         "an absolute directory present on every node (variables are not expanded here), e.g. " +
                         example);
  }
}

// environment.bind's entry: HOST[:CONTAINER[:ro|rw]], each path absolute; stored normalised.
std::optional<std::string> read_bind(const ConfigNode& node, const std::string& path, Diagnostics& d) {
  const auto text = read_string(node, path, d);
  if (!text) return std::nullopt;
  std::vector<std::string> parts;
  for (std::size_t at = 0;;) {
    const auto colon = text->find(':', at);
    parts.push_back(text->substr(at, colon == std::string::npos ? std::string::npos : colon - at));
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  const bool has_mode = parts.size() == 3;
  if (parts.size() > 3 || (has_mode && parts[2] != "ro" && parts[2] != "rw")) {
    report(node, path, d, "is \"" + *text + "\"; write HOST, HOST:CONTAINER or HOST:CONTAINER:ro (or :rw), "
                          "absolute paths without ':' in them, e.g. /scratch/me/data:/data:ro");
    return std::nullopt;
  }
  std::string out;
  for (std::size_t i = 0; i < std::min<std::size_t>(parts.size(), 2); ++i) {
    if (parts[i].empty() || parts[i].front() != '/') {
      report(node, path, d, std::string(i == 0 ? "the host path" : "the container path") + " \"" + parts[i] +
                                "\" is not absolute; write e.g. /scratch/me/data:/data:ro");
      return std::nullopt;
    }
    try {
      out += (i == 0 ? "" : ":") + resolve_user_path(parts[i], "/", path).string();
    } catch (const ConfigError& e) {
      report(node, path, d, std::string(e.what()).substr(path.size() + 2));
      return std::nullopt;
    }
  }
  if (parts.size() == 1) out += ":" + out;
  if (has_mode) out += ":" + parts[2];
  return out;
}

// environment.image, environment.container_runtime and environment.bind.
void read_container(const ConfigNode* environment, LauncherConfig::Mpi mpi, Container& c, Diagnostics& d) {
  if (environment == nullptr || !environment->is_map()) return;
  const ConfigNode* image = environment->find("image");
  const ConfigNode* runtime = environment->find("container_runtime");
  const ConfigNode* bind = environment->find("bind");
  if (image != nullptr) {
    if (auto v = read_string(*image, "environment.image", d)) c.image = *v;
  }
  if (runtime != nullptr) {
    const auto v = read_string(*runtime, "environment.container_runtime", d);
    using R = Container::Runtime;
    for (R r : {R::kPodman, R::kApptainer, R::kSingularity, R::kEnroot}) {
      if (v && *v == runtime_name(r)) c.runtime = r;
    }
    if (v && c.runtime == R::kNone) {
      report(*runtime, "environment.container_runtime", d,
             "is \"" + *v + "\"; write podman, apptainer, singularity or enroot");
    } else if (c.runtime == R::kEnroot && mpi != LauncherConfig::Mpi::kSrun) {
      report(*runtime, "environment.container_runtime", d,
             "is enroot, whose containers Slurm's pyxis plugin starts for srun (--container-image); set "
             "launcher.mpi: srun");
    }
  }
  if (bind != nullptr && !bind->is_null()) {
    if (!bind->is_sequence()) {
      report(*bind, "environment.bind", d, "must be a list of mounts, e.g. [/scratch/me/data:/data:ro]");
    } else {
      for (std::size_t i = 0; i < bind->items().size(); ++i) {
        if (auto v = read_bind(bind->items()[i], "environment.bind[" + std::to_string(i) + "]", d)) c.binds.push_back(*v);
      }
    }
  }
  if (!c.image.empty() && c.runtime == Container::Runtime::kNone && runtime == nullptr) {
    report(*image, "environment.image", d, "needs environment.container_runtime: podman, apptainer, singularity or enroot "
                                           "(the program that runs the image on the nodes)");
  }
  if (c.image.empty() && image == nullptr && (runtime != nullptr || bind != nullptr)) {
    report(runtime != nullptr ? *runtime : *bind, runtime != nullptr ? "environment.container_runtime" : "environment.bind",
           d, "has no image to run; set environment.image (podman: a name such as localhost/mine:1; apptainer: "
              "a .sif file or docker://...)");
  }
}

// scheduling_unit, max_restarts, data and environment.
void read_run_keys(MapReader& top, ExperimentConfig& config, Diagnostics& d) {
  if (const ConfigNode* n = top.get("scheduling_unit")) {
    if (auto v = read_int(*n, "scheduling_unit", d, 1, kMaxLength)) config.scheduling_unit = *v;
  }
  if (const ConfigNode* n = top.get("max_restarts")) {
    if (auto v = read_int(*n, "max_restarts", d, 0, kMaxRestarts)) config.max_restarts = static_cast<int>(*v);
  }
  detail::read_path(top, "context", config.context);
  if (const ConfigNode* n = top.get("data")) {
    if (n->is_null()) {
      config.data = ConfigNode::map(n->where());
    } else if (detail::expect_map(*n, "data", d, "data: {url: /scratch/me/mnist}")) {
      config.data = *n;
      if (const ConfigNode* stage = n->find("stage"); stage != nullptr && !stage->is_null()) {
        read_data_stage(*stage, config.stage, d);
        for (const auto& key : config.stage.keys) {
          const ConfigNode* value = n->find(key);
          if (key == "stage" || value == nullptr || !value->is_scalar()) {
            report(*stage, "data.stage.keys", d, "names \"" + key + "\", which is not a key of data holding a path; "
                                                  "list the keys whose values are the files or folders to stage");
          }
        }
      }
    }
  }
  const ConfigNode* environment = top.get("environment");
  config.environment = read_environment(environment, "environment", d, {"image", "container_runtime", "bind"});
  read_container(environment, config.launcher.mpi, config.container, d);
}

}  // namespace

std::string mpi_name(LauncherConfig::Mpi mpi) { return mpi == LauncherConfig::Mpi::kSrun ? "srun" : "mpirun"; }

std::string runtime_name(Container::Runtime runtime) {
  switch (runtime) {
    case Container::Runtime::kPodman: return "podman";
    case Container::Runtime::kApptainer: return "apptainer";
    case Container::Runtime::kSingularity: return "singularity";
    case Container::Runtime::kEnroot: return "enroot";
    case Container::Runtime::kNone: break;
  }
  return "";
}

ExperimentConfig parse_experiment_config(const ConfigNode& written, Diagnostics& d,
                                         const std::vector<std::string>& scheduler_sections) {
  const ConfigNode root = detail::from_reference_keys(written, scheduler_sections, d);
  ExperimentConfig config;
  if (!root.is_map()) {
    d.error(root.where(), "",
            root.is_null() ? "is empty; an experiment config needs at least name, entrypoint "
                             "and searcher (see docs/config-reference.md)"
                           : "must be a map of keys (name:, entrypoint:, ...), got " + root.kind_name());
    return config;
  }
  MapReader top(&root, "", d);
  read_name(top, config, d);
  read_trial_keys(top, config, d);
  read_periods(top, config, d);
  read_sections(top, config, d);
  read_run_keys(top, config, d);
  top.finish();

  check_hyperparameters(config, root, d);
  check_engine(config, root, d);
  check_adaptive_batch(config, root, d);
  return config;
}

std::optional<EngineBatch> resolve_engine_batch(const EngineConfig& engine, std::optional<std::int64_t> global_batch_size,
                                                int ranks, std::string& error) {
  if (ranks < 1) {
    error = "needs at least one rank";
    return std::nullopt;
  }
  return detail::resolve_engine_batch_sizes(engine, global_batch_size, ranks, error);
}

std::optional<int> engine_replicas(const EngineConfig& engine, int ranks, std::string& error) {
  const int stages = engine.pipeline.stages;
  if (stages < 1 || ranks % stages != 0) {
    error = "pipeline.stages (" + std::to_string(stages) + ") does not divide the " + std::to_string(ranks) +
            " ranks into data-parallel replicas of a whole pipeline; make the ranks a multiple of the stages";
    return std::nullopt;
  }
  return ranks / stages;
}

ExperimentConfig load_experiment_config(const ConfigSources& sources) { return load_experiment_config(sources, ""); }

namespace {

ExperimentConfig load(const ConfigSources& sources, const std::string& site_path, const ConfigCheck& check) {
  Diagnostics d;
  ConfigNode root = load_config_file(sources.config_path, d);
  // Under the config: the template, then the site's defaults under both.
  for (const auto& [path, what] : {std::pair<std::string, const char*>{sources.template_path, "a template"},
                                   std::pair<std::string, const char*>{site_path, "a site's defaults file"}}) {
    if (path.empty()) continue;
    ConfigNode layer = load_config_file(path, d);
    if (!layer.is_null() && !layer.is_map()) {
      d.error(layer.where(), "", std::string(what) + " must be a map of keys, got " + layer.kind_name());
    }
    if (d.empty()) root = merge_template(layer, root);
  }
  for (const auto& assignment : sources.overrides) apply_override(root, assignment, d);
  // Problems with the YAML itself come first; the schema is only checked on a readable tree.
  d.throw_if_any();
  ExperimentConfig config = parse_experiment_config(root, d, sources.scheduler_sections);
  config.source_path = sources.config_path;
  if (check) check(config, d);
  d.sort();
  d.throw_if_any();
  return config;
}

}  // namespace

ExperimentConfig load_experiment_config(const ConfigSources& sources, const std::string& site_path) {
  return load(sources, site_path, {});
}

ExperimentConfig load_experiment_config(const ConfigSources& sources, const std::string& site_path,
                                        const ConfigCheck& check) {
  return load(sources, site_path, check);
}

std::string SchedulerConfig::option(const std::string& key) const {
  for (const ConfigEntry& entry : options) {
    if (entry.key == key) return entry.value.is_scalar() ? entry.value.text() : std::string();
  }
  return {};
}

}  // namespace hpctrial::core
