#include "state/pipeline_checkpoint.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "hpctrial/core/error.h"
#include "hpctrial/trainer/pipeline.h"
#include "parallel/zero.h"
#include "state/state_io.h"

namespace hpctrial::trainer::detail {
namespace {

using json = nlohmann::json;

constexpr const char* kParts = "model_parallel/";

std::string part_prefix(int part) { return kParts + std::to_string(part) + "/"; }

// `dataset` under another name, sharing its buffer.
void alias(checkpoint::Contents& out, const checkpoint::Dataset& dataset, std::string name) {
  checkpoint::Dataset copy = dataset;
  copy.name = std::move(name);
  out.datasets.push_back(std::move(copy));
}

// The part of a dataset under model_parallel/<k>/, and the rest of its name; nullopt for others.
std::optional<std::pair<int, std::string>> split_part(const std::string& name) {
  if (name.rfind(kParts, 0) != 0) return std::nullopt;
  const std::size_t start = std::char_traits<char>::length(kParts);
  const std::size_t slash = name.find('/', start);
  if (slash == std::string::npos || slash == start) return std::nullopt;
  try {
    return std::make_pair(std::stoi(name.substr(start, slash - start)), name.substr(slash + 1));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The pipeline layer a parameter name of a PipelineModule belongs to ("layer<i>.<name>").
std::optional<std::size_t> layer_of(const std::string& key) {
  if (key.rfind("layer", 0) != 0) return std::nullopt;
  const std::size_t dot = key.find('.');
  if (dot == std::string::npos || dot == 5) return std::nullopt;
  try {
    return static_cast<std::size_t>(std::stoul(key.substr(5, dot - 5)));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// What the file holds, by part: model tensors by "model/<m>/<name>" (the first part that has
// one), and optimizer state by (optimizer, part, index) -> its datasets.
struct FileIndex {
  std::map<std::string, const checkpoint::Dataset*> model;
  std::map<std::tuple<std::string, int, std::string>, std::vector<const checkpoint::Dataset*>> state;
};

FileIndex index_of(const checkpoint::Contents& contents) {
  FileIndex index;
  for (const auto& d : contents.datasets) {
    const auto split = split_part(d.name);
    if (!split) continue;
    const auto& [part, rest] = *split;
    if (rest.rfind("model/", 0) == 0) {
      index.model.emplace(rest, &d);
      continue;
    }
    // optimizer/<o>/state/<p>/<field>
    const std::size_t state = rest.find("/state/");
    if (rest.rfind("optimizer/", 0) != 0 || state == std::string::npos) continue;
    const std::size_t field = rest.find('/', state + 7);
    if (field == std::string::npos) continue;
    index.state[{rest.substr(0, state), part, rest.substr(state + 7, field - state - 7)}].push_back(&d);
  }
  return index;
}

// This rank's models' tensors under `part`; the file's layers checked against the pipeline's.
void take_model(const FileIndex& index, const std::string& path, TrialContext& context, const std::string& part,
                checkpoint::Contents& out) {
  const auto& models = context.models();
  for (std::size_t m = 0; m < models.size(); ++m) {
    const std::string prefix = "model/" + std::to_string(m) + "/";
    std::set<std::string> mine;
    for (const auto& item : models[m]->named_parameters()) mine.insert(item.key());
    for (const auto& item : models[m]->named_buffers()) mine.insert(item.key());
    for (const auto& key : mine) {
      const auto it = index.model.find(prefix + key);
      if (it != index.model.end()) alias(out, *it->second, part + prefix + key);
    }
    const auto* pipeline = dynamic_cast<const PipelineModuleImpl*>(models[m].get());
    if (pipeline == nullptr) continue;
    for (auto it = index.model.lower_bound(prefix); it != index.model.end() && it->first.rfind(prefix, 0) == 0; ++it) {
      const std::string key = it->first.substr(prefix.size());
      const auto layer = layer_of(key);
      const bool beyond = !layer || *layer >= pipeline->layer_count();
      const bool ours = layer && *layer >= pipeline->first_layer() && *layer < pipeline->end_layer();
      if (beyond || (ours && mine.count(key) == 0)) {
        throw ConfigError(path + " has " + it->first + ", which the pipeline of " +
                          std::to_string(pipeline->layer_count()) + " layers has not: the model changed since the "
                          "checkpoint (a different architecture or hyperparameters)");
      }
    }
  }
}

// Optimizer `o`'s type, groups and per-parameter state, as this rank's optimizer numbers them.
void take_optimizer(const checkpoint::Contents& contents, const FileIndex& index, const std::string& path,
                    TrialContext& context, std::size_t o, const ShardedOptimizer* sharded, const std::string& part,
                    int parts_in_file, checkpoint::Contents& out) {
  const std::string name = "optimizer/" + std::to_string(o);
  const checkpoint::Dataset* type = contents.find(part_prefix(0) + name + "/type");
  if (type == nullptr) return;  // restore says the trial wraps more optimizers than the file
  if (type->text() == "torch_archive") {
    throw ConfigError(path + ": " + name + " is an optimizer class that hpctrial keeps as LibTorch's own archive, "
                      "which cannot be split into another number of pipeline stages; resume with the " +
                      std::to_string(parts_in_file) + " stages that wrote it");
  }
  alias(out, *type, part + name + "/type");
  // Where each parameter's state is: its name -> (part, index in that part's optimizer).
  std::unordered_map<std::string, std::pair<int, std::size_t>> where;
  for (int k = 0; k < parts_in_file; ++k) {
    const checkpoint::Dataset* names = contents.find(part_prefix(k) + name + "/param_names");
    if (names == nullptr) {
      throw ConfigError(path + " has no " + part_prefix(k) + name + "/param_names (the names of the parameters "
                        "whose state it holds), which another number of pipeline stages needs; resume with the " +
                        std::to_string(parts_in_file) + " stages that wrote it");
    }
    const json list = json::parse(names->text());
    for (std::size_t p = 0; p < list.size(); ++p) {
      if (list[p].is_string()) where.emplace(list[p].get<std::string>(), std::make_pair(k, p));
    }
  }
  const ParameterGroups mine = parameter_groups(*context.optimizers()[o], sharded);
  json groups = json::parse(contents.at(part_prefix(0) + name + "/param_groups", path).text());
  if (!groups.is_array() || groups.size() != mine.size()) {
    throw ConfigError(path + ": " + name + " has " + std::to_string(groups.is_array() ? groups.size() : 0) +
                      " parameter groups in the checkpoint and " + std::to_string(mine.size()) +
                      " in the trial: the trial changed since the checkpoint");
  }
  const json names = parameter_names(context, mine);
  std::size_t q = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    json params = json::array();
    for (std::size_t i = 0; i < mine[g].size(); ++i, ++q) {
      params.push_back(q);
      const auto found = names[q].is_string() ? where.find(names[q].get<std::string>()) : where.end();
      if (found == where.end()) {
        throw ConfigError(path + ": no stage's " + name + " holds the state of " +
                          (names[q].is_string() ? "model/" + names[q].get<std::string>() : "parameter " + std::to_string(q)) +
                          ", a parameter of this stage's optimizer: the trial changed since the checkpoint");
      }
      const std::string from = std::to_string(found->second.second);
      const auto state = index.state.find({name, found->second.first, from});
      if (state == index.state.end()) continue;  // no state yet: it never stepped
      const std::string source = part_prefix(found->second.first) + name + "/state/" + from + "/";
      for (const auto* d : state->second) {
        alias(out, *d, part + name + "/state/" + std::to_string(q) + "/" + d->name.substr(source.size()));
      }
    }
    groups[g]["params"] = params;
  }
  out.add_text(part + name + "/param_groups", groups.dump());
}

}  // namespace

bool has_pipeline_module(const TrialContext& context) {
  return std::any_of(context.models().begin(), context.models().end(), [](const auto& model) {
    return dynamic_cast<const PipelineModuleImpl*>(model.get()) != nullptr;
  });
}

checkpoint::Contents repartition_weights(const checkpoint::Contents& contents, const std::string& path,
                                         TrialContext& context, const std::string& part) {
  checkpoint::Contents out;
  out.attributes = contents.attributes;
  take_model(index_of(contents), path, context, part, out);
  return out;
}

ParameterGroups parameter_groups(torch::optim::Optimizer& optimizer, const ShardedOptimizer* sharded) {
  if (sharded != nullptr) return sharded->parameter_groups();
  ParameterGroups out;
  for (auto& group : optimizer.param_groups()) out.push_back(group.params());
  return out;
}

json parameter_names(TrialContext& context, const ParameterGroups& groups) {
  std::unordered_map<const void*, std::string> names;
  const auto& models = context.models();
  for (std::size_t m = 0; m < models.size(); ++m) {
    for (const auto& item : models[m]->named_parameters()) {
      names.emplace(item.value().unsafeGetTensorImpl(), std::to_string(m) + "/" + item.key());
    }
  }
  json out = json::array();
  for (const auto& group : groups) {
    for (const auto& p : group) {
      const auto it = names.find(p.unsafeGetTensorImpl());
      out.push_back(it == names.end() ? json(nullptr) : json(it->second));
    }
  }
  return out;
}

checkpoint::Contents repartition(const checkpoint::Contents& contents, const std::string& path, TrialContext& context,
                                 const std::map<std::size_t, ShardedOptimizer*>& sharded, const std::string& part,
                                 int parts, int parts_in_file) {
  checkpoint::Contents out;
  out.attributes = contents.attributes;
  for (const auto& d : contents.datasets) {
    if (d.name.rfind(kParts, 0) != 0 && d.name != "meta/model_parallel") out.datasets.push_back(d);
  }
  out.add_text("meta/model_parallel", json({{"parts", parts}, {"pipeline", true}}).dump());
  const FileIndex index = index_of(contents);
  take_model(index, path, context, part, out);
  try {
    for (std::size_t o = 0; o < context.optimizers().size(); ++o) {
      const auto it = sharded.find(o);
      take_optimizer(contents, index, path, context, o, it == sharded.end() ? nullptr : it->second, part,
                     parts_in_file, out);
    }
  } catch (const json::exception& e) {
    throw CheckpointError(path + ": malformed optimizer state of a pipeline stage: " + e.what());
  }
  return out;
}

}  // namespace hpctrial::trainer::detail
