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
// send_async and recv_async carry a message between two ranks (the stages of a pipeline). On
// the host (MPI) they are independent of everything else in flight. On a device (NCCL) the
// operations of a communicator run in one stream in the order they were issued, so a send waits
// for its receive: messages that cross between two ranks at the same time need a communicator
// for each direction (split), as the pipeline's are.
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

  // The `count` values at `data` go to rank `peer`, which takes them with a recv_async of the
  // same count and dtype from this rank; messages from one rank to another arrive in the order
  // they were sent. Both return at once; `data` stays alive and untouched until wait() is true.
  virtual WorkHandle send_async(const void* data, std::size_t count, DType dtype, int peer) = 0;
  virtual WorkHandle recv_async(void* data, std::size_t count, DType dtype, int peer) = 0;

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
  // A world of one rank has no peer: CommError.
  WorkHandle send_async(const void* data, std::size_t count, DType dtype, int peer) override;
  WorkHandle recv_async(void* data, std::size_t count, DType dtype, int peer) override;
  void broadcast(std::string&, int root) override;
  using Communicator::allgather;
  std::vector<std::string> allgather(const std::string& bytes) override { return {bytes}; }
  std::vector<std::string> gather(const std::string& bytes, int root) override;
  void barrier() override {}
  std::unique_ptr<Communicator> split(int color, int key) override;
};

// Host-memory collectives over MPI. Owns three duplicates of the given communicator (so
// hpctrial's traffic never matches a user's messages): one for the calling thread's
// synchronous collectives, one for a background thread that runs the async ones in order, one
// for messages (posted at once with MPI_Isend / MPI_Irecv, completed by wait()).
// With a Watchdog, every operation is reported to it, on `channel`: the world's
// (Watchdog::kWorld) for a communicator of all the watchdog's ranks, a group's for one made by
// split(). Not copyable.
class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm, Watchdog* watchdog = nullptr);
  MpiCommunicator(MPI_Comm comm, Watchdog* watchdog, std::uint64_t channel);
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
  WorkHandle send_async(const void* data, std::size_t count, DType dtype, int peer) override;
  WorkHandle recv_async(void* data, std::size_t count, DType dtype, int peer) override;
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
  Watchdog* watchdog() const { return watchdog_; }
  // The watchdog channel of this communicator's collectives, and of its messages to (or from) `peer`.
  std::uint64_t channel() const { return channel_; }
  std::uint64_t message_channel(int from, int to) const;
  // The channel of the group split(color, ...) makes next (the same on every rank of it); counts the split.
  std::uint64_t next_split_channel(int color);

 private:
  class Task;
  class Message;
  WorkHandle enqueue(const char* operation, std::uint64_t bytes, std::function<void(MPI_Comm)> run);
  void worker_loop();
  // The reduction of `op` for `dtype`: MPI's own, or one of ours for 16-bit floats.
  MPI_Op mpi_op(DType dtype, ReduceOp op) const;

  MpiComm comm_;        // synchronous collectives, caller's thread
  MpiComm async_comm_;  // async collectives, worker thread
  MpiComm message_comm_;  // sends and receives
  int rank_ = 0;
  int size_ = 1;
  Watchdog* watchdog_ = nullptr;
  std::uint64_t channel_ = 0;
  std::uint64_t splits_ = 0;
  std::vector<int> world_ranks_;  // of each rank here, in the watchdog's world
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
