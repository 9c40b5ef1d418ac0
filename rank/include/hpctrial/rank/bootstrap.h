// How a rank the launcher started sets itself up, shared by trials (run_main) and Core API
// programs (CoreContext), so that both keep the launch contract (core/launch_contract.h) alike:
// the abort watch before MPI_Init, MPI, the rank's heartbeat record, the collective watchdog and
// the communicator over it, and one way to fail.
//
// A rank that fails records why and ends the job at once (MPI_Abort): it never waits for its
// peers, which may be waiting for it in a collective. The objects that own collectives (the
// watchdog's goodbye, communicators) therefore live while a failure is handled, and none of their
// destructors runs on the way.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "hpctrial/core/env.h"
#include "hpctrial/core/launch_contract.h"
#include "hpctrial/rank/runtime.h"

namespace hpctrial::comm {
class Communicator;
class MpiEnvironment;
class Watchdog;
}  // namespace hpctrial::comm

namespace hpctrial::rank {

class RankBootstrap {
 public:
  // Reads the launch contract (ConfigError for a bad one) and starts watching the abort file:
  // before MPI_Init, which can wait for peers too.
  explicit RankBootstrap(const core::EnvSource& env);
  ~RankBootstrap();
  RankBootstrap(const RankBootstrap&) = delete;
  RankBootstrap& operator=(const RankBootstrap&) = delete;

  // MPI_Init (Error when MPI cannot start).
  void start_mpi(int* argc, char*** argv);
  // The rank's heartbeat record, where the launcher asked for one (IoError naming the file when
  // it cannot be written).
  void start_record();
  // The communicator of the ranks' collectives: a local one alone; else MPI's, under a watchdog
  // that ends the job when a collective has not finished within `collective_timeout`.
  void start_communicator(std::chrono::milliseconds collective_timeout);

  const core::RankContract& contract() const { return contract_; }
  comm::MpiEnvironment& mpi() const { return *mpi_; }
  bool alone() const;
  comm::Communicator& communicator() const { return *communicator_; }
  comm::Watchdog* watchdog() const { return watchdog_.get(); }

  // Records that this rank fails with `code` and why, and ends every rank of the job. Alone,
  // prints the message and returns `code` (nothing else waits for this rank).
  int fail(int code, const std::string& message);
  // Records that this rank fails with `code` and why, and ends every rank of the job.
  [[noreturn]] void abort(int code, const std::string& message);
  // The collective end of a good run: every rank got here (the watchdog's goodbyes).
  void finish();

 private:
  core::RankContract contract_;
  AbortWatch abort_watch_;
  std::unique_ptr<comm::MpiEnvironment> mpi_;
  std::unique_ptr<RankRecord> record_;
  std::unique_ptr<comm::Watchdog> watchdog_;
  std::unique_ptr<comm::Communicator> communicator_;
};

}  // namespace hpctrial::rank
