#include "hpctrial/comm/mpi_check.h"

#include <string>

#include "hpctrial/core/error.h"

namespace hpctrial::comm {

void check_mpi(int rc, const char* expression, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) length = 0;
  int rank = -1;
  int initialized = 0;
  MPI_Initialized(&initialized);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::string message = "MPI call failed";
  if (rank >= 0) message += " on rank " + std::to_string(rank);
  message += ": " + std::string(expression) + " at " + file + ":" + std::to_string(line) + ": " +
             (length > 0 ? std::string(text, static_cast<std::size_t>(length))
                         : "error code " + std::to_string(rc));
  throw CommError(message);
}

}  // namespace hpctrial::comm
