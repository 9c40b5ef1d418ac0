// The checked wrapper for MPI calls: HPCTRIAL_MPI_CHECK(MPI_Bcast(...)) throws CommError with
// the call, file:line, the rank and MPI_Error_string's text when the call does not return
// MPI_SUCCESS. Communicators made by hpctrial use MPI_ERRORS_RETURN so errors reach here.
#pragma once

#include <mpi.h>

namespace hpctrial::comm {

// Takes MPI's own return type (int), so only MPI return codes are passed here.
void check_mpi(int rc, const char* expression, const char* file, int line);

}  // namespace hpctrial::comm

#define HPCTRIAL_MPI_CHECK(expression) \
  ::hpctrial::comm::check_mpi((expression), #expression, __FILE__, __LINE__)
