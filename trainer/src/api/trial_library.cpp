#include "hpctrial/trainer/trial_library.h"

#include <dlfcn.h>

#include <filesystem>

#include "hpctrial/core/error.h"
#include "hpctrial/core/paths.h"

namespace hpctrial::trainer {

const TrialFactory* TrialRegistry::find(const std::string& name) const {
  const auto it = factories_.find(name);
  return it == factories_.end() ? nullptr : &it->second;
}

std::vector<std::string> TrialRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& [name, factory] : factories_) out.push_back(name);
  return out;
}

TrialFactory load_trial_library(const std::string& library, const std::string& trial_class) {
  const std::filesystem::path path =
      core::resolve_user_path(library, std::filesystem::current_path(), "entrypoint");
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* reason = ::dlerror();
    throw ConfigError("entrypoint: cannot load the trial library " + path.string() + ": " +
                      (reason != nullptr ? reason : "unknown reason") +
                      " (a relative path is relative to the working directory)");
  }
  using Version = const char* (*)();
  using Register = void (*)(TrialRegistry&);
  auto version = reinterpret_cast<Version>(::dlsym(handle, "hpctrial_trial_library_version"));
  auto register_trials = reinterpret_cast<Register>(::dlsym(handle, "hpctrial_register_trials"));
  if (version == nullptr || register_trials == nullptr) {
    throw ConfigError("entrypoint: " + path.string() + " exports no trials; add "
                      "HPCTRIAL_EXPORT_TRIAL(" + trial_class + ") to its source");
  }
  if (std::string(version()) != HPCTRIAL_VERSION) {
    throw ConfigError("entrypoint: " + path.string() + " was built against hpctrial " + version() +
                      " but this worker is hpctrial " + HPCTRIAL_VERSION + "; rebuild the library");
  }
  TrialRegistry registry;
  register_trials(registry);
  const TrialFactory* factory = registry.find(trial_class);
  if (factory == nullptr) {
    std::string names;
    for (const auto& name : registry.names()) names += (names.empty() ? "" : ", ") + name;
    throw ConfigError("entrypoint: " + path.string() + " has no trial '" + trial_class + "' (it has: " +
                      (names.empty() ? "none" : names) + ")");
  }
  // The library stays loaded: the factory's code lives in it.
  return *factory;
}

}  // namespace hpctrial::trainer
