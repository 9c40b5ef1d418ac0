// What a batch scheduler gave a job, in terms every part of hpctrial understands.
//
// The launcher asks each scheduler's job environment (slurm/, pbs/) whether it runs inside one
// of its jobs; the answer is an Allocation: the scheduler's name, the job id, the hosts with
// their slots, how often the job was started before, and when its time runs out. Outside any
// job, the allocation is this machine ("local"). Plain values.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "hpctrial/core/subprocess.h"

namespace hpctrial::core {

struct Host {
  std::string name;
  int slots = 1;
};

struct Allocation {
  std::string scheduler = "local";  // the scheduler's name: "slurm", "pbs"; "local" outside a job
  std::string job_id;              // empty outside a job
  std::vector<Host> hosts;         // empty: this machine only
  int restart_count = 0;           // how many times the scheduler started this job before
  // When the scheduler ends the job (its time limit), if known.
  std::optional<std::chrono::system_clock::time_point> end_time;
  // How long the scheduler waits between its SIGTERM to the job's processes and its SIGKILL,
  // where known (PBS: the queue's kill_delay).
  std::optional<int> kill_delay_seconds;

  bool in_job() const { return scheduler != "local"; }
  int total_slots() const;
};


// Host names as schedulers print them: letters, digits, '-', '.', '_'; at most 253 characters.
bool is_valid_host_name(const std::string& name);

}  // namespace hpctrial::core
