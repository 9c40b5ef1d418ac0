// The one registry of the schedulers hpctrial knows. A new scheduler (LSF, Flux) is a folder
// implementing core::Scheduler and one line in schedulers.cpp; nothing else names schedulers.
#pragma once

#include <string>
#include <vector>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/scheduler.h"

namespace hpctrial::launcher {

// Every scheduler, in the order the launcher asks whether it runs in one of their jobs; the last
// is `local` (this machine, `hpctrial run`), which every process runs in.
const std::vector<const core::Scheduler*>& schedulers();
// The scheduler named `name`; SchedulerError naming the known ones when there is none.
const core::Scheduler& scheduler(const std::string& name);
// The scheduler an experiment config asks for (scheduler.type).
const core::Scheduler& scheduler(const core::ExperimentConfig& config);
// The scheduler whose job ids have the form of `id`; nullptr when none has.
const core::Scheduler* scheduler_of_job(const std::string& id);

}  // namespace hpctrial::launcher
