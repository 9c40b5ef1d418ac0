#include "hpctrial/comm/communicator.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <mutex>
#include <vector>

#include "checks.h"
#include "float16.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/comm/mpi_check.h"
#include "hpctrial/comm/watchdog.h"

namespace hpctrial::comm {
namespace {

using detail::check_color;
using detail::check_reduction;
using detail::check_root;
using detail::is_floating;

// Messages are split into pieces of at most this many bytes: MPI counts are ints, and
// shared-memory all-reduce is fastest around tens of MiB per message.
constexpr std::size_t kMaxPieceBytes = std::size_t{16} << 20;

// 16-bit floats are reduced by user-defined operations on MPI_UINT16_T: widen, combine, round.
template <float (*Widen)(std::uint16_t), std::uint16_t (*Narrow)(float), ReduceOp Op>
void reduce16(void* in, void* inout, int* length, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *length; ++i) {
    const float x = Widen(a[i]), y = Widen(b[i]);
    float r;
    if constexpr (Op == ReduceOp::kMax) {
      r = std::max(x, y);
    } else if constexpr (Op == ReduceOp::kMin) {
      r = std::min(x, y);
    } else {
      r = x + y;
    }
    b[i] = Narrow(r);
  }
}

// The reductions of one 16-bit format: sum, max, min (MpiCommunicator::mpi_op's order).
template <float (*Widen)(std::uint16_t), std::uint16_t (*Narrow)(float)>
std::array<MpiOp, 3> reductions16() {
  return {MpiOp::create(&reduce16<Widen, Narrow, ReduceOp::kSum>, true),
          MpiOp::create(&reduce16<Widen, Narrow, ReduceOp::kMax>, true),
          MpiOp::create(&reduce16<Widen, Narrow, ReduceOp::kMin>, true)};
}

MPI_Datatype to_mpi(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return MPI_FLOAT;
    case DType::kFloat64: return MPI_DOUBLE;
    case DType::kFloat16:
    case DType::kBFloat16: return MPI_UINT16_T;
    case DType::kInt32: return MPI_INT32_T;
    case DType::kInt64: return MPI_INT64_T;
    case DType::kInt16: return MPI_INT16_T;
    case DType::kInt8: return MPI_INT8_T;
    case DType::kUInt8:
    case DType::kBool: return MPI_UINT8_T;  // max and min are or and and
  }
  return MPI_DATATYPE_NULL;
}

// MPI's built-in reduction for `op` (16-bit floats have their own: MpiCommunicator::mpi_op).
MPI_Op to_mpi(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return MPI_SUM;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kMin: return MPI_MIN;
  }
  return MPI_OP_NULL;
}

// Divides `count` values by `divisor` in place (the second half of an average).
void divide(void* data, std::size_t count, DType dtype, int divisor) {
  const float f = 1.0f / static_cast<float>(divisor);
  switch (dtype) {
    case DType::kFloat32:
      for (float *p = static_cast<float*>(data), *end = p + count; p != end; ++p) *p *= f;
      break;
    case DType::kFloat64:
      for (double *p = static_cast<double*>(data), *end = p + count; p != end; ++p) *p /= divisor;
      break;
    case DType::kFloat16:
      for (auto *p = static_cast<std::uint16_t*>(data), *end = p + count; p != end; ++p) {
        *p = detail::float_to_half(detail::half_to_float(*p) * f);
      }
      break;
    case DType::kBFloat16:
      for (auto *p = static_cast<std::uint16_t*>(data), *end = p + count; p != end; ++p) {
        *p = detail::float_to_bfloat16(detail::bfloat16_to_float(*p) * f);
      }
      break;
    default:
      throw InternalError("divide: not a floating-point type");
  }
}

