// hpctrial config validate|show: check a config, or print the effective one.
#include <boost/program_options.hpp>

#include <algorithm>
#include <iostream>

#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/files.h"
#include "hpctrial/launcher/schedulers.h"
#include "site_defaults.h"
#include "verb.h"
#include "verb_args.h"

namespace po = boost::program_options;

namespace hpctrial::cli {
namespace {

constexpr const char* kUsage = R"(usage: hpctrial config validate CONFIG.yaml [CONFIG.yaml ...] [options]
       hpctrial config show CONFIG.yaml [--output FILE] [options]

  validate  check configs completely: every problem is listed with file, line, column and
            key path; exit code 0 when all are valid, 2 otherwise
  show      print the effective config (template merged, overrides applied, defaults
            filled in) as YAML - what a run of it would use

examples:
  hpctrial config validate examples/mlp/experiment.yaml
  hpctrial config show exp.yaml --template site.yaml --set resources.slots_per_trial=8
  hpctrial config show exp.yaml --set scheduler.modules=[gcc/12,openmpi/4.1]
  hpctrial config show exp.yaml --output effective.yaml

)";

std::string summarize(const core::ExperimentConfig& c) {
  const auto& r = c.resources;
  std::string text = "name '" + c.name + "', " + std::to_string(r.slots_per_trial) +
                     (r.slots_per_trial == 1 ? " slot" : " slots") + " on " +
                     std::to_string(r.nodes()) + (r.nodes() == 1 ? " node" : " nodes") +
                     ", searcher " + std::string(core::to_string(c.searcher.name)) +
                     ", scheduler " + c.scheduler.type;
  return text;
}

int run_config(const std::vector<std::string>& args) {
  ConfigArgs config_args;
  std::string output_path;
  std::vector<std::string> positional;
  VerbArgs command_line(kUsage);
  command_line.add_config_options(config_args, ConfigHelp::kDetailed);
  command_line.add_options()
      ("output,o", po::value(&output_path)->value_name("FILE"),
       "show: write the effective config to FILE (atomically, mode 0600) instead of stdout");
  command_line.positional("positional", &positional);
  if (!command_line.parse(args)) return kExitOk;
  if (positional.empty()) {
    std::cerr << "hpctrial config: say what to do: validate or show\n"
              << "run 'hpctrial config --help' for usage\n";
    return kExitUsage;
  }
  const std::string action = positional.front();
  std::vector<std::string> files(positional.begin() + 1, positional.end());
  if (action != "validate" && action != "show") {
    std::cerr << "hpctrial config: unknown action '" << action << "'; use validate or show\n";
    return kExitUsage;
  }
  if (files.empty()) {
    std::cerr << "hpctrial config " << action << ": give the config file, e.g. 'hpctrial config "
              << action << " experiment.yaml'\n";
    return kExitUsage;
  }
  if (action == "validate" && !output_path.empty()) {
    std::cerr << "hpctrial config validate: --output belongs to 'config show'\n";
    return kExitUsage;
  }
  if (action == "show" && files.size() > 1) {
    std::cerr << "hpctrial config show: one config at a time (got " << files.size() << ")\n";
    return kExitUsage;
  }

  int exit_code = kExitOk;
  for (const auto& file : files) {
    try {
      const core::ExperimentConfig config =
          core::load_experiment_config(config_args.sources(file), site_defaults_path(), launcher::schedulers());
      if (action == "show" && !output_path.empty()) {
        core::write_file_atomic(output_path, core::to_yaml(config));
        std::cout << "wrote the effective config of " << file << " to " << output_path << "\n";
      } else if (action == "show") {
        std::cout << core::to_yaml(config);
      } else {
        std::cout << file << ": valid (" << summarize(config) << ")\n";
      }
    } catch (const ConfigError& e) {
      const std::string text = e.what();
      const std::size_t count = 1 + static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n'));
      std::cerr << text << "\n"
                << file << ": " << count << (count == 1 ? " error" : " errors")
                << "; see docs/config-reference.md\n";
      exit_code = kExitUsage;
    }
  }
  return exit_code;
}

}  // namespace

Verb config_verb() {
  return {"config", "validate a config, or show the effective config (templates, --set, defaults)",
          run_config};
}

}  // namespace hpctrial::cli
