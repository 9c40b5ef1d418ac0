// The parent of each rank: mpirun starts `hpctrial _rank -- PROGRAM ARGS...` in place of the
// rank, which starts the rank, forwards it the signals mpirun and the scheduler send, and waits
// for it. Only a parent learns how a child ended when nothing in the child could say it (a
// SIGKILL, the OOM killer, _exit()): it records that end in the rank's heartbeat record when the
// rank recorded none itself, and then ends the same way, so that mpirun sees what it always saw.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include "hpctrial/core/error.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/layout.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/launcher/launcher.h"
#include "container.h"
#include "launcher_internal.h"

namespace hpctrial::launcher {
namespace {

volatile sig_atomic_t g_child = 0;
constexpr int kForwarded[] = {SIGUSR1, SIGUSR2, SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGALRM, SIGCONT};

extern "C" void forward(int signal) {
  if (g_child > 0) ::kill(static_cast<pid_t>(g_child), signal);
}

// This rank's number, as the MPI launcher gave it.
std::optional<int> rank_from(const core::EnvSource& env) {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    if (const auto value = env.get(name)) {
      try {
        return std::stoi(*value);
      } catch (const std::exception&) {
      }
    }
  }
  return std::nullopt;
}

// The variables torch.distributed and torchrun's users read (RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE), from Open MPI's under mpirun, from Slurm's under srun; none that the
// launcher cannot tell. MASTER_ADDR and MASTER_PORT come from the launcher, the same for all.
std::vector<std::pair<std::string, std::string>> torch_variables(const core::EnvSource& env) {
  const auto first = [&](std::initializer_list<const char*> names) -> std::optional<std::string> {
    for (const char* name : names) {
      if (const auto value = env.get(name); value && !value->empty()) return value;
    }
    return std::nullopt;
  };
  std::vector<std::pair<std::string, std::string>> out;
  const auto put = [&](const char* name, const std::optional<std::string>& value) {
    if (value) out.emplace_back(name, *value);
  };
  put("RANK", first({"OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMIX_RANK"}));
  put("LOCAL_RANK", first({"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"}));
  put("WORLD_SIZE", first({"OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"}));
  auto local_size = first({"OMPI_COMM_WORLD_LOCAL_SIZE"});
  if (!local_size) {
    // srun: this node's count in SLURM_STEP_TASKS_PER_NODE ("2(x3),1": counts, each repeated).
    const auto per_node = first({"SLURM_STEP_TASKS_PER_NODE"});
    const auto node = first({"SLURM_NODEID"});
    if (per_node && node) local_size = detail::tasks_on_node(*per_node, std::atoi(node->c_str()));
  }
  put("LOCAL_WORLD_SIZE", local_size);
  return out;
}

void record_end(const std::string& path, int status) {
  std::ifstream in(path, std::ios::binary);
  std::string page((std::istreambuf_iterator<char>(in)), {});
  const auto record = core::heartbeat_decode(page);
  if (!record || record->end) return;  // none yet, or the rank said it itself
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  const long long ms = static_cast<long long>(now.tv_sec) * 1000 + now.tv_nsec / 1000000;
  const bool signalled = WIFSIGNALED(status);
  core::heartbeat_put_end(page.data(), {signalled ? core::RankEnd::Kind::kSignal : core::RankEnd::Kind::kExit,
                                        signalled ? WTERMSIG(status) : WEXITSTATUS(status), ms});
  const core::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (fd.get() >= 0) (void)!::pwrite(fd.get(), page.data(), core::kHeartbeatSize, 0);
}

}  // namespace

namespace detail {

std::optional<std::string> tasks_on_node(const std::string& per_node, int node) {
  std::stringstream items(per_node);
  int first = 0;  // the first node the item covers
  for (std::string item; std::getline(items, item, ',');) {
    int count = 0, repeat = 1;
    char close = 0;
    const int read = std::sscanf(item.c_str(), "%d(x%d%c", &count, &repeat, &close);
    if (read < 1 || (read > 1 && (read != 3 || close != ')')) || count < 0 || repeat < 1) return std::nullopt;
    if (node >= first && node < first + repeat) return std::to_string(count);
    first += repeat;
  }
  return std::nullopt;
}

}  // namespace detail

int run_rank_parent(const std::vector<std::string>& argv, const core::EnvSource& env) {
  if (argv.empty()) {
    std::fprintf(stderr, "hpctrial _rank: no program to run (hpctrial _rank -- PROGRAM ARGS...)\n");
    return core::kExitConfig;
  }
  sigset_t forwarded, previous;
  sigemptyset(&forwarded);
  for (int s : kForwarded) sigaddset(&forwarded, s);
  ::sigprocmask(SIG_BLOCK, &forwarded, &previous);  // none is lost before the child exists
  // Records how the rank ended in its heartbeat record, where it recorded nothing itself. Not
  // when the launcher ended the attempt (its abort file exists): then this end is the
  // launcher's doing, not the rank's failure.
  const auto record = [&](int status) {
    const auto rank = rank_from(env);
    const auto dir = env.get(core::kEnvHeartbeatDir);
    const auto abort_file = env.get(core::kEnvAbortFile);
    const bool ended_by_launcher = abort_file && !abort_file->empty() && ::access(abort_file->c_str(), F_OK) == 0;
    if (rank && dir && !dir->empty() && !ended_by_launcher) {
      record_end(core::TrialLayout::heartbeat_file(*dir, *rank), status);
    }
  };
  core::SpawnOptions options;
  options.capture_output = false;     // the rank's output is mpirun's, as if it ran alone
  options.own_process_group = false;  // mpirun's signals to the group reach it
  options.die_with_parent = true;
  // A warning forwarded before the rank installed its handlers (it loads its libraries and
  // starts MPI first: seconds on a busy node) would kill it; held, it reaches the handler.
  options.blocked_signals = {SIGUSR1, SIGUSR2};
  options.env_set = torch_variables(env);
  pid_t child = -1;
  try {
    child = core::spawn_process(argv, options).pid;
  } catch (const Error& e) {
    std::fprintf(stderr, "hpctrial _rank: %s\n", e.what());
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    record(W_EXITCODE(127, 0));
    return 127;
  }
  g_child = child;
  struct sigaction action {};
  action.sa_handler = forward;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int s : kForwarded) ::sigaction(s, &action, nullptr);
  ::sigprocmask(SIG_SETMASK, &previous, nullptr);

  int status = 0;
  while (::waitpid(child, &status, 0) < 0) {
    if (errno != EINTR) return core::kExitFailed;
  }
  g_child = 0;
  // In a container, the runtime's 128 + N is the rank's death by signal N.
  if (env.get(detail::kEnvRankContainer) && WIFEXITED(status) && WEXITSTATUS(status) > 128 &&
      WEXITSTATUS(status) < 128 + NSIG) {
    status = W_EXITCODE(0, WEXITSTATUS(status) - 128);
  }
  record(status);
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  // The same end for mpirun to see.
  const int signal = WTERMSIG(status);
  ::signal(signal, SIG_DFL);
  sigset_t just;
  sigemptyset(&just);
  sigaddset(&just, signal);
  ::sigprocmask(SIG_UNBLOCK, &just, nullptr);
  ::kill(::getpid(), signal);
  return 128 + signal;
}

}  // namespace hpctrial::launcher
