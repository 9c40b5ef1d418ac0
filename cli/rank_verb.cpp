// `hpctrial _rank -- PROGRAM ARGS...`: internal, not for users. The launcher has mpirun start
// this in place of each rank; it runs the rank as its child and records how it ended
// (launcher::run_rank_parent).
#include "hpctrial/core/env.h"
#include "hpctrial/launcher/launcher.h"
#include "verb.h"

namespace hpctrial::cli {

Verb rank_verb() {
  return {"_rank", "(internal) the parent of one rank", [](const std::vector<std::string>& args) {
            std::vector<std::string> argv = args;
            if (!argv.empty() && argv.front() == "--") argv.erase(argv.begin());
            return launcher::run_rank_parent(argv, core::ProcessEnv());
          }};
}

}  // namespace hpctrial::cli
