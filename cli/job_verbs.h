// What the job verbs share: the job of an experiment, recorded in its experiment.json.
#pragma once

#include <string>

#include "hpctrial/mpi_launcher/launcher.h"

namespace hpctrial::cli {

// The id of the experiment's latest batch job; empty when it has none.
std::string job_of_experiment(const mpi_launcher::ExperimentLayout& layout);
// Records a newly submitted job as the experiment's latest, and in its list of jobs.
void record_job(const mpi_launcher::ExperimentLayout& layout, const std::string& scheduler, const std::string& id);

}  // namespace hpctrial::cli
