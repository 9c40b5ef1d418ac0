#include "hpctrial/comm/mpi_comm.h"

#include "hpctrial/comm/mpi_check.h"
#include "hpctrial/core/logging.h"

namespace hpctrial::comm {

MpiComm MpiComm::dup(MPI_Comm comm) {
  MPI_Comm copy = MPI_COMM_NULL;
  HPCTRIAL_MPI_CHECK(MPI_Comm_dup(comm, &copy));
  return adopt(copy);
}

MpiComm MpiComm::adopt(MPI_Comm comm) {
  MpiComm owned(comm);  // owned before anything can throw
  if (owned) HPCTRIAL_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
  return owned;
}

MpiComm& MpiComm::operator=(MpiComm&& other) noexcept {
  if (this != &other) {
    reset();
    comm_ = other.comm_;
    other.comm_ = MPI_COMM_NULL;
  }
  return *this;
}

void MpiComm::reset() noexcept {
  if (comm_ == MPI_COMM_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && MPI_Comm_free(&comm_) != MPI_SUCCESS) core::log_warning("MPI_Comm_free of a communicator failed");
  comm_ = MPI_COMM_NULL;
}

MpiOp MpiOp::create(MPI_User_function* function, bool commutative) {
  MPI_Op op = MPI_OP_NULL;
  HPCTRIAL_MPI_CHECK(MPI_Op_create(function, commutative ? 1 : 0, &op));
  return MpiOp(op);
}

MpiOp& MpiOp::operator=(MpiOp&& other) noexcept {
  if (this != &other) {
    reset();
    op_ = other.op_;
    other.op_ = MPI_OP_NULL;
  }
  return *this;
}

void MpiOp::reset() noexcept {
  if (op_ == MPI_OP_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && MPI_Op_free(&op_) != MPI_SUCCESS) core::log_warning("MPI_Op_free of a reduction failed");
  op_ = MPI_OP_NULL;
}

}  // namespace hpctrial::comm
