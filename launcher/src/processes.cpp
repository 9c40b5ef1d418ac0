#include "processes.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
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

namespace {

pid_t parent_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat) || stat.rfind(')') == std::string::npos) return 0;
  std::istringstream rest(stat.substr(stat.rfind(')') + 2));
  char state;
  pid_t ppid = 0;
  return rest >> state >> ppid ? ppid : 0;
}

// The rank number in one process's environment (`rank_name`=N), when its environment also holds
// `entry` exactly; -1 otherwise (or when it cannot be read: another user's process).
int rank_with(pid_t pid, const std::string& entry, const std::string& rank_name) {
  std::ifstream environ_file("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  bool marked = entry.empty();
  int rank = -1;
  const std::string prefix = rank_name + "=";
  for (std::string item; std::getline(environ_file, item, '\0');) {
    if (item == entry) marked = true;
    if (item.compare(0, prefix.size(), prefix) == 0) {
      try {
        rank = std::stoi(item.substr(prefix.size()));
      } catch (const std::exception&) {
      }
    }
  }
  return marked ? rank : -1;
}

// The processes of this host, outside the launcher's tree, whose environment holds `entry` and
// a PMIx rank: an srun step's tasks and what they started, by pid with their rank.
std::map<pid_t, int> tasks_with(const std::string& entry) {
  const auto below = descendants();
  const std::set<pid_t> mine(below.begin(), below.end());
  std::map<pid_t, int> out;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return out;
  while (const dirent* item = ::readdir(d)) {
    const pid_t pid = static_cast<pid_t>(std::atoi(item->d_name));
    if (pid <= 0 || pid == ::getpid() || mine.count(pid) != 0) continue;
    if (const int rank = rank_with(pid, entry, "PMIX_RANK"); rank >= 0) out[pid] = rank;
  }
  ::closedir(d);
  return out;
}

void kill_tasks(const std::string& entry) {
  if (entry.empty()) return;
  for (int round = 0; round < 50; ++round) {
    const auto left = tasks_with(entry);
    if (left.empty()) return;
    for (const auto& [pid, rank] : left) ::kill(pid, SIGKILL);
    ::usleep(20000);
  }
}

}  // namespace

// Reaps every ended child; mpirun's status goes to `mpirun_status` when it is among them.
void reap(pid_t mpirun, std::optional<int>* mpirun_status) {
  for (int status = 0;;) {
    const pid_t ended = ::waitpid(-1, &status, WNOHANG);
    if (ended <= 0) return;
    if (ended == mpirun && mpirun_status != nullptr) *mpirun_status = status;
  }
}

// SIGKILL to mpirun's process group and every process below the launcher, and to srun's tasks
// on this host; reaps them. (srun killed, Slurm ends its step's tasks on every node.)
void kill_everything(pid_t mpirun, std::optional<int>* mpirun_status, const std::string& tasks) {
  kill_tasks(tasks);
  if (mpirun > 0) ::kill(-mpirun, SIGKILL);
  for (int round = 0; round < 3; ++round) {
    const auto left = descendants();
    if (left.empty()) break;
    for (pid_t p : left) ::kill(p, SIGKILL);
    ::usleep(20000);
    reap(mpirun, mpirun_status);
  }
  reap(mpirun, mpirun_status);
  kill_tasks(tasks);
  if (mpirun > 0 && mpirun_status != nullptr && mpirun_status->has_value()) remove_session_dir(mpirun);
}

std::string session_dir(pid_t mpirun) {
  std::string tmp = "/tmp";
  for (const char* name : {"OMPI_MCA_orte_tmpdir_base", "TMPDIR", "TEMP", "TMP"}) {
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0') {
      tmp = value;
      break;
    }
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::string node = host;
  node = node.substr(0, node.find('.'));
  return tmp + "/ompi." + node + "." + std::to_string(::getuid()) + "/pid." + std::to_string(mpirun);
}

void remove_session_dir(pid_t mpirun) {
  std::error_code ignored;
  std::filesystem::remove_all(session_dir(mpirun), ignored);
}

