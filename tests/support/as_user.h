// Commands run as the ordinary user of the container tests (rootless Podman), from the root that
// runs the test suite: a login's environment, and the local Slurm cluster's configuration.
#pragma once

#include <pwd.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "hpctrial/core/subprocess.h"

namespace hpctrial::testing_support {

inline std::string container_user() {
  const char* name = std::getenv("HPCTRIAL_CONTAINER_USER");
  return name != nullptr && *name != '\0' ? name : "pbsuser";
}

inline core::RunResult run_for(const std::vector<std::string>& argv, std::chrono::seconds limit) {
  core::RunOptions options;
  options.timeout = limit;
  return core::run_process(argv, options);
}

// `argv` as the user; `env`: NAME=value words added to its environment.
inline core::RunResult as_user(const std::vector<std::string>& argv, std::chrono::seconds limit = std::chrono::seconds(120),
                               const std::vector<std::string>& env = {}) {
  const std::string user = container_user();
  const passwd* pw = ::getpwnam(user.c_str());
  std::vector<std::string> full = {"runuser", "-u", user, "--", "env", "-i",
                                   "HOME=" + std::string(pw != nullptr ? pw->pw_dir : "/"), "USER=" + user,
                                   "LOGNAME=" + user, "PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"};
  if (const char* conf = std::getenv("SLURM_CONF")) full.push_back(std::string("SLURM_CONF=") + conf);
  full.insert(full.end(), env.begin(), env.end());
  full.insert(full.end(), argv.begin(), argv.end());
  return run_for(full, limit);
}

// Root and Podman, else why not ("" when both are there).
inline std::string container_tests_unavailable() {
  if (::geteuid() != 0) return "runs its jobs as " + container_user() + " and needs root to switch";
  if (!run_for({"sh", "-c", "command -v podman"}, std::chrono::seconds(30)).ok()) {
    return "podman is not installed (scripts/install-deps.sh installs it)";
  }
  return "";
}

// The user (made where missing), its rootless Podman set up, and IMAGE built as it with each
// PROGRAM[=PATH_IN_IMAGE] (tests/containers/prepare_podman.sh).
inline core::RunResult prepare_image(const std::string& image, const std::vector<std::string>& programs) {
  std::vector<std::string> argv = {HPCTRIAL_SOURCE_DIR "/tests/containers/prepare_podman.sh", container_user(), image};
  argv.insert(argv.end(), programs.begin(), programs.end());
  return run_for(argv, std::chrono::seconds(300));
}

// The user's Podman containers of `experiment` (by the attempt label the launcher gives each),
// one line each; other tests' containers are not counted.
inline std::string containers_of(const std::string& experiment) {
  const auto listed = as_user({"podman", "ps", "--all", "--format", "{{index .Labels \"hpctrial.attempt\"}}"},
                              std::chrono::seconds(60));
  if (!listed.ok()) return "podman ps failed: " + listed.describe() + " " + listed.err;
  std::string mine;
  for (std::size_t at = 0; at < listed.out.size();) {
    const auto end = listed.out.find('\n', at);
    const std::string line = listed.out.substr(at, end == std::string::npos ? std::string::npos : end - at);
    if (line.rfind(experiment + "/", 0) == 0) mine += line + "\n";
    at = end == std::string::npos ? listed.out.size() : end + 1;
  }
  return mine;
}

}  // namespace hpctrial::testing_support
