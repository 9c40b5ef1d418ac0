// The container each rank runs in (environment.image), in the hybrid model: the host's mpirun
// starts `hpctrial _rank` on each node, which starts the runtime, which runs the rank's program
// inside the image. The launcher, mpirun's daemons and the scheduler's commands stay on the
// host, so that requeue, pause and the stop signals work as they do without a container.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "hpctrial/core/env.h"
#include "hpctrial/core/experiment_config.h"

namespace hpctrial::launcher::detail {

// Set by the launcher for each rank's parent when the rank runs in a container (the runtime's
// name): the runtime reports a rank killed by signal N as exit code 128 + N, which the parent
// then records, and ends with, as that signal.
inline constexpr const char* kEnvRankContainer = "HPCTRIAL_RANK_CONTAINER";

// The folders and files the ranks need inside, each at its own path ("HOST:CONTAINER[:ro]"):
// the experiment directory, checkpoint_storage.host_path, the working directory, Open MPI's
// session directory ($TMPDIR, else /tmp), a library entrypoint's folder, data.stage's folder,
// each path of `data` that exists on this host, then environment.bind. A path inside another is
// left out; a bind replaces an automatic mount of the same destination.
std::vector<std::string> container_mounts(const core::ExperimentConfig& config, const std::string& experiment_dir,
                                          const std::string& working_dir, const core::EnvSource& env);

struct ContainerCommandInput {
  std::vector<std::string> mounts;  // container_mounts()
  // The variables the ranks need by name: podman passes only those (a trailing '*' matches a
  // prefix); apptainer and singularity pass the whole environment. Values never enter argv.
  std::vector<std::string> passed;
  std::string working_dir;
  bool gpus = false;      // resources.gpus_per_slot > 0
  bool rootless = false;  // podman as an ordinary user: --userns=keep-id keeps the user's ids
  // Labels each of the attempt's Podman containers (hpctrial.attempt=VALUE): its abort file,
  // which names the experiment, the trial and the attempt.
  std::string attempt;
};

// The runtime's words that go before the rank's program: `podman run ... IMAGE`,
// `apptainer exec ... IMAGE`.
std::vector<std::string> container_command(const core::Container& container, const ContainerCommandInput& input);

// pyxis' srun options for environment.container_runtime: enroot (launcher.mpi: srun): each task,
// the rank's parent included, runs in the image, with the same mounts and working directory; the
// task's environment enters the container as it is. ConfigError for a mount with ',' in it.
std::vector<std::string> pyxis_options(const core::Container& container, const ContainerCommandInput& input);

// Removes this host's Podman containers of an attempt that are left once it has ended: those
// whose processes the launcher killed together with the runtime's monitor (conmon), which would
// have removed them, and those Podman kept "stopping" a moment after their end. Returns once
// none is listed (or after 30 s of removing them). The attempt is named by its abort file in
// the ranks' `rank_env`. Logs a warning where Podman cannot; never throws.
void remove_left_containers(const core::Container& container,
                            const std::vector<std::pair<std::string, std::string>>& rank_env);

// The prefixes of the variables Open MPI, PMIx, the schedulers, CUDA, NCCL and hpctrial set for
// a rank, each with a trailing '*'.
const std::vector<std::string>& rank_variable_prefixes();

}  // namespace hpctrial::launcher::detail
