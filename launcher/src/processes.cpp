#include "processes.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <cstdlib>
#include <set>
#include <sstream>
#include <string>

#include "hpctrial/core/error.h"

extern char** environ;

namespace hpctrial::launcher::detail {

// Every process below the launcher (ranks orphaned by a dead mpirun come to it: it is their
// subreaper), from /proc.
std::vector<pid_t> descendants() {
  std::map<pid_t, std::vector<pid_t>> children;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return {};
  while (const dirent* entry = ::readdir(d)) {
    const pid_t pid = static_cast<pid_t>(std::atoi(entry->d_name));
    if (pid <= 0) continue;
    std::ifstream in(std::string("/proc/") + entry->d_name + "/stat");
    std::string stat;
    if (!std::getline(in, stat)) continue;
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state;
    pid_t ppid;
    if (rest >> state >> ppid) children[ppid].push_back(pid);
  }
  ::closedir(d);
  std::vector<pid_t> out;
  std::vector<pid_t> unvisited = {::getpid()};
  while (!unvisited.empty()) {
    const pid_t p = unvisited.back();
    unvisited.pop_back();
    for (pid_t c : children[p]) {
      out.push_back(c);
      unvisited.push_back(c);
    }
  }
  return out;
}

// Reaps every ended child; mpirun's status goes to `mpirun_status` when it is among them.
void reap(pid_t mpirun, std::optional<int>* mpirun_status) {
  for (int status = 0;;) {
    const pid_t ended = ::waitpid(-1, &status, WNOHANG);
    if (ended <= 0) return;
    if (ended == mpirun && mpirun_status != nullptr) *mpirun_status = status;
  }
}

// SIGKILL to mpirun's process group and every process below the launcher; reaps them.
void kill_everything(pid_t mpirun, std::optional<int>* mpirun_status) {
  if (mpirun > 0) ::kill(-mpirun, SIGKILL);
  for (int round = 0; round < 3; ++round) {
    const auto left = descendants();
    if (left.empty()) break;
    for (pid_t p : left) ::kill(p, SIGKILL);
    ::usleep(20000);
    reap(mpirun, mpirun_status);
  }
  reap(mpirun, mpirun_status);
}

// mpirun's children on this host (each the parent of one rank) by rank, from the rank number
// Open MPI gives them in their environment.
std::map<int, pid_t> rank_processes(pid_t mpirun) {
  std::map<int, pid_t> out;
  for (pid_t pid : descendants()) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string text;
    if (!std::getline(stat, text) || text.rfind(')') == std::string::npos) continue;
    std::istringstream rest(text.substr(text.rfind(')') + 2));
    char state;
    pid_t ppid = 0;
    if (!(rest >> state >> ppid) || ppid != mpirun) continue;
    std::ifstream environ_file("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
    for (std::string entry; std::getline(environ_file, entry, '\0');) {
      if (entry.rfind("OMPI_COMM_WORLD_RANK=", 0) == 0) {
        try {
          out[std::stoi(entry.substr(21))] = pid;
        } catch (const std::exception&) {
        }
      }
    }
  }
  return out;
}

// SIGKILL to every process below the launcher except mpirun: once a rank has failed, the
// others are stuck in collectives, and mpirun would give them the whole grace
// (odls_base_sigkill_timeout) before it kills them. mpirun then reports the failure and exits.
void kill_ranks(pid_t mpirun) {
  for (pid_t p : descendants()) {
    if (p != mpirun) ::kill(p, SIGKILL);
  }
}

core::Child spawn_mpirun(const MpirunCommand& command) {
  core::SpawnOptions options;
  options.env_set = command.env;
  options.working_dir = command.working_dir;
  options.die_with_parent = true;  // its ranks notice within seconds and end
  try {
    return core::spawn_process(command.argv, options);
  } catch (const IoError& e) {
    throw IoError(std::string(e.what()) + "; install Open MPI (scripts/install-deps.sh) or set HPCTRIAL_MPIRUN");
  }
}

}  // namespace hpctrial::launcher::detail
