// Collectives across the ranks of a trial.
//
// The trainer talks to other ranks only through a Communicator, so it never learns how the
// ranks are connected. MpiCommunicator works on host memory (the CPU path); LocalCommunicator
// is the world of one rank, where every collective is a no-op. Every rank must call the same
// collectives in the same order - the trainer guarantees this by taking decisions at step
// boundaries only.
//
// Not thread-safe: one thread issues collectives on a communicator at a time. Failures throw
// CommError naming the operation and the rank.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace hpctrial::mpi_launcher {

enum class ReduceOp { kSum, kMax, kMin };
enum class DType { kFloat32, kFloat64, kInt64, kUInt8 };
std::size_t dtype_size(DType dtype);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  bool is_chief() const { return rank() == 0; }

  // Element-wise reduction of `count` values at `data` across all ranks, in place.
  virtual void allreduce(void* data, std::size_t count, DType dtype, ReduceOp op) = 0;
  // `bytes` on every rank becomes the value it has on `root`.
  virtual void broadcast(std::string& bytes, int root) = 0;
  // Every rank's `bytes`, in rank order (sizes may differ).
  virtual std::vector<std::string> allgather(const std::string& bytes) = 0;
  virtual void barrier() = 0;

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
  void allreduce(void*, std::size_t, DType, ReduceOp) override {}
  void broadcast(std::string&, int) override {}
  std::vector<std::string> allgather(const std::string& bytes) override { return {bytes}; }
  void barrier() override {}
};

// Owns a duplicate of the given communicator (so hpctrial's traffic never matches a user's
// messages), freed on destruction. Not copyable.
class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;
  using Communicator::allreduce;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void allreduce(void* data, std::size_t count, DType dtype, ReduceOp op) override;
  void broadcast(std::string& bytes, int root) override;
  std::vector<std::string> allgather(const std::string& bytes) override;
  void barrier() override;
  MPI_Comm comm() const { return comm_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace hpctrial::mpi_launcher
