#include "container.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>

#include "hpctrial/core/error.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/paths.h"
#include "hpctrial/core/subprocess.h"

namespace hpctrial::launcher::detail {
namespace fs = std::filesystem;

namespace {

// "a:b[:mode]" -> b
std::string destination(const std::string& mount) {
  const auto first = mount.find(':');
  const auto second = mount.find(':', first + 1);
  return mount.substr(first + 1, second == std::string::npos ? std::string::npos : second - first - 1);
}

bool inside(const std::string& path, const std::string& folder) {
  if (folder == "/") return true;
  return path == folder || (path.size() > folder.size() && path.compare(0, folder.size(), folder) == 0 &&
                            path[folder.size()] == '/');
}

}  // namespace

const std::vector<std::string>& rank_variable_prefixes() {
  static const std::vector<std::string> prefixes = {"HPCTRIAL_*", "OMPI_*", "PMIX_*", "OPAL_*", "SLURM_*", "PBS_*",
                                                    "NCCL_*",     "CUDA_*", "UCX_*",  "FI_*"};
  return prefixes;
}

std::vector<std::string> container_mounts(const core::ExperimentConfig& config, const std::string& experiment_dir,
                                          const std::string& working_dir, const core::EnvSource& env) {
  std::vector<std::string> folders = {experiment_dir, working_dir, env.get("TMPDIR").value_or("/tmp")};
  if (!config.checkpoint_storage.host_path.empty()) folders.push_back(config.checkpoint_storage.host_path);
  if (config.entrypoint.kind == core::Entrypoint::Kind::kLibrary &&
      config.entrypoint.library.find('/') != std::string::npos) {
    folders.push_back(fs::path(config.entrypoint.library).parent_path().string());
  }
  if (config.stage.to == core::DataStage::To::kPath) folders.push_back(config.stage.path);
  for (const auto& entry : config.data.entries()) {
    if (!entry.value.is_scalar() || entry.key == "stage") continue;
    const std::string& text = entry.value.text();
    if (text.empty() || text.find('\n') != std::string::npos) continue;
    std::error_code error;
    try {
      const fs::path path = core::resolve_user_path(text, working_dir, "data." + entry.key);
      if (text.find('/') != std::string::npos && fs::exists(path, error)) {
        folders.push_back(path.string());
      }
    } catch (const std::exception&) {
      // Not a path: a dataset's name, a number.
    }
  }
  const std::vector<std::string>& binds = config.container.binds;
  // Normalised; those a bind replaces (the same destination) left out.
  std::vector<std::string> kept;
  for (const std::string& folder : folders) {
    if (folder.empty()) continue;
    std::string normal = fs::path(folder).lexically_normal().string();
    while (normal.size() > 1 && normal.back() == '/') normal.pop_back();
    const bool replaced =
        std::any_of(binds.begin(), binds.end(), [&](const std::string& b) { return destination(b) == normal; });
    if (!replaced && std::find(kept.begin(), kept.end(), normal) == kept.end()) kept.push_back(normal);
  }
  std::vector<std::string> mounts;
  for (const std::string& folder : kept) {
    const bool covered =
        std::any_of(kept.begin(), kept.end(), [&](const std::string& other) { return other != folder && inside(folder, other); });
    if (covered) continue;
    if (folder.find(':') != std::string::npos) {
      throw ConfigError("environment.image: the ranks need " + folder + " in their container, but a mount cannot "
                        "name a path with ':' in it; use a path without ':' (or rename the folder)");
    }
    mounts.push_back(folder + ":" + folder);
  }
  mounts.insert(mounts.end(), binds.begin(), binds.end());
  return mounts;
}

namespace {

// A mount of a runtime whose option takes a list of mounts split at ',' (Apptainer's and
// Singularity's --bind, pyxis' --container-mounts): a path with ',' would become two broken ones.
void require_no_comma(const std::string& mount, const std::string& option) {
  if (mount.find(',') == std::string::npos) return;
  throw ConfigError("environment.image: the ranks need " + mount + " in their container, but " + option +
                    " splits its mounts at ',' and cannot name a path with ',' in it; use a path without ','");
}

}  // namespace

std::vector<std::string> container_command(const core::Container& container, const ContainerCommandInput& in) {
  using R = core::Container::Runtime;
  std::vector<std::string> argv;
  if (container.runtime == R::kPodman) {
    // The host's network, shared memory and process ids: Open MPI's daemons and the ranks of
    // other containers reach each rank as if it ran on the host, and the launcher sees it.
    // The job's resource limits (locked memory for RDMA, open files) are the rank's too.
    argv = {"podman", "run", "--rm", "--net=host", "--ipc=host", "--pid=host", "--ulimit", "host",
            "--security-opt", "label=disable"};
    if (in.rootless) argv.push_back("--userns=keep-id");
    if (!in.attempt.empty()) argv.insert(argv.end(), {"--label", "hpctrial.attempt=" + in.attempt});
    if (in.gpus) argv.insert(argv.end(), {"--device", "nvidia.com/gpu=all"});
    for (const auto& mount : in.mounts) argv.insert(argv.end(), {"-v", mount});
    argv.insert(argv.end(), {"-w", in.working_dir});
    for (const auto& name : in.passed) argv.insert(argv.end(), {"-e", name});
  } else {
    // Apptainer and Singularity share the host's network, process ids and /dev/shm and pass
    // the environment by default.
    argv = {runtime_name(container.runtime), "exec"};
    if (in.gpus) argv.push_back("--nv");
    for (const auto& mount : in.mounts) {
      require_no_comma(mount, std::string(runtime_name(container.runtime)) + "'s --bind");
      argv.insert(argv.end(), {"--bind", mount});
    }
    argv.insert(argv.end(), {"--pwd", in.working_dir});
  }
  argv.push_back(container.image);
  return argv;
}

std::vector<std::string> pyxis_options(const core::Container& container, const ContainerCommandInput& in) {
  std::string mounts;
  for (const auto& mount : in.mounts) {
    require_no_comma(mount, "pyxis' --container-mounts");
    mounts += (mounts.empty() ? "" : ",") + mount;
  }
  std::vector<std::string> argv = {"--container-image=" + container.image};
  if (!mounts.empty()) argv.push_back("--container-mounts=" + mounts);
  argv.push_back("--container-workdir=" + in.working_dir);
  return argv;
}

void remove_left_containers(const core::Container& container,
                            const std::vector<std::pair<std::string, std::string>>& rank_env) {
  std::string attempt;
  for (const auto& [name, value] : rank_env) {
    if (name == core::kEnvAbortFile) attempt = value;
  }
  if (container.runtime != core::Container::Runtime::kPodman || attempt.empty()) return;
  core::RunOptions options;
  options.timeout = std::chrono::seconds(60);
  // Podman 4.3 can leave a container "stopping" when the processes that would record its end were
  // killed with the attempt (its `podman run --rm`, its conmon): the rank is gone, a removal right
  // then fails, and a later one removes it. So the attempt's containers are listed and removed
  // until none is left.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  std::string problem;
  std::vector<std::string> left;
  for (int round = 0;; ++round) {
    if (round > 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the first check follows at once
    const core::RunResult listed = core::run_process(
        {"podman", "ps", "--all", "--quiet", "--filter", "label=hpctrial.attempt=" + attempt}, options);
    if (!listed.ok()) {
      core::log_warning("cannot list this attempt's containers: {}: {}", listed.describe(), listed.err);
      return;
    }
    left.clear();
    for (std::size_t at = 0; at < listed.out.size();) {
      const auto end = listed.out.find('\n', at);
      const std::string id = listed.out.substr(at, end == std::string::npos ? std::string::npos : end - at);
      if (!id.empty()) left.push_back(id);
      at = end == std::string::npos ? listed.out.size() : end + 1;
    }
    if (left.empty()) return;
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::vector<std::string> argv = {"podman", "rm", "--force", "--ignore", "--time", "0"};
    argv.insert(argv.end(), left.begin(), left.end());
    const core::RunResult removed = core::run_process(argv, options);
    if (!removed.ok()) problem = removed.describe() + ": " + removed.err;
  }
  std::string ids;
  for (const auto& id : left) ids += " " + id;
  core::log_warning("this attempt's containers {} are still there after 30 s of removing them (podman rm: {}); "
                    "remove them with `podman rm --force{}`", ids.substr(1), problem.empty() ? "no error" : problem,
                    ids);
}

}  // namespace hpctrial::launcher::detail