// `mpi_op` is the MPI reduction of `op` for `dtype` (MpiCommunicator::mpi_op).
void allreduce_on(MPI_Comm comm, int size, void* data, std::size_t count, DType dtype, ReduceOp op, MPI_Op mpi_op) {
  const std::size_t element = dtype_size(dtype);
  const std::size_t piece = std::max<std::size_t>(1, kMaxPieceBytes / element);
  auto* bytes = static_cast<char*>(data);
  for (std::size_t done = 0; done < count; done += piece) {
    const auto n = static_cast<int>(std::min(piece, count - done));
    HPCTRIAL_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, bytes + done * element, n, to_mpi(dtype), mpi_op, comm));
  }
  if (op == ReduceOp::kAvg) divide(data, count, dtype, size);
}

void broadcast_on(MPI_Comm comm, void* data, std::size_t bytes, int root) {
  auto* p = static_cast<char*>(data);
  for (std::size_t done = 0; done < bytes; done += kMaxPieceBytes) {
    const auto n = static_cast<int>(std::min(kMaxPieceBytes, bytes - done));
    HPCTRIAL_MPI_CHECK(MPI_Bcast(p + done, n, MPI_BYTE, root, comm));
  }
}

// Where block `block` of a buffer of size-many blocks of `count` values starts.
char* block_of(void* data, int block, std::size_t count, std::size_t element) {
  return static_cast<char*>(data) + static_cast<std::size_t>(block) * count * element;
}

// Reduce-scatter in calls of at most kMaxPieceBytes in all: piece [off, off + n) of each block is
// packed into a contiguous buffer of size blocks when it is not the whole block, and received
// into a buffer of its own when `recv` lies in `send` (MPI has no in-place form for that).
void reduce_scatter_on(MPI_Comm comm, int rank, int size, const void* send, void* recv, std::size_t count,
                       DType dtype, ReduceOp op, MPI_Op mpi_op) {
  const std::size_t element = dtype_size(dtype);
  const std::size_t piece = std::max<std::size_t>(1, kMaxPieceBytes / (element * static_cast<std::size_t>(size)));
  const bool in_place = recv == block_of(const_cast<void*>(send), rank, count, element);
  std::vector<char> packed, received;
  for (std::size_t off = 0; off < count; off += piece) {
    const std::size_t n = std::min(piece, count - off);
    const char* in = static_cast<const char*>(send);
    if (n != count) {
      packed.resize(n * element * static_cast<std::size_t>(size));
      for (int b = 0; b < size; ++b) {
        std::memcpy(packed.data() + static_cast<std::size_t>(b) * n * element,
                    block_of(const_cast<void*>(send), b, count, element) + off * element, n * element);
      }
      in = packed.data();
    }
    char* out = static_cast<char*>(recv) + off * element;
    if (in_place) {
      received.resize(n * element);
      out = received.data();
    }
    HPCTRIAL_MPI_CHECK(MPI_Reduce_scatter_block(in, out, static_cast<int>(n), to_mpi(dtype), mpi_op, comm));
    if (in_place) std::memcpy(static_cast<char*>(recv) + off * element, received.data(), n * element);
  }
  if (op == ReduceOp::kAvg) divide(recv, count, dtype, size);
}

// All-gather in calls of at most kMaxPieceBytes in all: a piece of every block is gathered into a
// contiguous buffer and copied to its blocks when it is not the whole block.
void allgather_on(MPI_Comm comm, int rank, int size, const void* send, void* recv, std::size_t count, DType dtype) {
  const std::size_t element = dtype_size(dtype);
  const std::size_t piece = std::max<std::size_t>(1, kMaxPieceBytes / (element * static_cast<std::size_t>(size)));
  const bool in_place = send == block_of(recv, rank, count, element);
  if (count <= piece) {
    const auto n = static_cast<int>(count);
    HPCTRIAL_MPI_CHECK(MPI_Allgather(in_place ? MPI_IN_PLACE : send, in_place ? 0 : n,
                                     in_place ? MPI_DATATYPE_NULL : to_mpi(dtype), recv, n, to_mpi(dtype), comm));
    return;
  }
  std::vector<char> gathered;
  for (std::size_t off = 0; off < count; off += piece) {
    const std::size_t n = std::min(piece, count - off);
    gathered.resize(n * element * static_cast<std::size_t>(size));
    HPCTRIAL_MPI_CHECK(MPI_Allgather(static_cast<const char*>(send) + off * element, static_cast<int>(n),
                                     to_mpi(dtype), gathered.data(), static_cast<int>(n), to_mpi(dtype), comm));
    for (int b = 0; b < size; ++b) {
      if (b == rank && in_place) continue;  // already there
      std::memcpy(block_of(recv, b, count, element) + off * element,
                  gathered.data() + static_cast<std::size_t>(b) * n * element, n * element);
    }
  }
}

}  // namespace

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "unknown";
}

