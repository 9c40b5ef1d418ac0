// The peer of benchmarks/startup: a trivial MPI program, whose rank 0 prints the wall-clock time
// once every rank has started MPI and met in a barrier - what `mpirun` alone costs.
#include <mpi.h>

#include <chrono>
#include <cstdio>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Barrier(MPI_COMM_WORLD);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    std::printf("first step ended at %lld\n",
                static_cast<long long>(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count()));
    std::fflush(stdout);
  }
  MPI_Finalize();
  return 0;
}
