// The PBS Professional / OpenPBS job a process runs in.
//
// job_allocation() returns nullopt outside a PBS job (no PBS_JOBID). Inside one it validates
// the job id, reads $PBS_NODEFILE (one line per chunk or per MPI process depending on the
// site) into hosts with their slots, in order of first appearance, and asks `qstat -f` for
// the run count (PBS puts none in the environment) and the start time and walltime, from
// which it computes when the job ends, and `qstat -Qf $PBS_QUEUE` for the queue's kill_delay,
// the time between PBS's SIGTERM and its SIGKILL. SchedulerError names what was wrong.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "hpctrial/core/allocation.h"
#include "hpctrial/core/env.h"

namespace hpctrial::pbs {

std::optional<core::Allocation> job_allocation(const core::EnvSource& env, const core::CommandRunner& run);

// The lines of a node file -> hosts with the number of lines naming each.
std::vector<core::Host> parse_node_file(const std::string& text, const std::string& path);

// Reads run_count, stime and Resource_List.walltime from `qstat -f` output into `a`.
void apply_qstat(const std::string& qstat_output, core::Allocation& a);

// Reads the queue's kill_delay from `qstat -Qf QUEUE` output into `a` (PBS's 10 s where the
// queue sets none).
void apply_queue(const std::string& qstat_output, core::Allocation& a);

bool is_valid_job_id(const std::string& id);

}  // namespace hpctrial::pbs
