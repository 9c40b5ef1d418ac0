// hpctrial experiment repair: an experiment's record of its identity (experiment.json) rebuilt
// from what its checkpoints and its search log record, where the record was lost or damaged.
#include <boost/program_options.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/layout.h"
#include "verb.h"
#include "verb_args.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace hpctrial::cli {
namespace {

constexpr const char* kUsage = R"(usage: hpctrial experiment repair DIR [--id ID]

Rebuilds the record of an experiment's identity, DIR/experiment.json, when it is missing,
damaged, or names no experiment: hpctrial refuses to run such an experiment rather than start
it anew. The identity (the id and name every checkpoint carries) is read from the experiment's
checkpoints (DIR/trial-N/checkpoints, or its folders in checkpoint_storage.host_path) and its
search log. Where they name more than one experiment, --id chooses. The next `hpctrial run` or
`hpctrial submit` of the experiment resumes from its latest checkpoint.

)";

struct Found {
  std::string name;
  std::string host_folder;
  std::set<std::string> where;  // the checkpoint folders that name it
};

// Each checkpoint file of `dir` that names an experiment, recorded under its id.
void read_checkpoints(const fs::path& dir, const std::string& host_folder, std::map<std::string, Found>& found) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (!checkpoint::checkpoint_batches(entry.path().filename().string())) continue;
    std::map<std::string, std::string> attributes;
    try {
      attributes = checkpoint::read_summary(entry.path().string()).attributes;
    } catch (const Error&) {
      continue;  // a file cut short: another one says the same
    }
    const std::string id = attributes["experiment_id"];
    if (id.empty()) continue;
    Found& f = found[id];
    f.name = attributes["experiment_name"];
    f.host_folder = host_folder.empty() ? core::experiment_folder(f.name, id) : host_folder;
    f.where.insert(dir.string());
  }
}

// The experiment id the search log's first line names; empty where there is no log.
std::string search_log_id(const core::ExperimentLayout& layout) {
  std::ifstream in(layout.search_log());
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  try {
    const auto first = nlohmann::json::parse(line);
    return first.is_object() ? first.value("experiment_id", std::string()) : std::string();
  } catch (const nlohmann::json::exception&) {
    return "";
  }
}

int repair(const std::string& dir, const std::string& chosen) {
  const core::ExperimentLayout layout{fs::absolute(dir).lexically_normal().string()};
  if (!fs::exists(layout.config())) {
    throw ConfigError(layout.dir + " is not an experiment directory: there is no " + layout.config());
  }
  const core::ExperimentConfig config = core::load_experiment_config({layout.config(), "", {}});
  std::optional<core::ExperimentIdentity> current;
  try {
    current = core::experiment_identity(layout);
  } catch (const IoError&) {
    // lost or damaged: rebuilt below
  }
  if (current && !current->host_folder.empty() && (chosen.empty() || chosen == current->id)) {
    std::cout << layout.state() << " records experiment " << current->name << " (" << current->id
              << "); nothing to repair\n";
    return kExitOk;
  }
  if (current && chosen.empty()) {
    // Made before experiments had folders: its folder is named now, its checkpoints moved there by hand.
    const core::ExperimentIdentity named{current->id, current->name, core::experiment_folder(current->name, current->id)};
    core::restore_experiment_identity(layout, named);
    std::cout << layout.state() << " records experiment " << named.name << " (" << named.id << ") with its folder "
              << named.host_folder << (config.checkpoint_storage.host_path.empty() ? "" : " in " +
                                       config.checkpoint_storage.host_path)
              << "\nrun or submit the experiment again to resume it from its latest checkpoint there\n";
    return kExitOk;
  }
  std::map<std::string, Found> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(layout.dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (core::TrialLayout::trial_of(name)) {
      read_checkpoints(core::TrialLayout{entry.path().string()}.default_checkpoint_dir(), "", found);
    }
  }
  const std::string& host_path = config.checkpoint_storage.host_path;
  if (!host_path.empty()) {
    // The experiment's folder is "<name>-<id>": only folders of its name are read.
    const std::string prefix = core::experiment_folder(config.name, "");
    for (const auto& folder : fs::directory_iterator(host_path, ec)) {
      const std::string name = folder.path().filename().string();
      if (name.rfind(prefix, 0) != 0 || !folder.is_directory(ec)) continue;
      for (const auto& trial : fs::directory_iterator(folder.path(), ec)) {
        if (core::TrialLayout::trial_of(trial.path().filename().string())) read_checkpoints(trial.path(), name, found);
      }
    }
  }
  // A checkpoint of another experiment of the same name in the same host_path names itself so:
  // its folder is not "<its name>-<its id>".
  for (auto it = found.begin(); it != found.end();) {
    it = it->second.host_folder == core::experiment_folder(it->second.name, it->first) ? std::next(it) : found.erase(it);
  }
  std::string id = chosen;
  const std::string logged = search_log_id(layout);
  if (id.empty() && !logged.empty()) id = logged;
  if (id.empty() && found.size() == 1) id = found.begin()->first;
  if (id.empty()) {
    if (found.empty()) {
      throw Error("no checkpoint of " + layout.dir + (host_path.empty() ? "" : " or of " + host_path) +
                  " names an experiment, and it has no search log: there is nothing to rebuild its identity from. "
                  "Give the id its checkpoints were written with (--id), or start a new experiment in another "
                  "directory");
    }
    std::string list;
    for (const auto& [each, f] : found) list += "\n  " + each + " (" + f.name + "), in " + *f.where.begin();
    throw Error("the checkpoints found name " + std::to_string(found.size()) + " experiments:" + list +
                "\ngive the one of " + layout.dir + " with --id");
  }
  const auto it = found.find(id);
  if (it == found.end() && logged != id) {
    throw Error("no checkpoint of " + layout.dir + " names experiment " + id + ", nor does its search log");
  }
  core::ExperimentIdentity identity{id, it != found.end() ? it->second.name : config.name,
                                    it != found.end() ? it->second.host_folder : core::experiment_folder(config.name, id)};
  const core::ExperimentIdentity recorded = core::restore_experiment_identity(layout, identity);
  std::cout << layout.state() << " records experiment " << recorded.name << " (" << recorded.id << ")";
  if (it != found.end()) std::cout << ", named by the checkpoints in " << *it->second.where.begin();
  std::cout << "\nrun or submit the experiment again to resume it from its latest checkpoint\n";
  return kExitOk;
}

int run_experiment(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << kUsage;
    return args.empty() ? kExitUsage : kExitOk;
  }
  if (args[0] != "repair") {
    std::cerr << "hpctrial experiment: unknown action '" << args[0] << "'; use repair\n";
    return kExitUsage;
  }
  std::string dir, id;
  VerbArgs command_line(kUsage);
  command_line.add_options()("id", po::value(&id)->value_name("ID"), "the experiment id to record");
  command_line.positional("dir", &dir);
  if (!command_line.parse({args.begin() + 1, args.end()})) return kExitOk;
  if (dir.empty()) {
    std::cerr << "hpctrial experiment repair: give the experiment directory\n";
    return kExitUsage;
  }
  return repair(dir, id);
}

}  // namespace

Verb experiment_verb() {
  return {"experiment", "repair an experiment's record of its identity from its checkpoints", run_experiment};
}

}  // namespace hpctrial::cli
