// Trials in shared libraries: the second way to run a trial, besides HPCTRIAL_MAIN.
//
// In the library's source, export the trials it holds - one of:
//
//   HPCTRIAL_EXPORT_TRIAL(ns::MyTrial)            // a library of one trial
//
//   HPCTRIAL_EXPORT_TRIALS(registry) {            // several
//     registry.add<ns::MyTrial>("ns::MyTrial");
//     registry.add<OtherTrial>("OtherTrial");
//   }
//
// and name it in the experiment config: `entrypoint: ./libmodel.so:ns::MyTrial`. The worker
// program, `hpctrial-worker --config exp.yaml`, loads the library (a relative path is relative
// to the working directory), checks that it was built against the same hpctrial, and runs the
// trial exactly as HPCTRIAL_MAIN would.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hpctrial/build_config.h"
#include "hpctrial/trainer/engine_trial.h"
#include "hpctrial/trainer/training_loop.h"

namespace hpctrial::trainer {

class TrialRegistry {
 public:
  template <typename TrialClass>
  void add(const std::string& name) {
    factories_[name] = [](TrialContext& context) { return make_any_trial<TrialClass>(context); };
  }
  const TrialFactory* find(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::map<std::string, TrialFactory> factories_;
};

// Loads `library` and returns the factory of `trial_class`. Throws ConfigError naming the
// library and what to do: it does not load, exports no trials, was built against another
// hpctrial, or has no such trial (the message lists the ones it has). The library stays loaded
// for the life of the process.
TrialFactory load_trial_library(const std::string& library, const std::string& trial_class);

// main() of hpctrial-worker: like HPCTRIAL_MAIN, with the trial taken from the config's
// `entrypoint: LIBRARY.so:TrialClass`.
int run_worker(int argc, char** argv);

}  // namespace hpctrial::trainer

#define HPCTRIAL_EXPORT_TRIALS(registry)                                                         \
  extern "C" __attribute__((visibility("default"))) const char* hpctrial_trial_library_version() { \
    return HPCTRIAL_VERSION;                                                                     \
  }                                                                                              \
  extern "C" __attribute__((visibility("default"))) void hpctrial_register_trials(               \
      ::hpctrial::trainer::TrialRegistry& registry)

#define HPCTRIAL_EXPORT_TRIAL(TrialClass) \
  HPCTRIAL_EXPORT_TRIALS(registry) { registry.add<TrialClass>(#TrialClass); }
