// The Slurm job a process runs in, read from the environment Slurm gives the batch shell.
//
// job_allocation() returns nullopt outside a Slurm job (no SLURM_JOB_ID). Inside one it
// validates the job id (digits, or digits_digits for an array task) and the node list before
// using them, expands the node list with `scontrol show hostnames`, pairs each host with its
// tasks from SLURM_TASKS_PER_NODE ("2(x3),1"), takes SLURM_RESTART_COUNT (unset on a first
// run) and asks `squeue` for the job's end time. SchedulerError names the variable or command
// and what was wrong.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "hpctrial/core/allocation.h"
#include "hpctrial/core/env.h"

namespace hpctrial::slurm {

std::optional<core::Allocation> job_allocation(const core::EnvSource& env, const core::CommandRunner& run);

// "2(x3),1" -> {2, 2, 2, 1}. SchedulerError on anything else.
std::vector<int> parse_tasks_per_node(const std::string& text);

// squeue's "%e" (local time, "2026-11-21T05:00:00"); nullopt for "N/A", "Unknown", "NONE".
std::optional<std::chrono::system_clock::time_point> parse_end_time(const std::string& text);

bool is_valid_job_id(const std::string& id);

}  // namespace hpctrial::slurm
