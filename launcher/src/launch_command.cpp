// The experiment directory, where the launcher runs, and the mpirun command of one attempt.
#include <fcntl.h>
#include <net/if.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "hpctrial/core/env.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/digest.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/frozen_code.h"
#include "hpctrial/core/json_file.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/files.h"
#include "hpctrial/core/paths.h"
#include "hpctrial/core/text.h"
#include "hpctrial/launcher/launcher.h"
#include "hpctrial/launcher/schedulers.h"
#include "container.h"
#include "launcher_internal.h"

namespace hpctrial::launcher {
namespace fs = std::filesystem;
using json = nlohmann::json;


std::string experiment_workdir(const core::ExperimentConfig& config) {
  return (config.source_path.empty() ? fs::current_path() : fs::absolute(config.source_path).parent_path()).string();
}

namespace {

// The program or library a config names, as the experiment runs it: its frozen copy when the
// experiment froze these very bytes; the file itself for an experiment about to freeze it (a new
// one, or --update-code). ConfigError for other bytes than the frozen ones, naming both digests.
void use_frozen_code(core::ExperimentConfig& config, const ExperimentLayout& layout, bool update_code) {
  const std::string source = core::entrypoint_file(config.entrypoint);
  std::error_code ec;
  if (!config.container.image.empty() || source.empty() || core::is_frozen(layout, source) ||
      !fs::is_regular_file(source, ec)) {
    return;  // the image's, a name on PATH, or missing (check_entrypoint says so)
  }
  const auto frozen = core::frozen_code(layout);
  if (!frozen) return;
  const std::string digest = core::file_sha256(source);
  if (digest == frozen->digest) {
    if (!fs::is_regular_file(frozen->path, ec)) {
      throw IoError("the frozen copy of the experiment's code, " + frozen->path + ", is missing; restore it, or "
                    "pass --update-code to freeze " + source + " again (the change is recorded)");
    }
    core::set_entrypoint_file(config.entrypoint, frozen->path);
  } else if (!update_code) {
    throw ConfigError(source + " is not the code this experiment runs: its SHA-256 is " + digest + ", and the "
                      "experiment froze " + frozen->digest + " (" + (frozen->source.empty() ? "" : frozen->source + ", ") +
                      "kept as " + frozen->path + ") when it was made; every start of the experiment runs that copy. Pass --update-code to run "
                      "the new program from the next start on (recorded in " + layout.state() + "), or run it as "
                      "another experiment (--experiment DIR)");
  }
}

// The context folder a config names, as the experiment runs it: the frozen copy of these very
// files; the folder itself for an experiment about to freeze it (a new one, or --update-code).
// ConfigError for other files than the frozen ones, naming both digests.
void use_frozen_context(core::ExperimentConfig& config, const ExperimentLayout& layout, bool update_code) {
  if (config.context.empty() || core::is_frozen(layout, config.context)) return;
  const auto frozen = core::frozen_context(layout);
  if (!frozen) return;
  const std::string digest = core::scan_context(config.context).digest;
  if (digest == frozen->digest) {
    std::error_code ec;
    if (!fs::is_directory(frozen->path, ec)) {
      throw IoError("the frozen copy of the experiment's context folder, " + frozen->path + ", is missing; restore "
                    "it, or pass --update-code to freeze " + config.context + " again (the change is recorded)");
    }
    config.context = frozen->path;
    return;
  }
  if (update_code) return;
  throw ConfigError("context: " + config.context + " now holds files of SHA-256 " + digest + ", but the experiment "
                    "froze " + frozen->digest + " (kept as " + frozen->path + ") when it was made; every start of the "
                    "experiment runs in that copy. Pass --update-code to freeze the folder as it is now (the change is "
                    "recorded in experiment.json), or restore its files");
}

// The config as the experiment is to run it: the entrypoint's file replaced by the path of its
// frozen copy where it is to be frozen (a new experiment, or --update-code); writes nothing.
core::ExperimentConfig freeze_target(core::ExperimentConfig config, const std::string& dir, bool update_code) {
  const ExperimentLayout layout{dir};
  if (!config.context.empty() && !core::is_frozen(layout, config.context) &&
      (update_code || !(core::frozen_context(layout) || core::experiment_started(layout)))) {
    config.context = core::frozen_context_path(layout, core::scan_context(config.context).digest);
  }
  const std::string source = core::entrypoint_file(config.entrypoint);
  std::error_code ec;
  if (!config.container.image.empty() || source.empty() || core::is_frozen(layout, source) ||
      !fs::is_regular_file(source, ec)) {
    return config;
  }
  // An experiment that began before code was frozen keeps running the file (changing it now
  // would be a change of its entrypoint).
  if (!update_code && (core::frozen_code(layout) || core::experiment_started(layout))) return config;
  const fs::path frozen = fs::path(layout.code_dir()) / core::file_sha256(source) / fs::path(source).filename();
  core::set_entrypoint_file(config.entrypoint, frozen.string());
  return config;
}

}  // namespace

core::ExperimentConfig resolve_experiment(core::ExperimentConfig config, const std::string& dir, bool update_code) {
  const ExperimentLayout layout{dir};
  const fs::path source_dir = experiment_workdir(config);
  // The program or library, absolute: the batch job may start anywhere.
  auto absolute = [&](const std::string& path) {
    if (path.find('/') == std::string::npos) return path;  // looked up on PATH
    return core::resolve_user_path(path, source_dir, "entrypoint").string();
  };
  if (config.entrypoint.kind == core::Entrypoint::Kind::kLibrary) {
    config.entrypoint.library = absolute(config.entrypoint.library);
  } else {
    config.entrypoint.argv.front() = absolute(config.entrypoint.argv.front());
  }
  use_frozen_code(config, layout, update_code);
  use_frozen_context(config, layout, update_code);
  if (!config.reproducibility.experiment_seed) {
    if (fs::exists(layout.config())) {
      const auto earlier = core::load_experiment_config({layout.config(), "", {}});
      config.reproducibility.experiment_seed = earlier.reproducibility.experiment_seed;
    }
    if (!config.reproducibility.experiment_seed) {
      config.reproducibility.experiment_seed = std::random_device{}();
    }
  }
  return config;
}

void check_experiment(const core::ExperimentConfig& config, const std::string& dir, bool update_code) {
  core::check_experiment_config(ExperimentLayout{dir},
                                freeze_target(resolve_experiment(config, dir, update_code), dir, update_code));
}

core::ExperimentConfig prepare_experiment(core::ExperimentConfig config, const std::string& dir, bool update_code) {
  const ExperimentLayout layout{dir};
  const std::string workdir = experiment_workdir(config);
  config = resolve_experiment(std::move(config), dir, update_code);
  const std::string source = core::entrypoint_file(config.entrypoint);
  const std::string context_source = config.context;
  config = freeze_target(std::move(config), dir, update_code);
  core::check_experiment_config(layout, config);  // before anything is made
  const mode_t mode = config.checkpoint_storage.group_readable ? 0750 : 0700;
  core::create_directories(dir, mode);  // runs/ too, when it is made now
  if (::chmod(dir.c_str(), mode) != 0) {  // the config says who may read it, now as when it was made
    throw IoError("cannot set the mode of " + dir + ": " + std::strerror(errno));
  }
  const std::string target = core::entrypoint_file(config.entrypoint);
  const bool freezing = source != target && !core::is_frozen(layout, source);
  const std::string digest = freezing ? core::file_sha256(source) : "";
  if (freezing && core::freeze_file(layout, source, digest) != target) {
    throw IoError(source + " changed while the experiment was made (its copy is not the bytes checked); run the "
                  "command again");
  }
  const bool freezing_context = context_source != config.context;
  if (freezing_context) {
    const core::ContextFolder context = core::scan_context(context_source);
    if (core::freeze_context(layout, context) != config.context) {
      throw IoError("context: files of " + context_source + " changed while the experiment was made; run the "
                    "command again");
    }
  }
  core::commit_experiment_config(layout, config, workdir);
  if (freezing) {
    core::record_frozen_code(layout, {source, digest, target});
    core::log_info("the experiment runs {} as frozen now: {} (SHA-256 {})", source, target, digest);
  }
  if (freezing_context) {
    const std::string context_digest = fs::path(config.context).parent_path().filename().string();
    core::record_frozen_context(layout, {context_source, context_digest, config.context});
    core::log_info("the experiment's ranks run in {} as frozen now: {} (SHA-256 {})", context_source, config.context,
                   context_digest);
  }
  config.source_path = layout.config();
  return config;
}

core::Allocation detect_allocation(const core::EnvSource& env, const core::CommandRunner& run) {
  for (const core::Scheduler* scheduler : schedulers()) {
    if (auto allocation = scheduler->detect(env, run)) return *allocation;
  }
  return {};
}

// This launcher's run, the same for each attempt it starts: "<host>-<pid>-<start time>".
std::string detail::launch_session() {
  static const std::string session = [] {
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    return std::string(host) + "-" + std::to_string(::getpid()) + "-" + std::to_string(std::time(nullptr));
  }();
  return session;
}

namespace {

// The ranks a run starts: slots_per_trial; an elastic job's granted slots, within its bounds.
int ranks_for(const core::Resources& resources, const core::Allocation& allocation) {
  if (!resources.elastic() || !allocation.in_job()) return resources.slots_per_trial;
  const int granted = static_cast<int>(allocation.hosts.size()) * resources.slots_per_node;
  if (granted < resources.min_slots()) {
    throw SchedulerError(allocation.scheduler + " job " + allocation.job_id + " has " + std::to_string(granted) +
                         " slots on " + std::to_string(allocation.hosts.size()) +
                         " node(s), fewer than resources.min_slots_per_trial (" +
                         std::to_string(resources.min_slots()) + ")");
  }
  return std::min(granted, resources.slots_per_trial);
}

// The job has a slot for each of the ranks asked for, unless they are to share (--oversubscribe).
void check_job_slots(const MpirunCommand& c, const core::Allocation& allocation, const LaunchOptions& options) {
  const int slots = allocation.total_slots();
  if (c.np > slots && !options.oversubscribe) {
    throw ConfigError(std::to_string(c.np) + " ranks were asked for but " + allocation.scheduler + " job " +
                      allocation.job_id + " has " + std::to_string(slots) + " slots on " +
                      std::to_string(allocation.hosts.size()) + " node(s); ask for fewer (--np) or submit "
                      "with resources.slots_per_trial " + std::to_string(c.np));
  }
}

// Where the ranks go: the job's hosts (a hostfile, a fixed number a node, bound to cores), or
// this machine's cores.
void add_placement(MpirunCommand& c, const core::ExperimentConfig& config, const core::Allocation& allocation,
                   const LaunchOptions& options, const core::TrialLayout& trial, const core::EnvSource& env) {
  if (allocation.in_job()) {
    check_job_slots(c, allocation, options);
    c.hostfile_path = trial.hostfile();
    // An elastic job runs slots_per_node ranks on every node, however the scheduler spread its tasks.
    for (const auto& host : allocation.hosts) {
      const int slots = config.resources.elastic() ? config.resources.slots_per_node : host.slots;
      c.hostfile += host.name + " slots=" + std::to_string(slots) + "\n";
    }
    c.argv.insert(c.argv.end(), {"--hostfile", c.hostfile_path});
    const int per_node = std::min(config.resources.slots_per_node, c.np);
    c.argv.insert(c.argv.end(), {"--map-by", "ppr:" + std::to_string(per_node) + ":node:PE=" +
                                                 std::to_string(config.resources.cpus_per_slot)});
    c.argv.insert(c.argv.end(), {"--bind-to", options.oversubscribe ? "none" : "core"});
    if (options.oversubscribe) c.argv.push_back("--oversubscribe");
    return;
  }
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  if (static_cast<unsigned>(c.np) > cores && !options.oversubscribe) {
    throw ConfigError(std::to_string(c.np) + " ranks were asked for but this machine has " + std::to_string(cores) +
                      " cores; pass --oversubscribe to run more ranks than cores (each runs slower), or ask "
                      "for fewer with --np");
  }
  c.argv.insert(c.argv.end(), {"--map-by", "slot", "--bind-to", "none"});
  if (options.oversubscribe) c.argv.push_back("--oversubscribe");
  // One host: the ob1 layer over shared memory is all the ranks' CPU collectives need, and it
  // starts in a third of the time UCX takes. Unless the user chose a layer.
  const auto& args = config.launcher.mpirun_args;
  if (std::find(args.begin(), args.end(), "pml") == args.end() && !env.get("OMPI_MCA_pml")) {
    c.argv.insert(c.argv.end(), {"--mca", "pml", "ob1"});
  }
}

// `name` is a network interface of this host (the allocation's first node, where the launcher
// runs), or a ConfigError listing the ones it has.
void require_network_interface(const std::string& name) {
  if (::if_nametoindex(name.c_str()) != 0) return;
  std::string known;
  if (struct if_nameindex* all = ::if_nameindex()) {
    for (const struct if_nameindex* i = all; i->if_index != 0 && i->if_name != nullptr; ++i) {
      known += (known.empty() ? "" : ", ") + std::string(i->if_name);
    }
    ::if_freenameindex(all);
  }
  throw ConfigError("optimizations.network_interface is '" + name + "', which " + core::host_name() +
                    " does not have (it has: " + known + "); name an interface every node of the job has");
}

// The contract with the ranks (core/launch_contract.h), then the user's environment.

std::vector<std::pair<std::string, std::string>> rank_environment(const core::ExperimentConfig& config,
                                                                  const core::Allocation& allocation,
                                                                  const LaunchOptions& options, int restart_count,
                                                                  const core::EnvSource& env) {
  const ExperimentLayout layout{options.experiment_dir};
  const core::TrialLayout trial = layout.trial(options.trial_id);
  std::vector<std::pair<std::string, std::string>> vars = {
      {core::kEnvExperimentDir, layout.dir},
      {core::kEnvConfig, trial.launch_config()},
      {core::kEnvTrialId, std::to_string(options.trial_id)},
      {core::kEnvTrialDir, trial.dir},
      {core::kEnvRestartCount, std::to_string(restart_count)},
      {core::kEnvScheduler, allocation.scheduler},
      {core::kEnvJobId, allocation.job_id},
      {core::kEnvStopFile, trial.stop_file()},
      {core::kEnvHeartbeatDir, trial.heartbeat_dir()},
      {core::kEnvAbortFile, trial.abort_file(restart_count)},
      {core::kEnvVerdictFile, trial.verdict_file(restart_count)},
      {core::kEnvSession, detail::launch_session()},
  };
  if (options.max_length) vars.emplace_back(core::kEnvMaxLength, core::length_text(*options.max_length));
  if (!options.search_worker.empty()) vars.emplace_back(core::kEnvSearchWorker, options.search_worker);
  if (!config.container.image.empty()) {
    vars.emplace_back(core::kEnvCodeDigest, "image " + config.container.image);
  } else if (const auto code = core::frozen_code(layout);
             code && code->path == core::entrypoint_file(config.entrypoint)) {
    vars.emplace_back(core::kEnvCodeDigest, code->digest);
  }
  // NCCL's bootstrap and socket transport over the same interface as MPI's (the user's own
  // environment, below, may still say otherwise).
  if (!config.optimizations.network_interface.empty()) {
    vars.emplace_back("NCCL_SOCKET_IFNAME", config.optimizations.network_interface);
  }
  // torch.distributed's rendezvous (what torchrun sets): rank 0's host, and a port free there
  // when that is this host (else torch's default).
  const std::string first = allocation.hosts.empty() ? core::host_name() : allocation.hosts.front().name;
  const int port = first == core::host_name() ? core::free_tcp_port() : 0;
  vars.emplace_back("MASTER_ADDR", first);
  vars.emplace_back("MASTER_PORT", std::to_string(port > 0 ? port : 29500));
  for (const char* passed : {core::kEnvFault, "HPCTRIAL_LOG_LEVEL"}) {
    if (const auto value = env.get(passed)) vars.emplace_back(passed, *value);
  }
  // optimizations.huge_pages: glibc's malloc (2.35 and later; older ones ignore the tunable)
  // asks for transparent huge pages for the ranks' large allocations. The user's own tunables
  // are kept, and one of theirs that says glibc.malloc.hugetlb has the last word.
  const std::string tunables = env.get("GLIBC_TUNABLES").value_or("");
  if (config.optimizations.huge_pages && tunables.find("glibc.malloc.hugetlb") == std::string::npos) {
    vars.emplace_back("GLIBC_TUNABLES", tunables + (tunables.empty() ? "" : ":") + "glibc.malloc.hugetlb=1");
  }
  for (const auto& var : config.environment) {
    vars.emplace_back(var.name, core::expand_env_references(var.value, env, "environment." + var.name));
  }
  return vars;
}

// What the container of each rank needs (environment.image); the variables the ranks need are
// passed to it by name.
detail::ContainerCommandInput container_input(const MpirunCommand& c, const core::ExperimentConfig& config,
                                              const LaunchOptions& options, const core::EnvSource& env) {
  detail::ContainerCommandInput input;
  input.mounts = detail::container_mounts(config, options.experiment_dir, c.working_dir, env);
  input.passed = detail::rank_variable_prefixes();
  const auto covered = [&](const std::string& name) {
    for (const auto& prefix : detail::rank_variable_prefixes()) {
      if (name.compare(0, prefix.size() - 1, prefix, 0, prefix.size() - 1) == 0) return true;
    }
    return false;
  };
  for (const char* name : detail::kTorchRankVariables) input.passed.push_back(name);
  for (const auto& [name, value] : c.env) {
    if (!covered(name)) input.passed.push_back(name);
    if (name == core::kEnvAbortFile) input.attempt = value;
  }
  // Podman sets a name the host lacks to the empty string, which is not "unset" to a program.
  if (env.get("TMPDIR")) input.passed.push_back("TMPDIR");
  input.working_dir = c.working_dir;
  input.gpus = config.resources.gpus_per_slot > 0;
  input.rootless = ::geteuid() != 0;
  return input;
}

// The runtime's command before each rank's program; none without an image, or with enroot,
// whose containers pyxis starts for srun (pyxis_options).
std::vector<std::string> container_words(const MpirunCommand& c, const core::ExperimentConfig& config,
                                         const LaunchOptions& options, const core::EnvSource& env) {
  if (config.container.image.empty() || config.container.runtime == core::Container::Runtime::kEnroot) return {};
  return detail::container_command(config.container, container_input(c, config, options, env));
}

// What each rank runs: the rank parent, the container, the user's prefix, then the trial
// program.
void add_rank_program(MpirunCommand& c, const core::ExperimentConfig& config, const LaunchOptions& options,
                      const core::EnvSource& env) {
  const bool pyxis = config.container.runtime == core::Container::Runtime::kEnroot;
  const auto container = container_words(c, config, options, env);
  c.argv.insert(c.argv.end(), options.rank_parent.begin(), options.rank_parent.end());
  if (pyxis && !options.rank_parent.empty()) c.argv[c.argv.size() - options.rank_parent.size()] = "hpctrial";  // the image's
  c.argv.insert(c.argv.end(), container.begin(), container.end());
  c.argv.insert(c.argv.end(), config.launcher.prefix.begin(), config.launcher.prefix.end());
  if (config.entrypoint.kind == core::Entrypoint::Kind::kLibrary) {
    if (!config.container.image.empty()) {
      c.argv.push_back("hpctrial-worker");  // the image's own, on its PATH
    } else if (options.worker.empty()) {
      throw ConfigError("entrypoint " + config.entrypoint.library + ":" + config.entrypoint.trial_class +
                        " is a trial library, but hpctrial-worker was not found beside hpctrial; reinstall hpctrial");
    } else {
      c.argv.push_back(options.worker);
    }
  } else {
    c.argv.insert(c.argv.end(), config.entrypoint.argv.begin(), config.entrypoint.argv.end());
  }
}

// mpirun's words before the ranks' environment: placement, tagged output, the grace, the
// network interface.
void add_mpirun_words(MpirunCommand& c, const core::ExperimentConfig& config, const core::Allocation& allocation,
                      const LaunchOptions& options, const core::EnvSource& env) {
  std::string mpirun = options.mpirun;
  if (mpirun.empty()) mpirun = env.get("HPCTRIAL_MPIRUN").value_or("mpirun");
  c.argv = {mpirun, "-np", std::to_string(c.np)};
  add_placement(c, config, allocation, options, ExperimentLayout{options.experiment_dir}.trial(options.trial_id), env);
  // Output tagged by rank, which the launcher turns into "[rank N] " and per-rank files.
  c.argv.push_back("--tag-output");
  // On SIGTERM, mpirun waits this long before it kills the ranks: time for their emergency
  // checkpoint.
  c.argv.insert(c.argv.end(), {"--mca", "odls_base_sigkill_timeout",
                               std::to_string(std::max<std::int64_t>(1, config.scheduler.preemption_grace_seconds))});
  if (const std::string& interface = config.optimizations.network_interface; !interface.empty()) {
    require_network_interface(interface);
    // Open MPI's TCP byte transfer layer (the ranks' messages) and its out-of-band channel
    // (the daemons' wire-up) on that interface only.
    c.argv.insert(c.argv.end(), {"--mca", "btl_tcp_if_include", interface, "--mca", "oob_tcp_if_include", interface});
  }
}

// srun's words (launcher.mpi: srun): one job step of the Slurm job the launcher runs in, a task
// a rank, wired up by PMIx. A failed task does not end the step (--kill-on-bad-exit=0): the
// launcher ends the others, as it does under mpirun, once it knows which rank failed and how.
void add_srun_words(MpirunCommand& c, const core::ExperimentConfig& config, const core::Allocation& allocation,
                    const LaunchOptions& options, const core::EnvSource& env) {
  if (!allocation.in_job() || !scheduler(allocation.scheduler).allows_srun()) {
    throw ConfigError("launcher.mpi is srun, which starts the ranks as a step of a Slurm job, but this run is " +
                      (allocation.in_job() ? "in " + allocation.scheduler + " job " + allocation.job_id
                                           : std::string("in no job (SLURM_JOB_ID is not set)")) +
                      "; submit it with scheduler.type: slurm, run it inside salloc, or set launcher.mpi: mpirun");
  }
  check_job_slots(c, allocation, options);
  const int per_node = std::max(1, std::min(config.resources.slots_per_node, c.np));
  const int nodes = (c.np + per_node - 1) / per_node;
  c.srun = true;
  c.argv = {env.get("HPCTRIAL_SRUN").value_or("srun"),
            "--mpi=pmix",
            "--ntasks=" + std::to_string(c.np),
            "--nodes=" + std::to_string(nodes),
            "--ntasks-per-node=" + std::to_string(per_node),
            "--cpus-per-task=" + std::to_string(config.resources.cpus_per_slot),
            "--cpu-bind=" + std::string(options.oversubscribe ? "none" : "cores"),
            "--kill-on-bad-exit=0",
            "--label",  // "N: ", which the launcher turns into "[rank N] " and per-rank files
            "--export=ALL"};
  if (options.oversubscribe) c.argv.push_back("--overcommit");
  if (const std::string& interface = config.optimizations.network_interface; !interface.empty()) {
    require_network_interface(interface);
    c.env.emplace_back("OMPI_MCA_btl_tcp_if_include", interface);  // no daemons: no out-of-band channel
  }
}

}  // namespace

MpirunCommand build_mpirun_command(const core::ExperimentConfig& config, const core::Allocation& allocation,
                                   const LaunchOptions& options, int restart_count, const core::EnvSource& env) {
  const ExperimentLayout layout{options.experiment_dir};
  MpirunCommand c;
  c.np = options.np > 0 ? options.np : ranks_for(config.resources, allocation);
  c.working_dir = options.working_dir.empty()
                      ? core::json_field(core::read_json_file(layout.state()), "workdir", std::string(), layout.state())
                      : options.working_dir;
  if (!config.context.empty()) c.working_dir = config.context;  // the frozen context folder
  if (config.launcher.mpi == core::LauncherConfig::Mpi::kSrun) {
    add_srun_words(c, config, allocation, options, env);
  } else {
    add_mpirun_words(c, config, allocation, options, env);
  }
  const auto contract = rank_environment(config, allocation, options, restart_count, env);
  c.env.insert(c.env.end(), contract.begin(), contract.end());  // the user's environment has the last word
  if (config.container.runtime == core::Container::Runtime::kPodman && ::geteuid() != 0 &&
      !env.get("OMPI_MCA_btl_vader_single_copy_mechanism")) {
    // Each rootless container has a user namespace of its own, across which Linux refuses
    // Open MPI's single-copy transfers (CMA): copy through shared memory, without the warning.
    c.env.emplace_back("OMPI_MCA_btl_vader_single_copy_mechanism", "none");
  }
  if (!config.container.image.empty() && config.container.runtime != core::Container::Runtime::kEnroot) {
    c.env.emplace_back(detail::kEnvRankContainer, core::runtime_name(config.container.runtime));
  }
  if (c.srun) {
    c.argv.insert(c.argv.end(), config.launcher.srun_args.begin(), config.launcher.srun_args.end());
    if (config.container.runtime == core::Container::Runtime::kEnroot) {
      const auto pyxis = detail::pyxis_options(config.container, container_input(c, config, options, env));
      c.argv.insert(c.argv.end(), pyxis.begin(), pyxis.end());
    }
  } else {
    for (const auto& [name, value] : c.env) c.argv.insert(c.argv.end(), {"-x", name});
    c.argv.insert(c.argv.end(), config.launcher.mpirun_args.begin(), config.launcher.mpirun_args.end());
  }
  add_rank_program(c, config, options, env);
  return c;
}

}  // namespace hpctrial::launcher
