#include "hpctrial/checkpoint/model_state.h"

#include <nlohmann/json.hpp>

#include <map>
#include <set>

#include "hpctrial/core/error.h"

namespace hpctrial::checkpoint {
namespace {

std::string part_prefix(int part) { return "model_parallel/" + std::to_string(part) + "/"; }

// The datasets below `prefix`, by the rest of their names, each name's first occurrence kept.
void take(const Contents& contents, const std::string& prefix, std::map<std::string, const Dataset*>& out) {
  for (const auto& d : contents.datasets) {
    if (d.name.compare(0, prefix.size(), prefix) == 0) out.emplace(d.name.substr(prefix.size()), &d);
  }
}

// The submodule names part `prefix` lists for `model`, added to `out`.
void take_modules(const Contents& contents, const std::string& prefix, int model, const std::string& path,
                  std::set<std::string>& out) {
  const Dataset* list = contents.find(prefix + "meta/modules/" + std::to_string(model));
  if (list == nullptr) return;
  try {
    for (const auto& name : nlohmann::json::parse(list->text())) out.insert(name.get<std::string>());
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(path + ": " + list->name + " is malformed: " + e.what());
  }
}

}  // namespace

ModelParts model_parts(const Contents& contents, const std::string& path) {
  ModelParts parts;
  const Dataset* record = contents.find("meta/model_parallel");
  if (record == nullptr) return parts;
  try {
    const auto parsed = nlohmann::json::parse(record->text());
    parts.parts = parsed.at("parts").get<int>();
    parts.pipeline = parsed.value("pipeline", false);
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(path + ": meta/model_parallel is malformed: " + e.what());
  }
  if (parts.parts < 1) throw CheckpointError(path + ": meta/model_parallel has " + std::to_string(parts.parts) + " parts");
  return parts;
}

ModelState model_state(const Contents& contents, const std::string& path, int model, std::optional<int> part) {
  const ModelParts parts = model_parts(contents, path);
  const std::string in_model = "model/" + std::to_string(model) + "/";
  std::map<std::string, const Dataset*> found;
  std::set<std::string> modules;
  if (parts.parts == 1) {
    if (part && *part != 0) {
      throw ConfigError(path + " holds its model whole, not in parts: leave out the part (--part)");
    }
    take(contents, in_model, found);
    take_modules(contents, "", model, path, modules);
  } else if (part) {
    if (*part < 0 || *part >= parts.parts) {
      throw ConfigError(path + " holds a model in " + std::to_string(parts.parts) + " parts, 0 to " +
                        std::to_string(parts.parts - 1) + "; part " + std::to_string(*part) + " is none of them");
    }
    take(contents, part_prefix(*part) + in_model, found);
    take_modules(contents, part_prefix(*part), model, path, modules);
  } else if (parts.pipeline) {
    for (int k = 0; k < parts.parts; ++k) {
      take(contents, part_prefix(k) + in_model, found);
      take_modules(contents, part_prefix(k), model, path, modules);
    }
  } else {
    throw ConfigError(path + " holds a model the trial split into " + std::to_string(parts.parts) +
                      " parts (model parallelism), which only the trial's code joins: take one part at a time "
                      "(--part 0 to " + std::to_string(parts.parts - 1) + "), or load the trial on " +
                      std::to_string(parts.parts) + " ranks (load_trial_from_checkpoint)");
  }
  if (found.empty()) {
    throw ConfigError(path + " has no model " + std::to_string(model) + (part ? " in part " + std::to_string(*part) : "") +
                      ": the trial wraps models 0 to N-1 in the order it wraps them (--model)");
  }
  ModelState out;
  out.tensors.reserve(found.size());
  for (const auto& [name, dataset] : found) out.tensors.push_back({name, dataset});
  out.modules.assign(modules.begin(), modules.end());
  return out;
}

}  // namespace hpctrial::checkpoint