// --- MpiCommunicator ----------------------------------------------------------------------------

// An async collective: queued by the caller, run by the worker thread.
class MpiCommunicator::Task final : public Work {
 public:
  Task(Watchdog* watchdog, const char* operation, std::uint64_t channel, std::uint64_t bytes,
       std::function<void(MPI_Comm)> run)
      : watchdog_(watchdog), id_(watchdog ? watchdog->enter(operation, channel, bytes) : 0), run_(std::move(run)) {}

  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!finished_.wait_for(lock, timeout, [&] { return done_; })) return false;
    if (!error_.empty()) throw CommError(error_);
    return true;
  }

  // Runs it, or fails it with `earlier_error` without running. Returns the error, if any.
  std::string execute(MPI_Comm comm, const std::string& earlier_error) {
    std::string error = earlier_error;
    if (error.empty()) {
      try {
        run_(comm);
      } catch (const std::exception& e) {
        error = e.what();
      }
    } else {
      error = "not run: an earlier collective on this communicator failed: " + error;
    }
    if (watchdog_) watchdog_->leave(id_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      error_ = error;
      done_ = true;
    }
    finished_.notify_all();
    return error;
  }

 private:
  Watchdog* watchdog_;
  std::uint64_t id_;
  std::function<void(MPI_Comm)> run_;
  std::mutex mutex_;
  std::condition_variable finished_;
  bool done_ = false;
  std::string error_;
};

MpiCommunicator::MpiCommunicator(MPI_Comm comm, Watchdog* watchdog)
    : MpiCommunicator(comm, watchdog, Watchdog::kWorld) {}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, Watchdog* watchdog, std::uint64_t channel)
    : comm_(MpiComm::dup(comm)),
      async_comm_(MpiComm::dup(comm)),
      message_comm_(MpiComm::dup(comm)),
      watchdog_(watchdog),
      channel_(channel) {
  HPCTRIAL_MPI_CHECK(MPI_Comm_rank(comm_.get(), &rank_));
  HPCTRIAL_MPI_CHECK(MPI_Comm_size(comm_.get(), &size_));
  half_ops_ = reductions16<detail::half_to_float, detail::float_to_half>();
  bfloat_ops_ = reductions16<detail::bfloat16_to_float, detail::float_to_bfloat16>();
  if (watchdog_ == nullptr) return;
  watchdog_->join_channel(channel_);
  world_ranks_ = detail::world_ranks(comm_.get(), watchdog_->world());
}

std::uint64_t MpiCommunicator::next_split_channel(int color) {
  return Watchdog::group_channel(channel_, splits_++, color);
}

MpiCommunicator::~MpiCommunicator() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (worker_.joinable()) worker_.join();  // then the members free both communicators and the reductions
}

MPI_Op MpiCommunicator::mpi_op(DType dtype, ReduceOp op) const {
  const std::size_t index = op == ReduceOp::kMax ? 1 : op == ReduceOp::kMin ? 2 : 0;
  if (dtype == DType::kFloat16) return half_ops_[index].get();
  if (dtype == DType::kBFloat16) return bfloat_ops_[index].get();
  return to_mpi(op);
}

WorkHandle MpiCommunicator::enqueue(const char* operation, std::uint64_t bytes, std::function<void(MPI_Comm)> run) {
  auto task = std::make_shared<Task>(watchdog_, operation, channel_, bytes, std::move(run));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
    queue_.push_back(task);
  }
  wake_.notify_one();
  return task;
}

