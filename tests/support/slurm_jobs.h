// Commands against the local Slurm cluster of the slurm tier, and a job's fields as scontrol
// prints them.
#pragma once

#include <chrono>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "hpctrial/core/subprocess.h"

namespace hpctrial::testing_support {

// `argv` with a time limit, where mpirun may run as root.
inline core::RunResult run_command(const std::vector<std::string>& argv,
                                   std::chrono::seconds limit = std::chrono::seconds(60)) {
  core::RunOptions options;
  options.timeout = limit;
  options.env_set = {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}};
  return core::run_process(argv, options);
}

// The value of `field` in `scontrol show job JOB` ("" when absent).
inline std::string job_field(const std::string& job, const std::string& field) {
  const auto r = run_command({"scontrol", "-o", "show", "job", job});
  const std::size_t at = r.out.find(" " + field + "=");
  if (at == std::string::npos) return "";
  const std::size_t start = at + field.size() + 2;
  return r.out.substr(start, r.out.find(' ', start) - start);
}

// Waits until the job's JobState is `state`; false after `limit`.
// False at once when the job has ended in another state: it never gets there.
inline bool wait_for_state(const std::string& job, const std::string& state, std::chrono::seconds limit) {
  static const std::set<std::string> kEnded = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                               "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"};
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    const std::string now = job_field(job, "JobState");
    if (now == state) return true;
    if (kEnded.count(now) > 0) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  return false;
}

// The job id in `hpctrial submit`'s "submitted slurm job N" ("" when it says none).
inline std::string submitted_job(const std::string& out) {
  const std::string said = "submitted slurm job ";
  const auto at = out.find(said);
  if (at == std::string::npos) return "";
  const std::size_t start = at + said.size();
  return out.substr(start, out.find('\n', start) - start);
}

}  // namespace hpctrial::testing_support
