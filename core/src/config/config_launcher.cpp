// The reader of the experiment schema's launcher section: how the ranks are started (mpirun or
// srun, their arguments), the hang watch and the startup hook.
#include "config_schema.h"

#include <utility>

#include "hpctrial/core/text.h"

namespace hpctrial::core::detail {

void read_launcher(MapReader& r, LauncherConfig& l) {
  Diagnostics& d = r.diagnostics();
  if (const ConfigNode* n = r.get("mpi")) {
    const auto v = read_string(*n, r.path("mpi"), d);
    if (v && *v == mpi_name(LauncherConfig::Mpi::kMpirun)) {
      l.mpi = LauncherConfig::Mpi::kMpirun;
    } else if (v && *v == mpi_name(LauncherConfig::Mpi::kSrun)) {
      l.mpi = LauncherConfig::Mpi::kSrun;
    } else if (v) {
      report(*n, r.path("mpi"), d, "is \"" + *v + "\"; write mpirun (Open MPI's, the default) or srun (Slurm's, "
                                   "with PMIx, inside a Slurm job)");
    }
  }
  for (auto [key, target] : {std::pair{"prefix", &l.prefix}, std::pair{"mpirun_args", &l.mpirun_args},
                             std::pair{"srun_args", &l.srun_args}}) {
    const ConfigNode* n = r.get(key);
    if (n == nullptr) continue;
    if (auto list = read_string_list(*n, r.path(key), d)) {
      for (std::size_t i = 0; i < list->size(); ++i) {
        if ((*list)[i].empty() || (*list)[i].find_first_of(std::string("\0\n", 2)) != std::string::npos) {
          report(n->items()[i], r.path(key) + "[" + std::to_string(i) + "]", d,
                 "must be a non-empty argument without newlines, got " + describe(n->items()[i]));
        } else {
          target->push_back((*list)[i]);
        }
      }
    }
  }
  if (const ConfigNode* n = r.get("hang_timeout")) {
    if (auto v = read_duration(*n, r.path("hang_timeout"), d, 1, kMaxCollectiveTimeout)) l.hang_timeout_seconds = *v;
  }
  read_startup_hook(r, l);
  r.finish();
}

void read_startup_hook(MapReader& r, LauncherConfig& l) {
  const ConfigNode* n = r.get("startup_hook");
  if (n == nullptr) return;
  Diagnostics& d = r.diagnostics();
  if (n->is_scalar()) {
    const auto command = read_string(*n, r.path("startup_hook"), d);
    if (command && trim(*command).empty()) {
      report(*n, r.path("startup_hook"), d, "is empty; give a shell command, e.g. `startup_hook: ./setup.sh`");
    } else if (command) {
      l.startup_hook = {"/bin/sh", "-c", *command};
    }
    return;
  }
  if (auto list = read_string_list(*n, r.path("startup_hook"), d)) {
    if (list->empty() || list->front().empty()) {
      report(*n, r.path("startup_hook"), d, "names no program; give a command, e.g. [./setup.sh, --quiet]");
    } else {
      l.startup_hook = *list;
    }
  }
}

}  // namespace hpctrial::core::detail
