// The launcher's supervision of one mpirun per attempt, and the exit protocol across attempts.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include "hpctrial/core/batch_job.h"
#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/search.h"
#include "hpctrial/core/shell_quote.h"
#include "hpctrial/core/subprocess.h"
#include "hpctrial/core/text.h"
#include "hpctrial/launcher/launcher.h"
#include "hpctrial/launcher/schedulers.h"
#include "container.h"
#include "failure_record.h"
#include "hand_over.h"
#include "launcher_internal.h"
#include "processes.h"
#include "startup_hook.h"
#include "supervisor.h"

extern char** environ;

namespace hpctrial::launcher {
namespace {

using detail::Attempt;
using detail::excluded_nodes;
using detail::FailureOutcome;
using detail::record_failure;
using detail::name_holder;
using detail::describe_seconds;
using detail::SignalFd;
using detail::Supervisor;

namespace fs = std::filesystem;
using nlohmann::json;

// True when `program` is an executable in one of the folders of `path`.
bool on_path(const std::string& program, const std::string& path) {
  std::stringstream dirs(path);
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (!dir.empty() && ::access((dir + "/" + program).c_str(), X_OK) == 0) return true;
  }
  return false;
}

// The image is there before any rank starts: Podman's among the user's images (a missing one
// would be pulled by every rank at once, or fail each), Apptainer's file where it is a file.
void check_image(const core::Container& container, const std::string& working_dir) {
  const std::string& image = container.image;
  if (container.runtime == core::Container::Runtime::kPodman) {
    core::RunOptions options;
    options.timeout = std::chrono::seconds(60);
    const core::RunResult r = core::run_process({"podman", "image", "exists", image}, options);
    if (r.ok()) return;
    throw ConfigError("environment.image: " + image + " is not among podman's images of this user on " +
                      core::host_name() + (r.exit_code == 1 ? "" : " (" + r.describe() + ": " + r.err + ")") +
                      "; build or pull it there (podman pull " + image + "), on every node of the job");
  }
  if (image.find("://") != std::string::npos) return;  // docker://, library://, oras://: fetched by the runtime
  fs::path path(image);
  if (path.is_relative()) path = fs::path(working_dir) / path;
  std::error_code error;
  if (!fs::exists(path, error)) {
    throw ConfigError("environment.image: " + path.string() + " does not exist on " + core::host_name() +
                      "; build it (apptainer build), or give its path, or a docker:// URI");
  }
}

// enroot's containers are started by Slurm's pyxis plugin, which adds --container-image to srun;
// a squashfs image given by its path must be there.
void check_pyxis(const core::Container& container, const std::string& working_dir, const core::EnvSource& env) {
  core::RunOptions options;
  options.timeout = std::chrono::seconds(30);
  const std::string srun = env.get("HPCTRIAL_SRUN").value_or("srun");
  const core::RunResult r = core::run_process({srun, "--help"}, options);
  if (r.out.find("--container-image") == std::string::npos) {
    throw ConfigError("environment.container_runtime: enroot needs Slurm's pyxis plugin, but `" + srun + " --help` on " +
                      core::host_name() + " offers no --container-image" +
                      (r.ok() ? "" : " (" + r.describe() + ")") +
                      "; ask the site whether pyxis is installed, or use podman or apptainer");
  }
  if (container.image.empty() || (container.image.front() != '/' && container.image.rfind("./", 0) != 0)) return;
  const fs::path path = fs::path(working_dir) / container.image;  // an absolute image replaces the folder
  std::error_code error;
  if (!fs::exists(path, error)) {
    throw ConfigError("environment.image: " + path.string() + " does not exist on " + core::host_name() +
                      "; import it (enroot import -o " + path.string() + " docker://...), or give an image URI");
  }
}

// The entrypoint must exist before any rank is started.
// A bare program name is looked up as mpirun will: on the PATH the config's environment sets,
// else on the launcher's own. In a container, the entrypoint is the image's: the runtime must
// be on this host's PATH, and the image here.
void check_entrypoint(const core::ExperimentConfig& config, const std::string& working_dir,
                      const core::EnvSource& env) {
  const bool library = config.entrypoint.kind == core::Entrypoint::Kind::kLibrary;
  const std::string program = library ? config.entrypoint.library : config.entrypoint.argv.front();
  if (config.container.runtime == core::Container::Runtime::kEnroot) {
    check_pyxis(config.container, working_dir, env);
    return;
  }
  if (!config.container.image.empty()) {
    const std::string runtime = core::runtime_name(config.container.runtime);
    if (!on_path(runtime, env.get("PATH").value_or(""))) {
      throw ConfigError("environment.container_runtime: " + runtime + " is not a program on PATH on " +
                        core::host_name() + "; load its module, or install it on every node");
    }
    check_image(config.container, working_dir);
    return;
  }
  if (program.find('/') == std::string::npos) {
    if (library) return;
    std::string path = env.get("PATH").value_or("");
    for (const auto& var : config.environment) {
      if (var.name == "PATH") path = core::expand_env_references(var.value, env, "environment.PATH");
    }
    if (on_path(program, path)) return;
    throw ConfigError("entrypoint: " + program + " is not a program on PATH; give its path, e.g. ./" + program);
  }
  fs::path path(program);
  if (path.is_relative() && !working_dir.empty()) path = fs::path(working_dir) / path;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw ConfigError("entrypoint: " + path.string() + " does not exist; build it, or fix entrypoint in the config");
  }
  if (!library && ::access(path.c_str(), X_OK) != 0) {
    throw ConfigError("entrypoint: " + path.string() + " is not executable (chmod +x it, or fix entrypoint)");
  }
}

}  // namespace

