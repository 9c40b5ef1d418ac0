// The MPI world of an MPI test binary, set up by mpi_test_main.cpp, and a directory its ranks share.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/mpi_environment.h"

namespace hpctrial::testing_mpi {
extern const comm::MpiEnvironment* g_environment;
inline const comm::MpiEnvironment& env() { return *g_environment; }

// A fresh directory under the temporary directory, made by the chief, named on every rank.
inline std::string shared_dir(const std::string& prefix, const std::string& name) {
  std::string dir;
  if (env().is_chief()) {
    dir = (std::filesystem::temp_directory_path() / (prefix + "-" + std::to_string(::getpid()) + "-" + name)).string();
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  comm::MpiCommunicator comm(env().world());
  comm.broadcast(dir, 0);
  return dir;
}
}  // namespace hpctrial::testing_mpi
