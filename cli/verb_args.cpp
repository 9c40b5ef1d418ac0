#include "verb_args.h"

#include <iostream>
#include <utility>

#include "verb.h"

namespace po = boost::program_options;

namespace hpctrial::cli {

core::ConfigSources ConfigArgs::sources() const { return sources(config_path); }

core::ConfigSources ConfigArgs::sources(const std::string& file) const {
  core::ConfigSources read{file, template_path, overrides};
  if (!scheduler.empty()) read.overrides.push_back("scheduler.type=" + scheduler);
  return read;
}

int missing_config(const std::string& verb) {
  std::cerr << "hpctrial " << verb << ": give the experiment config, e.g. 'hpctrial " << verb
            << " experiment.yaml'\n";
  return kExitUsage;
}

VerbArgs::VerbArgs(std::string usage) : usage_(std::move(usage)), options_("options") {
  options_.add_options()("help,h", "show this help");
}

po::options_description_easy_init VerbArgs::add_options() { return options_.add_options(); }

void VerbArgs::add(const po::options_description& group) { options_.add(group); }

void VerbArgs::add_config_options(ConfigArgs& config, ConfigHelp help) {
  const bool detailed = help == ConfigHelp::kDetailed;
  options_.add_options()
      ("template,t", po::value(&config.template_path)->value_name("T.yaml"),
       detailed ? "merge this template under the config (config values win, lists concatenate, maps merge)"
                : "merge this template under the config")
      ("set,s", po::value(&config.overrides)->value_name("KEY.PATH=VALUE")->composing(),
       detailed ? "override one value (repeatable); VALUE is YAML, e.g. 4, true, [a,b]"
                : "override one config value (repeatable)");
}

void VerbArgs::add_scheduler_option(ConfigArgs& config) {
  options_.add_options()("scheduler", po::value(&config.scheduler)->value_name("slurm|pbs"),
                         "the scheduler (default scheduler.type)");
}

void VerbArgs::add_config_file(ConfigArgs& config) { positional("config", &config.config_path); }

void VerbArgs::positional(const char* name, std::string* value) {
  hidden_.add_options()(name, po::value(value));
  positional_.add(name, 1);
  has_positional_ = true;
}

void VerbArgs::positional(const char* name, std::vector<std::string>* values) {
  hidden_.add_options()(name, po::value(values));
  positional_.add(name, -1);
  has_positional_ = true;
}

bool VerbArgs::parse(const std::vector<std::string>& args) {
  po::options_description all;
  po::command_line_parser parser(args);
  if (has_positional_) {
    all.add(options_).add(hidden_);
    parser.options(all).positional(positional_);
  } else {
    parser.options(options_);
  }
  po::store(parser.run(), values_);
  po::notify(values_);
  if (values_.count("help") == 0) return true;
  std::cout << usage_ << options_;
  return false;
}

bool VerbArgs::given(const char* name) const { return values_.count(name) != 0; }

}  // namespace hpctrial::cli