namespace {

// When process `pid` started, in seconds since the epoch (to about a second: the boot time is
// whole seconds); nullopt when there is no such process or it is a zombie (it has ended).
std::optional<double> start_of_live_process(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  const std::string line((std::istreambuf_iterator<char>(stat)), {});
  const auto close = line.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  // After "<pid> (<command>) ": state (field 3) ... starttime (field 22), in clock ticks since boot.
  std::istringstream fields(line.substr(close + 1));
  std::string field, state;
  fields >> state;
  if (state == "Z" || state == "X") return std::nullopt;
  for (int i = 4; i <= 22 && fields >> field; ++i) {}
  std::ifstream boot("/proc/stat");
  for (std::string key; boot >> key;) {
    if (key != "btime") continue;
    double btime = 0;
    boot >> btime;
    return btime + std::strtod(field.c_str(), nullptr) / static_cast<double>(::sysconf(_SC_CLK_TCK));
  }
  return std::nullopt;
}

}  // namespace

void remove_stale_session_dirs() {
  const std::filesystem::path mine = std::filesystem::path(session_dir(0)).parent_path();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(mine, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("pid.", 0) != 0) continue;
    const pid_t pid = static_cast<pid_t>(std::atoll(name.c_str() + 4));
    struct stat dir {};
    if (pid <= 0 || ::stat(entry.path().c_str(), &dir) != 0) continue;
    // The directory belongs to the Open MPI process of that number while it lives: an mpirun, a
    // singleton's orted, a DVM. Stale once the process is gone, or once the number is another
    // process's: one started after the directory last changed (its owner changes it while it
    // runs). The margin covers the boot time's whole seconds; a number reused sooner keeps its
    // directory until the process that has it ends.
    const auto started = start_of_live_process(pid);
    if (!started || *started > static_cast<double>(dir.st_mtime) + 2.0) std::filesystem::remove_all(entry.path(), ec);
  }
}

// mpirun's children on this host (each the parent of one rank) by rank, from the rank number
// Open MPI gives them in their environment.
// Under srun, the step's tasks of this host: each the topmost of the processes marked as the
// attempt's (its parent is slurmstepd).
std::map<int, pid_t> rank_processes(pid_t mpirun, const std::string& tasks) {
  std::map<int, pid_t> out;
  if (!tasks.empty()) {
    const auto marked = tasks_with(tasks);
    for (const auto& [pid, rank] : marked) {
      if (marked.count(parent_of(pid)) == 0) out[rank] = pid;
    }
    return out;
  }
  for (pid_t pid : descendants()) {
    if (parent_of(pid) != mpirun) continue;
    if (const int rank = rank_with(pid, "", "OMPI_COMM_WORLD_RANK"); rank >= 0) out[rank] = pid;
  }
  return out;
}

// SIGKILL to every process below the launcher except mpirun: once a rank has failed, the
// others are stuck in collectives, and mpirun would give them the whole grace
// (odls_base_sigkill_timeout) before it kills them. mpirun then reports the failure and exits.
// Under srun, to the step's tasks of this host: srun then reports them and exits.
void kill_ranks(pid_t mpirun, const std::string& tasks) {
  if (!tasks.empty()) {
    kill_tasks(tasks);
    return;
  }
  for (pid_t p : descendants()) {
    if (p != mpirun) ::kill(p, SIGKILL);
  }
}

core::Child spawn_mpirun(const MpirunCommand& command) {
  remove_stale_session_dirs();
  core::SpawnOptions options;
  options.env_set = command.env;
  options.working_dir = command.working_dir;
  options.die_with_parent = true;  // its ranks notice within seconds and end
  try {
    return core::spawn_process(command.argv, options);
  } catch (const IoError& e) {
    throw IoError(std::string(e.what()) + (command.srun ? "; launcher.mpi is srun: run inside a Slurm job on a node "
                                                          "with Slurm's commands on its PATH"
                                                        : "; install Open MPI (scripts/install-deps.sh) or set "
                                                          "HPCTRIAL_MPIRUN"));
  }
}

}  // namespace hpctrial::launcher::detail
