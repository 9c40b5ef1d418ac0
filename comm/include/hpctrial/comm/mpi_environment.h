// The MPI world of one rank: owns MPI_Init_thread and MPI_Finalize.
//
// Construct exactly one MpiEnvironment per process, first thing in main(). Rank, world size,
// local rank (ranks sharing this node, MPI_Comm_split_type SHARED), node count and node index
// come from MPI itself, never from launcher variables. MPI_COMM_WORLD is switched to
// MPI_ERRORS_RETURN so failures become CommError (see mpi_check.h) instead of silent aborts.
//
// A fatal error on one rank must end the whole job: call abort(), which logs the rank, host
// and cause and calls MPI_Abort. Never MPI_Finalize then exit(1): the other ranks would wait
// forever.
//
// Not copyable or movable. Accessors are thread-safe (immutable after construction).
// The constructor throws CommError; the destructor never throws (it logs).
#pragma once

#include <mpi.h>

#include <string>

#include "hpctrial/comm/mpi_comm.h"

namespace hpctrial::comm {

class MpiEnvironment {
 public:
  // Thread support asked of MPI. kMultiple lets communication threads (gradient buckets, the
  // watchdog) call MPI while the training thread does.
  enum class ThreadLevel { kSingle, kFunneled, kSerialized, kMultiple };

  explicit MpiEnvironment(ThreadLevel required = ThreadLevel::kMultiple);
  MpiEnvironment(int* argc, char*** argv, ThreadLevel required = ThreadLevel::kMultiple);
  ~MpiEnvironment();
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  int node_count() const { return node_count_; }
  int node_index() const { return node_index_; }
  bool is_chief() const { return rank_ == 0; }
  const std::string& hostname() const { return hostname_; }
  ThreadLevel thread_level() const { return provided_; }

  MPI_Comm world() const { return MPI_COMM_WORLD; }
  // Ranks on this node, ordered by world rank. Owned here; freed before MPI_Finalize.
  MPI_Comm node() const { return node_comm_.get(); }

  // Logs "fatal: <message>" with rank and host, then ends every rank of the job with `code`.
  [[noreturn]] void abort(int code, const std::string& message) const noexcept;

 private:
  void init(int* argc, char*** argv, ThreadLevel required);

  int rank_ = 0;
  int size_ = 1;
  int local_rank_ = 0;
  int local_size_ = 1;
  int node_count_ = 1;
  int node_index_ = 0;
  std::string hostname_;
  ThreadLevel provided_ = ThreadLevel::kSingle;
  MpiComm node_comm_;
};

}  // namespace hpctrial::comm
