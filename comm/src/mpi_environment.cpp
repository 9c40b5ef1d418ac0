#include "hpctrial/comm/mpi_environment.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/comm/mpi_check.h"

namespace hpctrial::comm {
namespace {

constexpr auto kAbortGrace = std::chrono::seconds(3);

int to_mpi(MpiEnvironment::ThreadLevel level) {
  switch (level) {
    case MpiEnvironment::ThreadLevel::kSingle: return MPI_THREAD_SINGLE;
    case MpiEnvironment::ThreadLevel::kFunneled: return MPI_THREAD_FUNNELED;
    case MpiEnvironment::ThreadLevel::kSerialized: return MPI_THREAD_SERIALIZED;
    case MpiEnvironment::ThreadLevel::kMultiple: return MPI_THREAD_MULTIPLE;
  }
  return MPI_THREAD_SINGLE;
}

MpiEnvironment::ThreadLevel from_mpi(int level) {
  if (level >= MPI_THREAD_MULTIPLE) return MpiEnvironment::ThreadLevel::kMultiple;
  if (level >= MPI_THREAD_SERIALIZED) return MpiEnvironment::ThreadLevel::kSerialized;
  if (level >= MPI_THREAD_FUNNELED) return MpiEnvironment::ThreadLevel::kFunneled;
  return MpiEnvironment::ThreadLevel::kSingle;
}

const char* level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    default: return "MPI_THREAD_MULTIPLE";
  }
}

}  // namespace

MpiEnvironment::MpiEnvironment(ThreadLevel required) { init(nullptr, nullptr, required); }

MpiEnvironment::MpiEnvironment(int* argc, char*** argv, ThreadLevel required) {
  init(argc, argv, required);
}

void MpiEnvironment::init(int* argc, char*** argv, ThreadLevel required) {
  int initialized = 0;
  HPCTRIAL_MPI_CHECK(MPI_Initialized(&initialized));
  if (initialized) {
    throw CommError("MPI is already initialized: construct exactly one MpiEnvironment per "
                    "process, before any other MPI use");
  }
  int provided = MPI_THREAD_SINGLE;
  const int rc = MPI_Init_thread(argc, argv, to_mpi(required), &provided);
  if (rc != MPI_SUCCESS) {
    throw CommError("MPI_Init_thread failed (error code " + std::to_string(rc) +
                    "); is this program started by mpirun or the batch scheduler?");
  }
  // From here on, a failure must not leave MPI initialized without a finalizer: any throw
  // below goes through the catch, which finalizes.
  try {
    HPCTRIAL_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    if (provided < to_mpi(required)) {
      throw CommError(std::string("this MPI library provides ") + level_name(provided) +
                      " but " + level_name(to_mpi(required)) +
                      " was asked for; use an MPI built with thread support");
    }
    provided_ = from_mpi(provided);
    HPCTRIAL_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    HPCTRIAL_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
    MPI_Comm node = MPI_COMM_NULL;
    HPCTRIAL_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node));
    node_comm_ = MpiComm::adopt(node);
    HPCTRIAL_MPI_CHECK(MPI_Comm_rank(node_comm_.get(), &local_rank_));
    HPCTRIAL_MPI_CHECK(MPI_Comm_size(node_comm_.get(), &local_size_));

    // Nodes are numbered by their lowest world rank: count the node leaders before us.
    const int leader = local_rank_ == 0 ? 1 : 0;
    HPCTRIAL_MPI_CHECK(MPI_Allreduce(&leader, &node_count_, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
    int leaders_before = 0;
    HPCTRIAL_MPI_CHECK(MPI_Exscan(&leader, &leaders_before, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
    if (rank_ == 0) leaders_before = 0;  // MPI_Exscan leaves rank 0's result undefined
    node_index_ = leaders_before;
    HPCTRIAL_MPI_CHECK(MPI_Bcast(&node_index_, 1, MPI_INT, 0, node_comm_.get()));

    char name[MPI_MAX_PROCESSOR_NAME];
    int length = 0;
    HPCTRIAL_MPI_CHECK(MPI_Get_processor_name(name, &length));
    hostname_.assign(name, static_cast<std::size_t>(length));
  } catch (...) {
    node_comm_.reset();
    MPI_Finalize();
    throw;
  }
  core::set_log_rank(rank_);
}

MpiEnvironment::~MpiEnvironment() {
  node_comm_.reset();  // communicators are freed before MPI_Finalize
  const int rc = MPI_Finalize();
  if (rc != MPI_SUCCESS) core::log_error("MPI_Finalize failed with error code {}", rc);
  core::set_log_rank(-1);
}

void MpiEnvironment::abort(int code, const std::string& message) const noexcept {
  core::log_error("fatal on {}: {}; aborting the job", hostname_, message);
  // MPI_Abort asks mpirun to end the job and can wait for it (seen when mpirun could not print
  // its report): a failed rank must not wait, so it ends itself shortly whatever MPI does.
  try {
    std::thread([code] {
      std::this_thread::sleep_for(kAbortGrace);
      std::_Exit(code);
    }).detach();
  } catch (const std::exception&) {
    // no thread to be had: MPI_Abort alone
  }
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; this is in case a broken MPI does.
}

}  // namespace hpctrial::comm
