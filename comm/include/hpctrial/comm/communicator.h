// Collectives across the ranks of a trial.
//
// The trainer talks to other ranks only through a Communicator, so it never learns how the
// ranks are connected. MpiCommunicator works on host memory (the CPU path); NcclCommunicator
// (nccl_communicator.h) on device memory; LocalCommunicator is the world of one rank, where
// every collective is a no-op. Every rank must call the same collectives in the same order -
// the trainer guarantees this by taking decisions at step boundaries only.
//
// The *_async variants return at once with a Work handle; the operation runs in the
// background, in the order the calls were made, and the caller keeps the buffer alive and
// untouched until wait() has returned true. Synchronous calls may be made while async ones are
// in flight (they travel on a communicator of their own).
//
// One thread issues collectives on a communicator at a time. Failures throw CommError naming
// the operation and the rank; an async failure is thrown from wait().
#pragma once

#include <mpi.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hpctrial/comm/mpi_comm.h"
#include "hpctrial/core/dtype.h"

namespace hpctrial::comm {

class Watchdog;

enum class ReduceOp { kSum, kAvg, kMax, kMin };
// kFloat16 and kBFloat16 are reduced in float32 and rounded to nearest even.
using core::DType;
using core::dtype_size;
using core::to_string;
const char* to_string(ReduceOp op);

// A collective in flight.
class Work {
 public:
  virtual ~Work() = default;
  // Waits at most `timeout`; true when the operation has finished on this rank. Throws
  // CommError when it failed.
  virtual bool wait(std::chrono::milliseconds timeout) = 0;
  // Waits until it has finished (the watchdog bounds how long a collective may take).
  void wait();
};
using WorkHandle = std::shared_ptr<Work>;
// A Work that has already finished (what a world of one rank returns).
WorkHandle completed_work();

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  bool is_chief() const { return rank() == 0; }

  // Element-wise reduction of `count` values at `data` across all ranks, in place. kAvg
  // divides the sum by the number of ranks (floating-point types only).
  virtual WorkHandle allreduce_async(void* data, std::size_t count, DType dtype, ReduceOp op) = 0;
  // `bytes` bytes at `data` on every rank become those of `root`.
  virtual WorkHandle broadcast_async(void* data, std::size_t bytes, int root) = 0;

  // Rank r receives in `recv` the element-wise reduction, over every rank, of block r of `send`,
  // which holds size() blocks of `count` values (ZeRO's gradient shards). `recv` may be block
  // rank() of `send` (in place); it must not overlap another block.
  virtual WorkHandle reduce_scatter_async(const void* send, void* recv, std::size_t count, DType dtype,
                                          ReduceOp op) = 0;
  // The `count` values at `send` of rank r land in block r of `recv` (size() blocks of `count`)
  // on every rank. `send` may be block rank() of `recv` (in place).
  virtual WorkHandle allgather_async(const void* send, void* recv, std::size_t count, DType dtype) = 0;

  virtual void allreduce(void* data, std::size_t count, DType dtype, ReduceOp op) {
    allreduce_async(data, count, dtype, op)->wait();
  }
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) {
    reduce_scatter_async(send, recv, count, dtype, op)->wait();
  }
  virtual void allgather(const void* send, void* recv, std::size_t count, DType dtype) {
    allgather_async(send, recv, count, dtype)->wait();
  }
  // `bytes` on every rank becomes the value it has on `root` (sizes may differ before).
  virtual void broadcast(std::string& bytes, int root) = 0;
  // Every rank's `bytes`, in rank order (sizes may differ).
  virtual std::vector<std::string> allgather(const std::string& bytes) = 0;
  // Every rank's `bytes` in rank order on `root`; an empty vector elsewhere.
  virtual std::vector<std::string> gather(const std::string& bytes, int root) = 0;
  virtual void barrier() = 0;

  // The training step the following collectives belong to: named by the watchdog.
  virtual void set_step(std::int64_t /*step*/) {}

  // As MPI_Comm_split: a communicator of the ranks that pass the same `color` (0 or more),
  // ranked by `key` and then by rank here; a collective of this communicator. The new one is of
  // the same kind (host or device) and reports to the same watchdog. Model parallelism talks
  // over such groups: the ranks that hold one part of the model, the ranks that hold one copy.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  // Conveniences built on the above.
  void allreduce(std::vector<double>& values, ReduceOp op) {
    allreduce(values.data(), values.size(), DType::kFloat64, op);
  }
  // True on every rank when it is true on any rank: how ranks agree to stop, validate or
  // checkpoint at the same step.
  bool any(bool local);
};

class LocalCommunicator final : public Communicator {
 public:
  using Communicator::allreduce;
  int rank() const override { return 0; }
  int size() const override { return 1; }
  WorkHandle allreduce_async(void*, std::size_t, DType dtype, ReduceOp op) override;
  WorkHandle broadcast_async(void*, std::size_t, int root) override;
  WorkHandle reduce_scatter_async(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) override;
  WorkHandle allgather_async(const void* send, void* recv, std::size_t count, DType dtype) override;
  void broadcast(std::string&, int root) override;
  using Communicator::allgather;
  std::vector<std::string> allgather(const std::string& bytes) override { return {bytes}; }
  std::vector<std::string> gather(const std::string& bytes, int root) override;
  void barrier() override {}
  std::unique_ptr<Communicator> split(int color, int key) override;
};

// Host-memory collectives over MPI. Owns two duplicates of the given communicator (so
// hpctrial's traffic never matches a user's messages): one for the calling thread's
// synchronous collectives, one for a background thread that runs the async ones in order.
// With a Watchdog, every collective is reported to it. Not copyable.
class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm, Watchdog* watchdog = nullptr);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;
  using Communicator::allreduce;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  WorkHandle allreduce_async(void* data, std::size_t count, DType dtype, ReduceOp op) override;
  WorkHandle broadcast_async(void* data, std::size_t bytes, int root) override;
  WorkHandle reduce_scatter_async(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) override;
  WorkHandle allgather_async(const void* send, void* recv, std::size_t count, DType dtype) override;
  void allreduce(void* data, std::size_t count, DType dtype, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) override;
  void allgather(const void* send, void* recv, std::size_t count, DType dtype) override;
  void broadcast(std::string& bytes, int root) override;
  std::vector<std::string> allgather(const std::string& bytes) override;
  std::vector<std::string> gather(const std::string& bytes, int root) override;
  void barrier() override;
  void set_step(std::int64_t step) override;
  std::unique_ptr<Communicator> split(int color, int key) override;
  MPI_Comm comm() const { return comm_.get(); }

 private:
  class Task;
  WorkHandle enqueue(const char* operation, std::function<void(MPI_Comm)> run);
  void worker_loop();
  // The reduction of `op` for `dtype`: MPI's own, or one of ours for 16-bit floats.
  MPI_Op mpi_op(DType dtype, ReduceOp op) const;

  MpiComm comm_;        // synchronous collectives, caller's thread
  MpiComm async_comm_;  // async collectives, worker thread
  int rank_ = 0;
  int size_ = 1;
  Watchdog* watchdog_ = nullptr;
  // 16-bit float reductions (sum, max, min), freed with the communicator after its worker stops.
  std::array<MpiOp, 3> half_ops_;
  std::array<MpiOp, 3> bfloat_ops_;

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Task>> queue_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace hpctrial::comm
