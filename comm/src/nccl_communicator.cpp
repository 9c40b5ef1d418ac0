#include "hpctrial/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <mutex>
#include <thread>

#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/comm/mpi_check.h"
#include "hpctrial/comm/watchdog.h"

namespace hpctrial::comm {
namespace {

void check_cuda(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw CommError(std::string(what) + " failed: " + cudaGetErrorString(rc));
}

void check_nccl(ncclResult_t rc, const char* what) {
  if (rc != ncclSuccess && rc != ncclInProgress) {
    throw CommError(std::string(what) + " failed: " + ncclGetErrorString(rc));
  }
}

ncclDataType_t to_nccl(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    case DType::kInt8: return ncclInt8;
    case DType::kUInt8:
    case DType::kBool: return ncclUint8;
    case DType::kInt16: throw CommError("NCCL has no 16-bit integer type; reduce int16 values as int32");
  }
  return ncclUint8;
}

ncclRedOp_t to_nccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

// The NCCL communicator, shared with the watchdog's abort hook, which may outlive us.
struct SharedComm {
  std::mutex mutex;
  ncclComm_t comm = nullptr;
  bool failed = false;

  // Tears the communicator down after an error; safe to call more than once.
  void abort() {
    std::lock_guard<std::mutex> lock(mutex);
    if (comm == nullptr) return;
    ncclCommAbort(comm);
    comm = nullptr;
    failed = true;
  }
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<SharedComm> shared, cudaEvent_t done, int device, Watchdog* watchdog,
           std::uint64_t id, const char* operation)
      : shared_(std::move(shared)), done_(done), device_(device), watchdog_(watchdog), id_(id),
        operation_(operation) {}
  ~NcclWork() override {
    if (watchdog_ != nullptr && !finished_) watchdog_->leave(id_);
    cudaEventDestroy(done_);
  }

  bool wait(std::chrono::milliseconds timeout) override {
    if (finished_) return true;
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      const cudaError_t state = cudaEventQuery(done_);
      if (state == cudaSuccess) break;
      if (state != cudaErrorNotReady) {
        shared_->abort();
        throw CommError(std::string("NCCL ") + operation_ + ": CUDA error " + cudaGetErrorString(state));
      }
      {
        std::lock_guard<std::mutex> lock(shared_->mutex);
        if (shared_->comm == nullptr) throw CommError(std::string("NCCL ") + operation_ + ": the communicator was aborted");
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(shared_->comm, &async);
        if (async != ncclSuccess && async != ncclInProgress) {
          ncclCommAbort(shared_->comm);
          shared_->comm = nullptr;
          shared_->failed = true;
          throw CommError(std::string("NCCL ") + operation_ + " failed: " + ncclGetErrorString(async) +
                          "; the communicator was aborted");
        }
      }
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    // Later work on the default stream sees the result.
    check_cuda(cudaStreamWaitEvent(cudaStreamLegacy, done_, 0), "cudaStreamWaitEvent");
    finished_ = true;
    if (watchdog_ != nullptr) watchdog_->leave(id_);
    return true;
  }

 private:
  std::shared_ptr<SharedComm> shared_;
  cudaEvent_t done_;
  int device_;
  Watchdog* watchdog_;
  std::uint64_t id_;
  const char* operation_;
  bool finished_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(MPI_Comm comm, int local_rank, Watchdog* watchdog)
      : host_(comm, watchdog), watchdog_(watchdog), shared_(std::make_shared<SharedComm>()) {
    int visible = 0;
    check_cuda(cudaGetDeviceCount(&visible), "cudaGetDeviceCount");
    if (visible == 0) throw CommError("NCCL: rank " + std::to_string(host_.rank()) + " sees no GPU");
    device_ = local_rank % visible;
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    ncclUniqueId id;
    if (host_.rank() == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    HPCTRIAL_MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, host_.comm()));
    ncclComm_t nccl = nullptr;
    check_nccl(ncclCommInitRank(&nccl, host_.size(), id, host_.rank()), "ncclCommInitRank");
    shared_->comm = nccl;
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cuda(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
    if (watchdog_ != nullptr) {
      std::weak_ptr<SharedComm> weak = shared_;
      watchdog_->add_abort_hook([weak] {
        if (auto shared = weak.lock()) shared->abort();
      });
    }
    core::log_debug("NCCL communicator on GPU {} ({} ranks)", device_, host_.size());
  }

  ~NcclCommunicator() override {
    cudaSetDevice(device_);
    std::lock_guard<std::mutex> lock(shared_->mutex);
    if (shared_->comm != nullptr) {
      if (cudaStreamSynchronize(stream_) == cudaSuccess) {
        ncclCommDestroy(shared_->comm);
      } else {
        ncclCommAbort(shared_->comm);
      }
      shared_->comm = nullptr;
    }
    cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
  }

  using Communicator::allreduce;
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }

  WorkHandle allreduce_async(void* data, std::size_t count, DType dtype, ReduceOp op) override {
    return launch("allreduce", [&](ncclComm_t comm) {
      return ncclAllReduce(data, data, count, to_nccl(dtype), to_nccl(op), comm, stream_);
    });
  }

  WorkHandle broadcast_async(void* data, std::size_t bytes, int root) override {
    if (root < 0 || root >= size()) throw CommError("broadcast: root rank " + std::to_string(root) + " is not in the world");
    return launch("broadcast", [&](ncclComm_t comm) {
      return ncclBroadcast(data, data, bytes, ncclUint8, root, comm, stream_);
    });
  }

  void broadcast(std::string& bytes, int root) override { host_.broadcast(bytes, root); }
  std::vector<std::string> allgather(const std::string& bytes) override { return host_.allgather(bytes); }
  std::vector<std::string> gather(const std::string& bytes, int root) override { return host_.gather(bytes, root); }
  void barrier() override { host_.barrier(); }
  void set_step(std::int64_t step) override { host_.set_step(step); }

 private:
  template <typename Call>
  WorkHandle launch(const char* operation, const Call& call) {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    // The collective waits for what the default stream has queued (the gradients).
    check_cuda(cudaEventRecord(ready_, cudaStreamLegacy), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
    const std::uint64_t id = watchdog_ != nullptr ? watchdog_->enter(operation) : 0;
    cudaEvent_t done = nullptr;
    try {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      if (shared_->comm == nullptr) throw CommError(std::string("NCCL ") + operation + ": the communicator was aborted");
      check_nccl(call(shared_->comm), operation);
      check_cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
      check_cuda(cudaEventRecord(done, stream_), "cudaEventRecord");
    } catch (...) {
      if (done != nullptr) cudaEventDestroy(done);
      if (watchdog_ != nullptr) watchdog_->leave(id);
      throw;
    }
    return std::make_shared<NcclWork>(shared_, done, device_, watchdog_, id, operation);
  }

  MpiCommunicator host_;
  Watchdog* watchdog_;
  std::shared_ptr<SharedComm> shared_;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
};

}  // namespace

bool nccl_available() { return true; }

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, int local_rank, Watchdog* watchdog) {
  return std::make_unique<NcclCommunicator>(comm, local_rank, watchdog);
}

}  // namespace hpctrial::comm
