// hpctrial new-trial NAME [--engine | --pipeline]: a trial project of one's own, written from the
// stand-alone example (examples/standalone, standalone_engine or standalone_pipeline) with its
// names made NAME's.
#include <boost/program_options.hpp>

#include <cctype>
#include <filesystem>
#include <iostream>

#include "embedded_files.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "verb.h"
#include "verb_args.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace hpctrial::cli {
namespace {

constexpr const char* kUsage = R"(usage: hpctrial new-trial NAME [--engine | --pipeline] [--dir DIR]

Writes a trial project into DIR (default ./NAME): NAME.cpp (a complete trial to make your own),
CMakeLists.txt (it finds the installed hpctrial with find_package), experiment.yaml and a
README. With --engine the trial is an engine trial (DeepSpeedTrial's API: a ModelEngine with
micro-batch accumulation and ZeRO-2, configured by the experiment's engine section). With
--pipeline it is an engine trial whose model is a list of layers in pipeline stages, one a rank
(engine.pipeline; engine.train_batch runs the 1F1B schedule). NAME is a C++-friendly name: a
lower-case letter, then lower-case letters, digits and _.

examples:
  hpctrial new-trial segmenter
  hpctrial new-trial big_model --engine
  hpctrial new-trial deep_model --pipeline
  cd segmenter && cmake -S . -B build && cmake --build build && hpctrial run experiment.yaml

)";

void replace_all(std::string& text, const std::string& from, const std::string& to) {
  for (std::size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
  }
}

// segment_model -> SegmentModel
std::string camel_case(const std::string& name) {
  std::string out;
  bool upper = true;
  for (char c : name) {
    if (c == '_') {
      upper = true;
      continue;
    }
    out += upper ? static_cast<char>(std::toupper(static_cast<unsigned char>(c))) : c;
    upper = false;
  }
  return out;
}

int run_new_trial(const std::vector<std::string>& args) {
  std::string name, dir;
  VerbArgs command_line(kUsage);
  command_line.add_options()
      ("dir,d", po::value(&dir)->value_name("DIR"), "where to write the project (default ./NAME)")
      ("engine", "an engine trial (ModelEngine, ZeRO) rather than a Trial")
      ("pipeline", "an engine trial whose model is in pipeline stages (engine.pipeline)");
  command_line.positional("name", &name);
  if (!command_line.parse(args)) return kExitOk;
  if (name.empty()) throw ConfigError("hpctrial new-trial: give the trial's name, e.g. `hpctrial new-trial segmenter`");
  const bool valid = std::islower(static_cast<unsigned char>(name[0])) && name.size() <= 64 &&
                     name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") == std::string::npos;
  if (!valid) {
    throw ConfigError("hpctrial new-trial: \"" + name + "\" is not a trial name: a lower-case letter, then lower-case "
                      "letters, digits and _ (at most 64), e.g. my_model");
  }
  const bool engine = command_line.given("engine"), pipeline = command_line.given("pipeline");
  if (engine && pipeline) {
    throw ConfigError("hpctrial new-trial: --engine and --pipeline are two templates; give one (a pipeline trial "
                      "is an engine trial already)");
  }
  if (dir.empty()) dir = name;
  std::error_code ec;
  if (fs::exists(dir) && !(fs::is_directory(dir) && fs::is_empty(dir, ec))) {
    throw ConfigError("hpctrial new-trial: " + dir + " already exists and is not an empty directory; choose "
                      "another with --dir");
  }
  core::create_directories(dir, 0755);
  std::string dashed = name;
  replace_all(dashed, "_", "-");
  const EmbeddedFile* files = pipeline ? kStandalonePipelineProject : engine ? kStandaloneEngineProject : kStandaloneProject;
  const std::size_t count = pipeline ? kStandalonePipelineProject_count
                            : engine ? kStandaloneEngineProject_count
                                     : kStandaloneProject_count;
  for (std::size_t i = 0; i < count; ++i) {
    std::string file = files[i].name, text = files[i].text;
    replace_all(file, "my_trial", name);
    replace_all(text, "my_trial", name);
    replace_all(text, "MyTrial", camel_case(name));
    replace_all(text, "my-trial", dashed);
    core::write_file_atomic((fs::path(dir) / file).string(), text, 0644);
    std::cout << "wrote " << (fs::path(dir) / file).string() << "\n";
  }
  std::cout << "build and run it:\n  cd " << dir << " && cmake -S . -B build && cmake --build build"
            << " && hpctrial run experiment.yaml\n";
  return kExitOk;
}

}  // namespace

Verb new_trial_verb() {
  return {"new-trial", "write a trial project of your own (trial, CMakeLists.txt, experiment.yaml)", run_new_trial};
}

}  // namespace hpctrial::cli