void print_launch_plan(const core::ExperimentConfig& config, const LaunchOptions& options, const core::EnvSource& env,
                       const core::CommandRunner& run) {
  const core::Allocation allocation = detect_allocation(env, run);
  const MpirunCommand command = build_mpirun_command(config, allocation, options, 0, env);
  std::string line;
  for (const auto& arg : command.argv) line += (line.empty() ? "" : " ") + core::shell_quote(arg, "argument");
  std::cout << "# in " << command.working_dir << " (" << allocation.scheduler
            << (allocation.job_id.empty() ? "" : " job " + allocation.job_id) << ")\n";
  for (const auto& [name, value] : command.env) {
    // Only the contract's own values: the config's environment may hold secrets.
    if (name.rfind("HPCTRIAL_", 0) == 0) std::cout << name << "=" << core::shell_quote(value, name) << " \\\n";
  }
  std::cout << line << "\n";
  if (!command.hostfile.empty()) std::cout << "# hostfile " << command.hostfile_path << ":\n" << command.hostfile;
}

namespace {

// Every rank stopped after a durable checkpoint inside a job: its scheduler takes the trial back
// to the queue (held when the user paused it); a command that fails is tried again, and a
// hand-over that still fails is recorded with the command that resumes the trial by hand. A
// SIGTERM without warning is the scheduler's own doing (a cancel, an admin's requeue or rerun, a
// preemption): it decides what follows.
// Why the ranks stopped: the trial's stop request (`hpctrial pause` may have asked without a
// signal), a pause of a search's worker's job that came while it stopped for another reason (the
// job is then held all the same), else what the launcher asked, else the trial itself.
std::string stop_reason_of(const Attempt& a, const ExperimentLayout& layout, const std::string& trial_dir,
                           const core::Allocation& allocation) {
  if (const std::string paused = core::job_stop_reason(layout, allocation); !paused.empty()) return paused;
  if (std::string reason = core::stop_reason(trial_dir); !reason.empty()) return reason;
  return a.stop_requested ? a.stop_reason : "requested by the trial";
}

// What resumes a trial that stopped after a durable checkpoint. A SIGTERM without warning is a
// delete, or a requeue by the scheduler or an operator.
const char* what_resumes(const core::Allocation& allocation, const std::string& reason) {
  if (!allocation.in_job()) return "run the same command again to resume";
  if (reason == "terminate") return "it resumes from it if the job runs again, or when the experiment is submitted again";
  if (reason == "cancel") return "the job ends as `hpctrial cancel` asked; submitting the experiment again resumes it";
  return "it resumes when the job runs again";
}

// A search's worker lets its trial (`held`) go first: whichever worker runs next may take it
// over at once; a worker that cannot go back to the queue is lost to the search, not its trial.
// `exclude`: nodes the next run must not use.
void hand_over(const core::Allocation& allocation, const std::string& reason, const core::ExperimentConfig& config,
               const LaunchOptions& options, const core::EnvSource& env, const core::CommandRunner& run,
               core::UniqueFd* held, std::vector<std::string> exclude = {}) {
  if (held != nullptr) *held = core::UniqueFd();
  if (!allocation.in_job() || reason == "terminate" || reason == "interrupt" || reason == "cancel") return;
  const core::HandOver stopped{allocation,      config, options.experiment_dir, options.trial_id, reason == "pause",
                               held != nullptr, &env,   run,                    std::move(exclude)};
  if (held != nullptr) {
    detail::hand_over_worker(scheduler(allocation.scheduler), stopped);
  } else {
    detail::hand_over_trial(scheduler(allocation.scheduler), stopped,
                            ExperimentLayout{options.experiment_dir}.trial_dir(options.trial_id));
  }
}

// Where the launcher runs. When the scheduler did not say when the job ends (a compute node that
// cannot reach its server), the job started moments ago, and the config says how long it may run.
core::Allocation job_allocation(const core::ExperimentConfig& config, const LaunchOptions& options,
                                const core::EnvSource& env, const core::CommandRunner& run) {
  core::Allocation allocation = detect_allocation(env, run);
  if (allocation.in_job() && !allocation.end_time && options.job_end) allocation.end_time = options.job_end;
  if (allocation.in_job() && !allocation.end_time && config.scheduler.time_limit_seconds && !options.dry_run) {
    allocation.end_time = std::chrono::system_clock::now() + std::chrono::seconds(*config.scheduler.time_limit_seconds);
    core::log_warning("{} did not say when job {} ends; assuming it ends scheduler.time_limit ({}) from now",
                      allocation.scheduler, allocation.job_id, describe_seconds(*config.scheduler.time_limit_seconds));
  }
  return allocation;
}

// The hostfile of an attempt, and a fresh heartbeat directory.
void prepare_attempt(const MpirunCommand& command, const std::string& trial_dir) {
  if (!command.hostfile_path.empty()) {
    core::create_directories(fs::path(command.hostfile_path).parent_path().string());
    core::write_file_atomic(command.hostfile_path, command.hostfile);
  }
  const std::string beats = core::TrialLayout{trial_dir}.heartbeat_dir();
  fs::remove_all(beats);
  core::create_directories(beats);
}

// A stop request, abort files and verdicts of an earlier run are spent; a stop request made for
// this very job (`hpctrial pause` just as it started) is not.
void clear_spent_requests(const std::string& trial_dir, const core::Allocation& allocation) {
  const core::TrialLayout trial{trial_dir};
  if (!core::stop_requested_for(trial_dir, allocation.job_id)) ::unlink(trial.stop_file().c_str());
  std::error_code ignored;
  for (const auto& entry : fs::directory_iterator(trial.launch_dir(), ignored)) {
    if (core::TrialLayout::is_attempt_file(entry.path().filename().string())) fs::remove(entry.path(), ignored);
  }
}

constexpr auto kTrialLockWait = std::chrono::minutes(10);

// One launcher per trial: a job that resumes a trial can start while the job before it is
// still ending (PBS lets no job depend on a subjob of an array job). In a batch job the new
// launcher waits for the old one to end; outside one, a second launcher is refused. The lock
// (core::lock_file_exclusive: flock, or an open file description lock where the filesystem has
// no flock; released when the launcher ends however it ends) names its holder.
core::UniqueFd lock_trial(const std::string& trial_dir, int trial_id, const core::Allocation& allocation) {
  const std::string path = core::TrialLayout{trial_dir}.launcher_lock();
  core::UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (fd.get() < 0) throw IoError("cannot open " + path + ": " + std::strerror(errno));
  const auto holder = [&] {
    std::ifstream in(path);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    text = core::trim(text);
    return text.empty() ? std::string("another launcher") : text;
  };
  const auto deadline = std::chrono::steady_clock::now() + kTrialLockWait;
  for (bool said = false; !core::lock_file_exclusive(fd.get(), path, core::LockWait::kTry);) {
    if (!allocation.in_job()) {
      throw Error("trial " + std::to_string(trial_id) + " in " + trial_dir + " is run by " + holder() +
                  "; wait for it to end, or stop it (Ctrl-C there, or `hpctrial kill`)");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      throw Error("trial " + std::to_string(trial_id) + " in " + trial_dir + " is still run by " + holder() +
                  " after 10 minutes; end that job (`hpctrial kill`), then submit the experiment again");
    }
    if (!said) core::log_info("trial {} is still run by {}; waiting for it to end", trial_id, holder());
    said = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  name_holder(fd, path, allocation);
  return fd;
}

}  // namespace

namespace detail {

std::string launcher_name(const core::Allocation& allocation) {
  const std::string host = core::host_name();
  const std::string job = allocation.in_job() ? allocation.scheduler + " job " + allocation.job_id + ", " : "";
  return "the launcher of " + job + "pid " + std::to_string(::getpid()) + " on " + host;
}

void name_holder(const core::UniqueFd& lock, const std::string& path, const core::Allocation& allocation) {
  if (::ftruncate(lock.get(), 0) == 0) core::write_fully(lock.get(), launcher_name(allocation) + "\n", path);
}

core::UniqueFd try_lock_trial(const std::string& trial_dir) {
  const std::string path = core::TrialLayout{trial_dir}.launcher_lock();
  core::UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (fd.get() < 0) throw IoError("cannot open " + path + ": " + std::strerror(errno));
  if (!core::lock_file_exclusive(fd.get(), path, core::LockWait::kTry)) return core::UniqueFd();
  return fd;
}

}  // namespace detail

namespace {

// `hpctrial run`: the config is written only by the launcher that holds the trial, so that a
// second run, refused because the trial is running, leaves the config the first run's restarts
// read. Returns the held lock (none without a config to write).
core::UniqueFd prepare_held_trial(const LaunchOptions& options, const core::EnvSource& env,
                                  const core::CommandRunner& run) {
  if (!options.write_config || options.dry_run) return core::UniqueFd();
  const ExperimentLayout layout{options.experiment_dir};
  const core::ExperimentConfig& fresh = *options.write_config;
  check_experiment(fresh, layout.dir, options.update_code);  // another experiment's config: refused before anything is made
  const mode_t mode = fresh.checkpoint_storage.group_readable ? 0750 : 0700;
  core::create_directories(layout.dir, mode);
  core::create_directories(layout.trial_dir(options.trial_id), mode);
  core::UniqueFd lock = lock_trial(layout.trial_dir(options.trial_id), options.trial_id,
                                   job_allocation(fresh, options, env, run));
  prepare_experiment(fresh, layout.dir, options.update_code);
  return lock;
}

// The experiment's config as recorded; ConfigError where the directory holds none, IoError where
// its identity is lost or damaged (no rank starts without it: hpctrial launch in a batch job).
core::ExperimentConfig recorded_config(const ExperimentLayout& layout) {
  if (!fs::exists(layout.config())) {
    throw ConfigError(layout.dir + " is not an experiment directory: there is no " + layout.config() +
                      "; create the experiment with `hpctrial run EXP.yaml` or `hpctrial submit EXP.yaml`");
  }
  core::require_experiment_identity(layout);
  return core::load_experiment_config({layout.config(), "", {}});
}

// The config this launcher's ranks read at every restart (TrialLayout::launch_config): the
// experiment's as this launcher found it, whatever a later command records for the experiment's
// other trials. Written by the launcher that holds the trial.
void hold_launch_config(const std::string& trial_dir, const core::ExperimentConfig& experiment) {
  core::write_file_atomic(core::TrialLayout{trial_dir}.launch_config(), core::to_yaml(experiment));
}

// The trial's ranks finished. A warning that came as they finished stays pending, for a search's
// worker to heed.
int finished(const Attempt& a, const std::string& trial_dir, int trial_id) {
  if (a.stop_requested && a.stop_reason == "preemption") ::raise(SIGUSR2);
  ::unlink(core::TrialLayout{trial_dir}.stop_file().c_str());
  core::log_info("trial {} finished", trial_id);
  return kExitFinished;
}

// The job's allocation, its ranks on `hosts` (the nodes in use: spare nodes left out).
core::Allocation on_hosts(const core::Allocation& allocation, const std::vector<core::Host>& hosts) {
  core::Allocation on = allocation;
  on.hosts = hosts;
  return on;
}

// Before a restart inside a job on several nodes: the next attempt needs the nodes' slots, which
// the daemons of the last one's mpirun, killed, may still hold.
void end_leftover_steps(const core::Allocation& allocation) {
  if (!allocation.in_job() || allocation.hosts.size() < 2) return;
  for (const std::string& step : scheduler(allocation.scheduler).end_leftover_steps(allocation)) {
    core::log_info("ended step {} of job {}, left running by the attempt before", step, allocation.job_id);
  }
}

// A run given up (ending with `code`): its ranks' copies in node memory (checkpoint_levels.memory)
// are of no more use, and those on this node go now. The other nodes' go when a later run there
// finds them unheld (rank/node_memory.h).
int given_up(const core::ExperimentConfig& config, const ExperimentLayout& layout, int trial_id, int code) {
  if (!config.checkpoint_levels.memory()) return code;
  try {
    const core::NodeMemoryLayout copies{config.checkpoint_levels.memory_dir, static_cast<unsigned>(::getuid()),
                                        core::require_experiment_identity(layout).id, trial_id,
                                        detail::launch_session()};
    std::error_code ec;
    if (fs::remove_all(copies.session_dir(), ec) > 0 && !ec) {
      core::log_info("removed the trial's copies in node memory on this node ({})", copies.session_dir());
    }
  } catch (const Error& e) {
    core::log_warning("the trial's copies in node memory are left for a later run to remove: {}", e.what());
  }
  return code;
}

}  // namespace

// The startup hook of an attempt (startup_hook.h). One that fails is recorded in the trial's
// launcher-state.json and ends the launch with its status: not the trial's failure, nothing to
// retry until the hook is fixed.
std::optional<int> run_hook(const core::ExperimentConfig& config, const core::Allocation& allocation,
                            const LaunchOptions& options, int starts, const core::EnvSource& env, json& state,
                            const std::string& state_path) {
  constexpr const char* kRecord = "startup_hook_failure";
  const auto hook = detail::run_startup_hook(config, allocation, options, starts, env);
  if (!hook) {
    state.erase(kRecord);
    return std::nullopt;
  }
  core::log_error("{}", hook->message);
  state[kRecord] = {{"exit_code", hook->exit_code}, {"message", hook->message}, {"at", core::utc_now_iso()}};
  core::write_json_file(state_path, state);
  return hook->exit_code;
}

int launch(const LaunchOptions& options, const core::EnvSource& env, const core::CommandRunner& run,
           core::UniqueFd* held) {
  // A closed stdout or stderr (`hpctrial run ... | head`, a dropped terminal) fails writes with
  // EPIPE, which every writer here tolerates: the rank logs keep everything. (Children start
  // with the default disposition again: spawn_process resets it.)
  ::signal(SIGPIPE, SIG_IGN);
  detail::hold_warning_signals();
  const ExperimentLayout layout{options.experiment_dir};
  core::UniqueFd trial_lock = prepare_held_trial(options, env, run);
  const core::ExperimentConfig experiment = recorded_config(layout);
  // The trial's own values of the search's ranges (and a clear error for a trial that does not exist).
  const core::ExperimentConfig config = core::trial_config(experiment, options.trial_id);
  const core::Allocation allocation = job_allocation(config, options, env, run);
  const std::string trial_dir = layout.trial_dir(options.trial_id);
  const std::string state_path = core::TrialLayout{trial_dir}.launcher_state_file();
  if (options.dry_run) {
    print_launch_plan(config, options, env, run);
    return kExitFinished;
  }
  core::create_directories(trial_dir, config.checkpoint_storage.group_readable ? 0750 : 0700);
  if (trial_lock.get() < 0 && !(held && held->get() >= 0)) trial_lock = lock_trial(trial_dir, options.trial_id, allocation);
  hold_launch_config(trial_dir, experiment);
  json state = core::read_json_file(state_path);
  int starts = core::json_field(state, "starts", 0, state_path);
  int failures = options.reset_failures ? 0 : core::json_field(state, "failures", 0, state_path);
  state.erase(core::kFailedHandOverKey);  // this start resumes the trial
  const std::string working_dir =
      core::json_field(core::read_json_file(layout.state()), "workdir", std::string(), layout.state());
  check_entrypoint(config, working_dir, env);
  clear_spent_requests(trial_dir, allocation);
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  SignalFd signals;
  std::string previous_failure;  // the last attempt's failure and steps, to tell a repeat
  // The nodes the ranks run on: with spare nodes, those the ranks need, a spare in the place of
  // one they failed on.
  std::vector<core::Host> in_use = detail::nodes_in_use(config, allocation, state, state_path);

  while (true) {
    const core::Allocation attempt_allocation = on_hosts(allocation, in_use);
    const MpirunCommand command = build_mpirun_command(config, attempt_allocation, options, starts, env);
    if (const auto failed = run_hook(config, attempt_allocation, options, starts, env, state, state_path)) return *failed;
    prepare_attempt(command, trial_dir);
    state["starts"] = ++starts;
    state["failures"] = failures;
    core::write_json_file(state_path, state);
    core::log_info("starting {} rank(s) of trial {} in {}{}", command.np, options.trial_id, trial_dir,
                   starts > 1 ? " (start " + std::to_string(starts) + ")" : "");

    Supervisor supervisor(config, allocation, layout.dir, trial_dir);
    const Attempt a = supervisor.run(command, signals);
    detail::remove_left_containers(config.container, command.env);
    const int code = supervisor.stop_finished() ? kExitStopped : WIFEXITED(a.status) ? WEXITSTATUS(a.status) : -1;
    if (a.aborted) return kExitAborted;
    if (a.hang.empty() && code == kExitFinished) return finished(a, trial_dir, options.trial_id);
    if (a.hang.empty() && code == kExitStopped) {
      const std::string reason = stop_reason_of(a, layout, trial_dir, allocation);
      core::log_info("trial {} stopped ({}) after a durable checkpoint; {}", options.trial_id, reason,
                     what_resumes(allocation, reason));
      hand_over(allocation, reason, config, options, env, run, held);
      // Cancelled, the job ends as it was asked to (a search's worker learns it from its job's request).
      return reason == "cancel" && held == nullptr ? kExitFinished : kExitStopped;
    }
    if (a.grace_expired) {
      core::log_warning("the ranks did not checkpoint within the grace; the next run resumes from the previous checkpoint");
      return 128 + SIGTERM;
    }

    // A failure: record it, then restart or give up.
    const FailureOutcome failed = record_failure(supervisor, a, code, config, options, allocation, trial_dir, state,
                                                 starts, ++failures, previous_failure, in_use);
    if (failed.exit_code) return given_up(config, layout, options.trial_id, *failed.exit_code);
    if (!failed.left_out.empty()) {  // the restart runs elsewhere: back to the queue without the node
      hand_over(allocation, "failure", config, options, env, run, held, excluded_nodes(state, allocation.job_id, state_path));
      return kExitStopped;
    }
    end_leftover_steps(allocation);
  }
}

}  // namespace hpctrial::launcher