void MpiCommunicator::worker_loop() {
  std::string failed;  // once one collective fails, the rest cannot match across ranks
  while (true) {
    std::shared_ptr<Task> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    const std::string error = task->execute(async_comm_.get(), failed);
    if (failed.empty()) failed = error;
  }
}

WorkHandle MpiCommunicator::allreduce_async(void* data, std::size_t count, DType dtype, ReduceOp op) {
  check_reduction(dtype, op);
  if (size_ == 1 || count == 0) return completed_work();
  const int size = size_;
  const MPI_Op reduction = mpi_op(dtype, op);
  return enqueue("allreduce", count * dtype_size(dtype), [=](MPI_Comm comm) { allreduce_on(comm, size, data, count, dtype, op, reduction); });
}

WorkHandle MpiCommunicator::broadcast_async(void* data, std::size_t bytes, int root) {
  check_root(root, size_, "broadcast");
  if (size_ == 1 || bytes == 0) return completed_work();
  return enqueue("broadcast", bytes, [=](MPI_Comm comm) { broadcast_on(comm, data, bytes, root); });
}

WorkHandle MpiCommunicator::reduce_scatter_async(const void* send, void* recv, std::size_t count, DType dtype,
                                                 ReduceOp op) {
  check_reduction(dtype, op);
  if (size_ == 1) return LocalCommunicator().reduce_scatter_async(send, recv, count, dtype, op);
  if (count == 0) return completed_work();
  const int rank = rank_, size = size_;
  const MPI_Op reduction = mpi_op(dtype, op);
  return enqueue("reduce_scatter", count * dtype_size(dtype), [=](MPI_Comm comm) {
    reduce_scatter_on(comm, rank, size, send, recv, count, dtype, op, reduction);
  });
}

WorkHandle MpiCommunicator::allgather_async(const void* send, void* recv, std::size_t count, DType dtype) {
  if (size_ == 1) return LocalCommunicator().allgather_async(send, recv, count, dtype);
  if (count == 0) return completed_work();
  const int rank = rank_, size = size_;
  return enqueue("allgather", count * dtype_size(dtype), [=](MPI_Comm comm) { allgather_on(comm, rank, size, send, recv, count, dtype); });
}

void MpiCommunicator::reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) {
  check_reduction(dtype, op);
  if (size_ == 1) return LocalCommunicator().reduce_scatter(send, recv, count, dtype, op);
  if (count == 0) return;
  Watchdog::Scope watch(watchdog_, "reduce_scatter", channel_, count * dtype_size(dtype));
  reduce_scatter_on(comm_.get(), rank_, size_, send, recv, count, dtype, op, mpi_op(dtype, op));
}

void MpiCommunicator::allgather(const void* send, void* recv, std::size_t count, DType dtype) {
  if (size_ == 1) return LocalCommunicator().allgather(send, recv, count, dtype);
  if (count == 0) return;
  Watchdog::Scope watch(watchdog_, "allgather", channel_, count * dtype_size(dtype));
  allgather_on(comm_.get(), rank_, size_, send, recv, count, dtype);
}

void MpiCommunicator::allreduce(void* data, std::size_t count, DType dtype, ReduceOp op) {
  check_reduction(dtype, op);
  if (size_ == 1 || count == 0) return;
  Watchdog::Scope watch(watchdog_, "allreduce", channel_, count * dtype_size(dtype));
  allreduce_on(comm_.get(), size_, data, count, dtype, op, mpi_op(dtype, op));
}

void MpiCommunicator::broadcast(std::string& bytes, int root) {
  check_root(root, size_, "broadcast");
  if (size_ == 1) return;
  Watchdog::Scope watch(watchdog_, "broadcast", channel_, rank_ == root ? bytes.size() : 0);
  std::uint64_t length = bytes.size();
  HPCTRIAL_MPI_CHECK(MPI_Bcast(&length, 1, MPI_UINT64_T, root, comm_.get()));
  bytes.resize(length);
  broadcast_on(comm_.get(), bytes.data(), length, root);
}

