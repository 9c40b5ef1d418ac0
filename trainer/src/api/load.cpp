// load_trial_from_checkpoint: the trial built outside any launcher from what its checkpoint
// carries, and its weights loaded (state/checkpointing.h: restore_weights).
#include "hpctrial/trainer/load.h"

#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <numeric>
#include <sstream>

#include "api/config_json.h"
#include "api/engine_access.h"
#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/model_state.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/comm/communicator.h"
#include "hpctrial/core/config_node.h"
#include "hpctrial/core/diagnostics.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/search.h"
#include "hpctrial/trainer/engine_trial.h"
#include "hpctrial/trainer/random.h"
#include "loop/loop.h"
#include "state/checkpointing.h"
#include "state/state_io.h"

namespace hpctrial::trainer {
namespace {

using json = nlohmann::json;

std::string text_of(const checkpoint::Contents& contents, const char* name, const std::string& path) {
  return contents.at(name, path).text();
}

// The config the checkpoint was written with, the overrides applied.
core::ExperimentConfig config_of(const checkpoint::Contents& contents, const std::string& path,
                                 const std::vector<std::string>& overrides) {
  core::Diagnostics d;
  core::ConfigNode root = core::parse_config_text(text_of(contents, "meta/config", path), path + ":meta/config", d);
  for (const auto& assignment : overrides) {
    if (assignment.rfind("hyperparameters", 0) == 0) {
      throw ConfigError("override '" + assignment + "': a loaded trial's hyperparameters are the checkpoint's, "
                        "which shape its model; train another trial to change them");
    }
    core::apply_override(root, assignment, d);
  }
  d.throw_if_any();
  core::ExperimentConfig config = core::parse_experiment_config(root, d);
  d.throw_if_any();
  return config;
}

// A pipeline's stages as the loading ranks can hold them: the written number when it divides the
// ranks, else the largest that does (one process: one stage of every layer).
void fit_pipeline(core::ExperimentConfig& config, int ranks, bool chief) {
  if (!config.engine || config.engine->pipeline.stages <= 1) return;
  auto& pipeline = config.engine->pipeline;
  if (ranks % pipeline.stages == 0) return;
  const int stages = std::gcd(ranks, pipeline.stages);
  if (chief) {
    core::log_info("loading a pipeline of {} stages on {} rank(s) as {} stage(s)", pipeline.stages, ranks, stages);
  }
  pipeline.stages = stages;
  pipeline.as_one_stage = stages == 1;
  if (pipeline.partition_method == "explicit") {
    pipeline.partition_method = "parameters";
    pipeline.bounds.clear();
  }
}

std::int64_t batches_of(const checkpoint::Contents& contents, const std::string& path) {
  try {
    return json::parse(text_of(contents, "progress", path)).at("batches").get<std::int64_t>();
  } catch (const json::exception& e) {
    throw CheckpointError(path + ": progress is malformed: " + e.what());
  }
}

}  // namespace

LoadedTrial::LoadedTrial() = default;
LoadedTrial::LoadedTrial(LoadedTrial&&) noexcept = default;
LoadedTrial& LoadedTrial::operator=(LoadedTrial&&) noexcept = default;
LoadedTrial::~LoadedTrial() {
  trial_.reset();  // before its context
  context_.reset();
}

namespace {
detail::EngineTrialRunner& runner_of(Trial& trial, const std::string& path) {
  auto* runner = dynamic_cast<detail::EngineTrialRunner*>(&trial);
  if (runner == nullptr) {
    throw ConfigError(path + " was loaded into a Trial, not an EngineTrial: use trial<YourTrial>() and context()");
  }
  return *runner;
}
}  // namespace

EngineTrial& LoadedTrial::engine_trial() const { return runner_of(*trial_, path_).engine_trial(); }
EngineTrialContext& LoadedTrial::engine_context() const { return runner_of(*trial_, path_).engine_context(); }

LoadedTrial load_trial_from_checkpoint(const std::string& path, const TrialFactory& factory, const LoadOptions& options) {
  LoadedTrial loaded;
  if (options.communicator == nullptr) loaded.alone_ = std::make_unique<comm::LocalCommunicator>();
  comm::Communicator& comm = options.communicator != nullptr ? *options.communicator : *loaded.alone_;
  const checkpoint::CheckpointStore::Loaded file = detail::load_chosen_checkpoint(path, comm);
  const checkpoint::Contents& contents = file.contents;
  loaded.path_ = file.path;
  loaded.batches_trained_ = batches_of(contents, loaded.path_);
  loaded.config_ = std::make_unique<core::ExperimentConfig>(config_of(contents, loaded.path_, options.overrides));
  core::ExperimentConfig& config = *loaded.config_;
  fit_pipeline(config, comm.size(), comm.is_chief());
  json hparams;
  try {
    hparams = json::parse(text_of(contents, "meta/hparams", loaded.path_));
  } catch (const json::exception& e) {
    throw CheckpointError(loaded.path_ + ": meta/hparams is malformed: " + e.what());
  }
  const auto trial_attribute = contents.attributes.find("trial_id");
  const int trial_id = trial_attribute == contents.attributes.end() ? 0 : std::stoi(trial_attribute->second);

  // The seeds of the run that wrote it: whatever the trial draws while it is built draws alike.
  const std::uint64_t trial_seed =
      derive_seed(config.reproducibility.experiment_seed.value_or(0), static_cast<std::uint64_t>(trial_id));
  torch::manual_seed(derive_seed(trial_seed, detail::kTorchSeedStream));
  TrialSettings settings = detail::trial_settings(config, comm, hparams, trial_seed);
  settings.distributed = {comm.rank(), comm.size(), options.local_rank >= 0 ? options.local_rank : 0,
                          options.local_size >= 1 ? options.local_size : 1, 1};
  settings.trial_id = trial_id;
  loaded.context_ = std::make_unique<TrialContext>(std::move(settings), comm, options.device_communicator);
  loaded.trial_ = factory(*loaded.context_);
  if (!loaded.trial_) throw ConfigError("the trial factory returned no trial");

  const detail::ModelLayout layout = detail::agree_on_model_layout(comm, config, loaded.context_->mpu());
  detail::TrialIdentity identity;
  identity.hparams = hparams;
  identity.trial_id = trial_id;
  identity.world_size = comm.size();
  identity.parts = layout.parts;
  identity.part = layout.part;
  identity.pipeline = layout.pipeline;
  // At ZeRO stage 3 each rank takes its parts of the parameters (the whole on one process).
  detail::restore_weights(contents, loaded.path_, *loaded.context_, identity,
                          detail::sharded_optimizers(*loaded.trial_, *loaded.context_));
  // At ZeRO stage 3 the models whole, for the caller's own forward, as before a global batch (a
  // model of layers gathers each layer as it runs).
  if (auto* runner = dynamic_cast<detail::EngineTrialRunner*>(loaded.trial_.get())) {
    runner->engine_context().gather_parameters();
  }
  for (const auto& model : loaded.context_->models()) model->eval();
  if (comm.is_chief()) {
    core::log_info("loaded {} (trial {}, {} batches trained) on {} rank(s)", loaded.path_, trial_id,
                   loaded.batches_trained_, comm.size());
  }
  return loaded;
}

std::unique_ptr<TrialContext> TrialContext::from_config(const std::string& config_path,
                                                       const std::vector<std::string>& overrides, int trial_id) {
  const core::ExperimentConfig config =
      core::trial_config(core::load_experiment_config({config_path, "", overrides}), trial_id);
  auto alone = std::make_unique<comm::LocalCommunicator>();
  const std::uint64_t trial_seed =
      derive_seed(config.reproducibility.experiment_seed.value_or(0), static_cast<std::uint64_t>(trial_id));
  torch::manual_seed(derive_seed(trial_seed, detail::kTorchSeedStream));
  TrialSettings settings = detail::trial_settings(config, *alone, detail::trial_hparams(config), trial_seed);
  settings.distributed = {0, 1, 0, 1, 1};
  settings.trial_id = trial_id;
  auto context = std::make_unique<TrialContext>(std::move(settings), *alone);
  context->owned_communicator_ = std::move(alone);
  return context;
}

std::unique_ptr<EngineTrialContext> EngineTrialContext::from_config(const std::string& config_path,
                                                                   const std::vector<std::string>& overrides,
                                                                   int trial_id) {
  std::unique_ptr<TrialContext> context = TrialContext::from_config(config_path, overrides, trial_id);
  auto engine = std::make_unique<EngineTrialContext>(*context);
  engine->owned_context_ = std::move(context);
  return engine;
}

namespace {

// A module's tensors and submodules, by their names below it.
struct ModuleTree {
  std::map<std::string, torch::Tensor> tensors;
  std::map<std::string, ModuleTree> children;
};

ModuleTree& node_at(ModuleTree& root, const std::string& dotted) {
  ModuleTree* node = &root;
  std::size_t start = 0;
  for (std::size_t dot = dotted.find('.'); dot != std::string::npos; dot = dotted.find('.', start)) {
    node = &node->children[dotted.substr(start, dot - start)];
    start = dot + 1;
  }
  return node->children[dotted.substr(start)];
}

// A nested archive per module ("fc1.weight": "weight" of the archive "fc1"), every submodule
// one, as torch::load(module, ...) reads them.
void write_nested(torch::serialize::OutputArchive& archive, const ModuleTree& tree) {
  for (const auto& [name, tensor] : tree.tensors) archive.write(name, tensor, /*is_buffer=*/!tensor.is_floating_point());
  for (const auto& [child, below] : tree.children) {
    torch::serialize::OutputArchive nested;
    write_nested(nested, below);
    archive.write(child, nested);
  }
}

}  // namespace

std::size_t export_model(const std::string& path, const std::string& out, int model, std::optional<int> part) {
  const checkpoint::CheckpointStore::Loaded loaded = checkpoint::load_checkpoint_at(path);
  const checkpoint::ModelState state = checkpoint::model_state(loaded.contents, loaded.path, model, part);
  ModuleTree root;
  for (const auto& name : state.modules) node_at(root, name);
  for (const auto& item : state.tensors) {
    const auto dot = item.name.rfind('.');
    ModuleTree& owner = dot == std::string::npos ? root : node_at(root, item.name.substr(0, dot));
    owner.tensors.emplace(dot == std::string::npos ? item.name : item.name.substr(dot + 1),
                          detail::tensor_of(*item.dataset));
  }
  torch::serialize::OutputArchive archive;
  write_nested(archive, root);
  std::ostringstream bytes;
  archive.save_to(bytes);
  core::write_file_atomic(out, bytes.str());
  return state.tensors.size();
}

}  // namespace hpctrial::trainer
