// A verb of the `hpctrial` command: `hpctrial VERB ...`.
//
// Verbs are registered in one explicit function, builtin_verbs(); each lives in its own file.
// A verb's run() gets the arguments after the verb and returns the process exit code;
// it may throw hpctrial::Error, which main() turns into a message and an exit code.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace hpctrial::cli {

// Exit codes shared by every verb.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;  // bad command line or bad config, like argparse

struct Verb {
  std::string name;
  std::string summary;  // one line for `hpctrial --help`
  std::function<int(const std::vector<std::string>& args)> run;
};

std::vector<Verb> builtin_verbs();

// The verbs, one per file.
Verb config_verb();
Verb checkpoint_verb();
Verb experiment_verb();
Verb run_verb();
Verb launch_verb();
Verb submit_verb();
Verb pause_verb();
Verb activate_verb();
Verb cancel_verb();
Verb kill_verb();
Verb jobs_verb();
Verb job_verb();
Verb logs_verb();
Verb describe_verb();
Verb report_verb();
Verb plot_verb();
Verb new_trial_verb();
Verb rank_verb();  // internal: the parent of each rank, which mpirun starts

// "hpctrial 0.1.0 (git abc123)" and what it was built with.
std::string version_text();

}  // namespace hpctrial::cli