std::vector<std::string> MpiCommunicator::allgather(const std::string& bytes) {
  if (bytes.size() > INT_MAX) throw CommError("allgather of " + std::to_string(bytes.size()) + " bytes: too large");
  Watchdog::Scope watch(watchdog_, "allgather", channel_, bytes.size());
  const int mine = static_cast<int>(bytes.size());
  std::vector<int> sizes(static_cast<std::size_t>(size_));
  HPCTRIAL_MPI_CHECK(MPI_Allgather(&mine, 1, MPI_INT, sizes.data(), 1, MPI_INT, comm_.get()));
  std::vector<int> offsets(sizes.size());
  long long total = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    offsets[i] = static_cast<int>(total);
    total += sizes[i];
    if (total > INT_MAX) throw CommError("allgather of " + std::to_string(total) + " bytes: too large");
  }
  std::string all(static_cast<std::size_t>(total), '\0');
  HPCTRIAL_MPI_CHECK(MPI_Allgatherv(bytes.data(), mine, MPI_BYTE, all.data(), sizes.data(),
                                    offsets.data(), MPI_BYTE, comm_.get()));
  std::vector<std::string> out;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    out.push_back(all.substr(static_cast<std::size_t>(offsets[i]), static_cast<std::size_t>(sizes[i])));
  }
  return out;
}

std::vector<std::string> MpiCommunicator::gather(const std::string& bytes, int root) {
  check_root(root, size_, "gather");
  if (bytes.size() > INT_MAX) throw CommError("gather of " + std::to_string(bytes.size()) + " bytes: too large");
  Watchdog::Scope watch(watchdog_, "gather", channel_, bytes.size());
  // Every rank learns the total first, so that all of them refuse a gather too large together.
  std::int64_t total = static_cast<std::int64_t>(bytes.size());
  HPCTRIAL_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &total, 1, MPI_INT64_T, MPI_SUM, comm_.get()));
  if (total > INT_MAX) throw CommError("gather of " + std::to_string(total) + " bytes: too large");
  const int mine = static_cast<int>(bytes.size());
  const bool at_root = rank_ == root;
  std::vector<int> sizes(at_root ? static_cast<std::size_t>(size_) : 0);
  HPCTRIAL_MPI_CHECK(MPI_Gather(&mine, 1, MPI_INT, sizes.data(), 1, MPI_INT, root, comm_.get()));
  std::vector<int> offsets(sizes.size());
  int offset = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    offsets[i] = offset;
    offset += sizes[i];
  }
  std::string all(static_cast<std::size_t>(offset), '\0');
  HPCTRIAL_MPI_CHECK(MPI_Gatherv(bytes.data(), mine, MPI_BYTE, all.data(), sizes.data(), offsets.data(),
                                 MPI_BYTE, root, comm_.get()));
  std::vector<std::string> out;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    out.push_back(all.substr(static_cast<std::size_t>(offsets[i]), static_cast<std::size_t>(sizes[i])));
  }
  return out;
}

void MpiCommunicator::barrier() {
  Watchdog::Scope watch(watchdog_, "barrier", channel_);
  HPCTRIAL_MPI_CHECK(MPI_Barrier(comm_.get()));
}

void MpiCommunicator::set_step(std::int64_t step) {
  if (watchdog_) watchdog_->set_step(step);
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  check_color(color);
  MPI_Comm group = MPI_COMM_NULL;
  {
    Watchdog::Scope watch(watchdog_, "split", channel_);
    HPCTRIAL_MPI_CHECK(MPI_Comm_split(comm_.get(), color, key, &group));
  }
  const MpiComm owned = MpiComm::adopt(group);  // the new communicator holds duplicates
  return std::make_unique<MpiCommunicator>(owned.get(), watchdog_, next_split_channel(color));
}

}  // namespace hpctrial::comm
