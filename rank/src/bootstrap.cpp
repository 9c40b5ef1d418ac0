#include "hpctrial/rank/bootstrap.h"

#include <iostream>

#include "hpctrial/comm/communicator.h"
#include "hpctrial/comm/mpi_environment.h"
#include "hpctrial/comm/watchdog.h"

namespace hpctrial::rank {

RankBootstrap::RankBootstrap(const core::EnvSource& env)
    : contract_(core::read_contract(env)), abort_watch_(contract_.abort_file) {}

RankBootstrap::~RankBootstrap() {
  communicator_.reset();
  watchdog_.reset();
  record_.reset();
  mpi_.reset();
}

void RankBootstrap::start_mpi(int* argc, char*** argv) {
  mpi_ = std::make_unique<comm::MpiEnvironment>(argc, argv);
}

void RankBootstrap::start_record() {
  if (!contract_.heartbeat_dir.empty()) record_ = std::make_unique<RankRecord>(contract_.heartbeat_dir, mpi_->rank());
}

bool RankBootstrap::alone() const { return mpi_->size() == 1; }

void RankBootstrap::start_communicator(std::chrono::milliseconds collective_timeout) {
  if (alone()) {
    communicator_ = std::make_unique<comm::LocalCommunicator>();
    return;
  }
  comm::Watchdog::Options watch;
  watch.timeout = collective_timeout;
  watch.exit_code = core::kExitFailed;
  watch.verdict_path = contract_.verdict_file;
  watch.phase = [] { return core::phase_name(current_phase()); };
  watchdog_ = std::make_unique<comm::Watchdog>(mpi_->world(), watch);
  watchdog_->add_abort_hook([] { record_watchdog_abort(); });
  communicator_ = std::make_unique<comm::MpiCommunicator>(mpi_->world(), watchdog_.get());
}

int RankBootstrap::fail(int code, const std::string& message) {
  record_abort(code, message);
  if (!mpi_ || alone()) {
    std::cerr << message << "\n";
    return code;
  }
  abort(code, message);
}

void RankBootstrap::abort(int code, const std::string& message) {
  record_abort(code, message);
  mpi_->abort(code, message);  // ends every rank
}

void RankBootstrap::finish() {
  if (watchdog_) watchdog_->finish();
}

}  // namespace hpctrial::rank
