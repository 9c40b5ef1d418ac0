// An owned MPI communicator: freed with MPI_Comm_free when the handle goes, once.
//
// Move-only, like std::unique_ptr. dup() makes the private communicators hpctrial talks on (the
// collectives, the watchdog, the background queue), each switched to MPI_ERRORS_RETURN so that
// failures become CommError; adopt() takes one MPI made (MPI_Comm_split_type). A handle still
// alive after MPI_Finalize frees nothing (MPI forbids it); the destructor never throws.
#pragma once

#include <mpi.h>

namespace hpctrial::comm {

class MpiComm {
 public:
  MpiComm() = default;
  // A duplicate of `comm` with MPI_ERRORS_RETURN. Throws CommError.
  static MpiComm dup(MPI_Comm comm);
  // Takes ownership of `comm` (MPI_COMM_NULL: an empty handle) and sets MPI_ERRORS_RETURN on it.
  static MpiComm adopt(MPI_Comm comm);

  ~MpiComm() { reset(); }
  MpiComm(MpiComm&& other) noexcept : comm_(other.comm_) { other.comm_ = MPI_COMM_NULL; }
  MpiComm& operator=(MpiComm&& other) noexcept;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  MPI_Comm get() const { return comm_; }
  explicit operator bool() const { return comm_ != MPI_COMM_NULL; }
  // Frees the communicator now (before MPI_Finalize); logs a failure, never throws.
  void reset() noexcept;

 private:
  explicit MpiComm(MPI_Comm comm) : comm_(comm) {}

  MPI_Comm comm_ = MPI_COMM_NULL;
};

}  // namespace hpctrial::comm
