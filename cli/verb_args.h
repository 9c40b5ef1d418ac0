// A verb's command line, read with Boost.Program_options: --help, the verb's options in the order
// --help lists them, its positional arguments, and the options that name the experiment config a
// verb reads (the file, --template, --set, --scheduler), which `run`, `submit` and `config` share.
#pragma once

#include <boost/program_options.hpp>

#include <string>
#include <vector>

#include "hpctrial/core/experiment_config.h"

namespace hpctrial::cli {

// Where the experiment config a verb reads comes from, as the command line gave it.
struct ConfigArgs {
  std::string config_path;             // the positional EXP.yaml; empty: not given
  std::string template_path;           // --template; empty: none
  std::vector<std::string> overrides;  // --set, in the order given
  std::string scheduler;               // --scheduler; empty: the config's scheduler.type

  // The sources of config_path: --template, then --set's overrides followed by
  // scheduler.type=SCHEDULER when --scheduler was given.
  core::ConfigSources sources() const;
  // The same for another config file (`hpctrial config` reads several with one --template and --set).
  core::ConfigSources sources(const std::string& file) const;
};

// How --template and --set describe themselves in --help: briefly, or with how the template
// merges and what a value may be (`hpctrial config`, whose output shows the result).
enum class ConfigHelp { kBrief, kDetailed };

// Says on stderr that `hpctrial VERB` needs the experiment config, with an example; returns
// kExitUsage.
int missing_config(const std::string& verb);

// One verb's command line. --help comes first in the "options" list, then the options in the
// order they are added; positional arguments are hidden from it. The variables the options fill
// are the caller's and must outlive parse(). Not thread-safe; parse once.
class VerbArgs {
 public:
  // `usage`: what --help prints before the list of options.
  explicit VerbArgs(std::string usage);

  // The verb's own options, listed after those added before.
  boost::program_options::options_description_easy_init add_options();
  // A group of options, listed after the others under its own caption.
  void add(const boost::program_options::options_description& group);
  // --template T.yaml and --set KEY.PATH=VALUE (repeatable), read into `config`.
  void add_config_options(ConfigArgs& config, ConfigHelp help = ConfigHelp::kBrief);
  // --scheduler slurm|pbs, read into config.scheduler.
  void add_scheduler_option(ConfigArgs& config);
  // The one positional argument, EXP.yaml, read into config.config_path.
  void add_config_file(ConfigArgs& config);
  // The positional arguments under the hidden option `name`: one into `value`, or every one
  // into `values`. Without any, positional arguments are ignored.
  void positional(const char* name, std::string* value);
  void positional(const char* name, std::vector<std::string>* values);

  // Reads `args` and stores each option's value where it was declared to go. False when --help
  // was given: the usage and the options are printed on stdout and the verb has nothing more to
  // do. Throws boost::program_options::error for a command line it cannot read.
  bool parse(const std::vector<std::string>& args);

  // Whether the option `name` (its long name) was given; after parse().
  bool given(const char* name) const;
  const boost::program_options::variables_map& values() const { return values_; }

 private:
  std::string usage_;
  boost::program_options::options_description options_;
  boost::program_options::options_description hidden_;
  boost::program_options::positional_options_description positional_;
  bool has_positional_ = false;
  boost::program_options::variables_map values_;
};

}  // namespace hpctrial::cli
