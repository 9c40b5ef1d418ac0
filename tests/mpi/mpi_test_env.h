// The MPI world of an MPI test binary, set up by mpi_test_main.cpp.
#pragma once

#include "hpctrial/comm/mpi_environment.h"

namespace hpctrial::testing_mpi {
extern const comm::MpiEnvironment* g_environment;
inline const comm::MpiEnvironment& env() { return *g_environment; }
}  // namespace hpctrial::testing_mpi
