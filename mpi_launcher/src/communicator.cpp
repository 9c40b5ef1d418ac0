#include "hpctrial/mpi_launcher/communicator.h"

#include <algorithm>
#include <climits>

#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/mpi_launcher/mpi_check.h"

namespace hpctrial::mpi_launcher {
namespace {

MPI_Datatype to_mpi(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return MPI_FLOAT;
    case DType::kFloat64: return MPI_DOUBLE;
    case DType::kInt64: return MPI_INT64_T;
    case DType::kUInt8: return MPI_UINT8_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op to_mpi(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kMin: return MPI_MIN;
  }
  return MPI_OP_NULL;
}

// Messages are split into pieces of at most this many elements: MPI counts are ints, and
// shared-memory all-reduce is fastest around tens of MiB per message.
constexpr std::size_t kMaxPieceBytes = std::size_t{16} << 20;

}  // namespace

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

bool Communicator::any(bool local) {
  std::int64_t flag = local ? 1 : 0;
  allreduce(&flag, 1, DType::kInt64, ReduceOp::kMax);
  return flag != 0;
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm) {
  HPCTRIAL_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
  HPCTRIAL_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  HPCTRIAL_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  HPCTRIAL_MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

MpiCommunicator::~MpiCommunicator() {
  if (comm_ != MPI_COMM_NULL && MPI_Comm_free(&comm_) != MPI_SUCCESS) {
    core::log_warning("MPI_Comm_free of a communicator failed");
  }
}

void MpiCommunicator::allreduce(void* data, std::size_t count, DType dtype, ReduceOp op) {
  if (size_ == 1 || count == 0) return;
  const std::size_t element = dtype_size(dtype);
  const std::size_t piece = std::max<std::size_t>(1, kMaxPieceBytes / element);
  auto* bytes = static_cast<char*>(data);
  for (std::size_t done = 0; done < count; done += piece) {
    const auto n = static_cast<int>(std::min(piece, count - done));
    HPCTRIAL_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, bytes + done * element, n, to_mpi(dtype),
                                     to_mpi(op), comm_));
  }
}

void MpiCommunicator::broadcast(std::string& bytes, int root) {
  if (size_ == 1) return;
  std::uint64_t length = bytes.size();
  HPCTRIAL_MPI_CHECK(MPI_Bcast(&length, 1, MPI_UINT64_T, root, comm_));
  if (length > INT_MAX) throw CommError("broadcast of " + std::to_string(length) + " bytes: too large");
  bytes.resize(length);
  HPCTRIAL_MPI_CHECK(MPI_Bcast(bytes.data(), static_cast<int>(length), MPI_BYTE, root, comm_));
}

std::vector<std::string> MpiCommunicator::allgather(const std::string& bytes) {
  if (bytes.size() > INT_MAX) throw CommError("allgather of " + std::to_string(bytes.size()) + " bytes: too large");
  const int mine = static_cast<int>(bytes.size());
  std::vector<int> sizes(static_cast<std::size_t>(size_));
  HPCTRIAL_MPI_CHECK(MPI_Allgather(&mine, 1, MPI_INT, sizes.data(), 1, MPI_INT, comm_));
  std::vector<int> offsets(sizes.size());
  long long total = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    offsets[i] = static_cast<int>(total);
    total += sizes[i];
    if (total > INT_MAX) throw CommError("allgather of " + std::to_string(total) + " bytes: too large");
  }
  std::string all(static_cast<std::size_t>(total), '\0');
  HPCTRIAL_MPI_CHECK(MPI_Allgatherv(bytes.data(), mine, MPI_BYTE, all.data(), sizes.data(),
                                    offsets.data(), MPI_BYTE, comm_));
  std::vector<std::string> out;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    out.push_back(all.substr(static_cast<std::size_t>(offsets[i]), static_cast<std::size_t>(sizes[i])));
  }
  return out;
}

void MpiCommunicator::barrier() { HPCTRIAL_MPI_CHECK(MPI_Barrier(comm_)); }

}  // namespace hpctrial::mpi_launcher
