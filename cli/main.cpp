// hpctrial: the command users type. `hpctrial VERB --help` describes each verb.
#include <boost/program_options/errors.hpp>

#include <iostream>
#include <string>
#include <vector>

#include "hpctrial/core/diagnostics.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/build_config.h"
#include "verb.h"

namespace {

void print_help(const std::vector<hpctrial::cli::Verb>& verbs) {
  std::cout << "usage: hpctrial [--version] [--help] VERB [ARGS]\n       hpctrial help VERB\n\n"
               "Run LibTorch trials on HPC batch schedulers: configs, checkpoints, pause and "
               "resume.\n\nverbs:\n";
  for (const auto& verb : verbs) {
    if (verb.name.front() == '_') continue;  // internal: started by hpctrial itself
    std::cout << "  " << verb.name << std::string(verb.name.size() < 10 ? 10 - verb.name.size() : 1, ' ')
              << verb.summary << "\n";
  }
  std::cout << "\nexamples:\n"
               "  hpctrial config validate experiment.yaml\n"
               "  hpctrial config show experiment.yaml --set resources.slots_per_trial=4\n\n"
               "Run 'hpctrial help VERB' (or 'hpctrial VERB --help') for a verb's options, 'man hpctrial-VERB'\n"
               "for its page. Set HPCTRIAL_LOG_LEVEL=debug for more detail.\n";
}

}  // namespace

int main(int argc, char** argv) {
  using namespace hpctrial;
  core::init_logging(core::ProcessEnv());
  const std::vector<cli::Verb> verbs = cli::builtin_verbs();
  std::vector<std::string> args(argv + 1, argv + argc);

  if (args.empty() || args[0] == "--help" || args[0] == "-h" || (args[0] == "help" && args.size() == 1)) {
    print_help(verbs);
    return args.empty() ? cli::kExitUsage : cli::kExitOk;
  }
  if (args[0] == "help") {
    // `hpctrial help VERB [ACTION]` is `hpctrial VERB [ACTION] --help`.
    args.erase(args.begin());
    args.push_back("--help");
  }
  if (args[0] == "--version" || args[0] == "-V") {
    std::cout << cli::version_text();
    return cli::kExitOk;
  }
  const std::string name = args[0];
  for (const auto& verb : verbs) {
    if (verb.name != name) continue;
    try {
      return verb.run(std::vector<std::string>(args.begin() + 1, args.end()));
    } catch (const boost::program_options::error& e) {
      std::cerr << "hpctrial " << name << ": " << e.what() << "\nrun 'hpctrial " << name
                << " --help' for usage\n";
      return cli::kExitUsage;
    } catch (const ConfigError& e) {
      std::cerr << e.what() << "\n";
      return cli::kExitUsage;
    } catch (const Error& e) {
      std::cerr << "hpctrial " << name << ": " << e.what() << "\n";
      return cli::kExitFailure;
    } catch (const std::exception& e) {
      // Not one of ours: a library's error (a file of the wrong shape, memory). One line all
      // the same, never a core dump.
      std::cerr << "hpctrial " << name << ": " << e.what() << "\n";
      return cli::kExitFailure;
    }
  }
  if (!HPCTRIAL_WITH_PLOT && name == "plot") {
    std::cerr << "hpctrial: this hpctrial was built without PLplot (-DHPCTRIAL_PLOT=OFF) and has no 'plot' verb; "
                 "TensorBoard draws every trial's metrics: tensorboard --logdir EXPDIR\n";
    return cli::kExitUsage;
  }
  std::vector<std::string> names;
  for (const auto& verb : verbs) names.push_back(verb.name);
  std::cerr << "hpctrial: unknown verb '" << name << "'";
  const std::string suggestion = core::closest_match(name, names);
  if (!suggestion.empty()) std::cerr << "; did you mean '" << suggestion << "'?";
  std::cerr << "\nrun 'hpctrial --help' for the list of verbs\n";
  return cli::kExitUsage;
}
