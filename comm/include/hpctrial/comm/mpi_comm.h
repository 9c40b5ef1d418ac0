// An owned MPI communicator: freed with MPI_Comm_free when the handle goes, once; and MpiOp, an
// owned user-defined reduction, freed the same way with MPI_Op_free.
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

// An owned user-defined reduction: freed with MPI_Op_free when the handle goes, once. Move-only;
// a handle still alive after MPI_Finalize frees nothing; the destructor never throws.
class MpiOp {
 public:
  MpiOp() = default;
  // MPI_Op_create of `function` (commutative or not). Throws CommError.
  static MpiOp create(MPI_User_function* function, bool commutative);

  ~MpiOp() { reset(); }
  MpiOp(MpiOp&& other) noexcept : op_(other.op_) { other.op_ = MPI_OP_NULL; }
  MpiOp& operator=(MpiOp&& other) noexcept;
  MpiOp(const MpiOp&) = delete;
  MpiOp& operator=(const MpiOp&) = delete;

  MPI_Op get() const { return op_; }
  explicit operator bool() const { return op_ != MPI_OP_NULL; }
  // Frees the operation now (before MPI_Finalize); logs a failure, never throws.
  void reset() noexcept;

 private:
  explicit MpiOp(MPI_Op op) : op_(op) {}

  MPI_Op op_ = MPI_OP_NULL;
};

}  // namespace hpctrial::comm
