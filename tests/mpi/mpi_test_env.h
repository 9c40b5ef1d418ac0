// The MPI world of an MPI test binary, set up by mpi_test_main.cpp.
#pragma once

#include "hpctrial/mpi_launcher/mpi_environment.h"

namespace hpctrial::testing_mpi {
extern const mpi_launcher::MpiEnvironment* g_environment;
inline const mpi_launcher::MpiEnvironment& env() { return *g_environment; }
}  // namespace hpctrial::testing_mpi
