// Under mpirun: the rank named by argv[1] ends the job through MpiEnvironment::abort with the
// code in argv[2]; the other ranks wait in a barrier that would hang forever without it.
#include <cstdlib>
#include <string>

#include "hpctrial/mpi_launcher/mpi_environment.h"

int main(int argc, char** argv) {
  hpctrial::mpi_launcher::MpiEnvironment environment(&argc, &argv);
  const int failing_rank = argc > 1 ? std::atoi(argv[1]) : 1;
  const int code = argc > 2 ? std::atoi(argv[2]) : 7;
  if (environment.rank() == failing_rank) {
    environment.abort(code, "injected failure: the data file vanished");
  }
  MPI_Barrier(environment.world());
  MPI_Barrier(environment.world());
  return 0;
}
