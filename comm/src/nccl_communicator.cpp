#include "hpctrial/comm/nccl_communicator.h"

#include <mutex>
#include <thread>

#include "checks.h"
#include "cuda_handles.h"
#include "hpctrial/comm/mpi_check.h"
#include "hpctrial/comm/mpi_comm.h"
#include "hpctrial/comm/watchdog.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"

namespace hpctrial::comm {
namespace {

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

// The NCCL communicator, shared with the watchdog's abort hook, which may outlive us. Aborted
// when the last owner goes without the orderly end of ~NcclCommunicator (a constructor that threw).
struct SharedComm {
  std::mutex mutex;
  NcclComm comm;

  // Tears the communicator down after an error; safe to call more than once.
  void abort() {
    std::lock_guard<std::mutex> lock(mutex);
    comm.reset();
  }
};

class NcclWork final : public Work {
 public:
  // `id`: the watchdog's for a collective, pending from its launch; 0 for a message, pending from
  // its first wait (as number `number` of `channel`).
  NcclWork(std::shared_ptr<SharedComm> shared, CudaEvent done, int device, Watchdog* watchdog,
           std::uint64_t id, const char* operation, std::uint64_t channel = 0, std::uint64_t number = 0)
      : shared_(std::move(shared)), done_(std::move(done)), device_(device), watchdog_(watchdog), id_(id),
        operation_(operation), channel_(channel), number_(number) {}
  ~NcclWork() override {
    if (watchdog_ != nullptr && !finished_ && id_ != 0) watchdog_->leave(id_);
  }

  bool wait(std::chrono::milliseconds timeout) override {
    if (finished_) return true;
    if (watchdog_ != nullptr && id_ == 0) id_ = watchdog_->begin(operation_, channel_, number_);
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      const cudaError_t state = cudaEventQuery(done_.get());
      if (state == cudaSuccess) break;
      if (state != cudaErrorNotReady) {
        shared_->abort();
        throw CommError(std::string("NCCL ") + operation_ + ": CUDA error " + cudaGetErrorString(state));
      }
      {
        std::lock_guard<std::mutex> lock(shared_->mutex);
        if (!shared_->comm) throw CommError(std::string("NCCL ") + operation_ + ": the communicator was aborted");
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(shared_->comm.get(), &async);
        if (async != ncclSuccess && async != ncclInProgress) {
          shared_->comm.reset();
          throw CommError(std::string("NCCL ") + operation_ + " failed: " + ncclGetErrorString(async) +
                          "; the communicator was aborted");
        }
      }
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    // Later work on the default stream sees the result.
    check_cuda(cudaStreamWaitEvent(cudaStreamLegacy, done_.get(), 0), "cudaStreamWaitEvent");
    finished_ = true;
    if (watchdog_ != nullptr) watchdog_->leave(id_);
    return true;
  }

 private:
  std::shared_ptr<SharedComm> shared_;
  CudaEvent done_;
  int device_;
  Watchdog* watchdog_;
  std::uint64_t id_;
  const char* operation_;
  std::uint64_t channel_;
  std::uint64_t number_;
  bool finished_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(MPI_Comm comm, int local_rank, Watchdog* watchdog, std::uint64_t channel = Watchdog::kWorld)
      : host_(comm, watchdog, channel), watchdog_(watchdog), shared_(std::make_shared<SharedComm>()) {
    int visible = 0;
    check_cuda(cudaGetDeviceCount(&visible), "cudaGetDeviceCount");
    if (visible == 0) throw CommError("NCCL: rank " + std::to_string(host_.rank()) + " sees no GPU");
    device_ = local_rank % visible;
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    ncclUniqueId id;
    if (host_.rank() == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    HPCTRIAL_MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, host_.comm()));
    ncclComm_t nccl = nullptr;
    const ncclResult_t rc = ncclCommInitRank(&nccl, host_.size(), id, host_.rank());
    shared_->comm = NcclComm(nccl);  // owned before anything can throw
    check_nccl(rc, "ncclCommInitRank");
    stream_ = make_stream(cudaStreamNonBlocking);
    ready_ = make_event(cudaEventDisableTiming);
    if (watchdog_ != nullptr) {
      std::weak_ptr<SharedComm> weak = shared_;
      watchdog_->add_abort_hook([weak] {
        if (auto shared = weak.lock()) shared->abort();
      });
    }
    core::log_debug("NCCL communicator on GPU {} ({} ranks)", device_, host_.size());
  }

  // The orderly end: a communicator whose stream finishes is destroyed, one that does not is
  // aborted (NcclComm's destructor); then the members free the event and the stream.
  ~NcclCommunicator() override {
    cudaSetDevice(device_);
    std::lock_guard<std::mutex> lock(shared_->mutex);
    if (shared_->comm && cudaStreamSynchronize(stream_.get()) == cudaSuccess) {
      ncclCommDestroy(shared_->comm.release());
    }
    shared_->comm.reset();
  }

  using Communicator::allreduce;
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }

  WorkHandle allreduce_async(void* data, std::size_t count, DType dtype, ReduceOp op) override {
    return launch("allreduce", [&](ncclComm_t comm) {
      return ncclAllReduce(data, data, count, to_nccl(dtype), to_nccl(op), comm, stream_.get());
    });
  }

  WorkHandle broadcast_async(void* data, std::size_t bytes, int root) override {
    if (root < 0 || root >= size()) throw CommError("broadcast: root rank " + std::to_string(root) + " is not in the world");
    return launch("broadcast", [&](ncclComm_t comm) {
      return ncclBroadcast(data, data, bytes, ncclUint8, root, comm, stream_.get());
    });
  }

  WorkHandle reduce_scatter_async(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op) override {
    return launch("reduce_scatter", [&](ncclComm_t comm) {
      return ncclReduceScatter(send, recv, count, to_nccl(dtype), to_nccl(op), comm, stream_.get());
    });
  }

  WorkHandle allgather_async(const void* send, void* recv, std::size_t count, DType dtype) override {
    return launch("allgather", [&](ncclComm_t comm) {
      return ncclAllGather(send, recv, count, to_nccl(dtype), comm, stream_.get());
    });
  }

  // One stream runs the communicator's operations in order: a send waits for its receive.
  WorkHandle send_async(const void* data, std::size_t count, DType dtype, int peer) override {
    detail::message_bytes(count, dtype, peer, rank(), size(), "send");
    return launch("send", host_.message_channel(rank(), peer), true, [&](ncclComm_t comm) {
      return ncclSend(data, count, to_nccl(dtype), peer, comm, stream_.get());
    });
  }

  WorkHandle recv_async(void* data, std::size_t count, DType dtype, int peer) override {
    detail::message_bytes(count, dtype, peer, rank(), size(), "recv");
    return launch("recv", host_.message_channel(peer, rank()), true, [&](ncclComm_t comm) {
      return ncclRecv(data, count, to_nccl(dtype), peer, comm, stream_.get());
    });
  }

  void broadcast(std::string& bytes, int root) override { host_.broadcast(bytes, root); }
  using Communicator::allgather;
  std::vector<std::string> allgather(const std::string& bytes) override { return host_.allgather(bytes); }
  std::vector<std::string> gather(const std::string& bytes, int root) override { return host_.gather(bytes, root); }
  void barrier() override { host_.barrier(); }
  void set_step(std::int64_t step) override { host_.set_step(step); }

  // The group's own NCCL communicator, bootstrapped over the MPI split, on this rank's GPU.
  std::unique_ptr<Communicator> split(int color, int key) override {
    detail::check_color(color);
    MPI_Comm group = MPI_COMM_NULL;
    {
      Watchdog::Scope watch(watchdog_, "split", host_.channel());
      HPCTRIAL_MPI_CHECK(MPI_Comm_split(host_.comm(), color, key, &group));
    }
    const MpiComm owned = MpiComm::adopt(group);
    return std::make_unique<NcclCommunicator>(owned.get(), device_, watchdog_, host_.next_split_channel(color));
  }

 private:
  template <typename Call>
  WorkHandle launch(const char* operation, const Call& call) {
    return launch(operation, host_.channel(), false, call);
  }

  // A message (`message`) is counted in its channel now and pending from its first wait.
  template <typename Call>
  WorkHandle launch(const char* operation, std::uint64_t channel, bool message, const Call& call) {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    // The collective waits for what the default stream has queued (the gradients).
    check_cuda(cudaEventRecord(ready_.get(), cudaStreamLegacy), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream_.get(), ready_.get(), 0), "cudaStreamWaitEvent");
    const std::uint64_t number = watchdog_ != nullptr && message ? watchdog_->count(channel) : 0;
    const std::uint64_t id = watchdog_ != nullptr && !message ? watchdog_->enter(operation, channel) : 0;
    try {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      if (!shared_->comm) throw CommError(std::string("NCCL ") + operation + ": the communicator was aborted");
      check_nccl(call(shared_->comm.get()), operation);
      CudaEvent done = make_event(cudaEventDisableTiming);
      check_cuda(cudaEventRecord(done.get(), stream_.get()), "cudaEventRecord");
      return std::make_shared<NcclWork>(shared_, std::move(done), device_, watchdog_, id, operation, channel, number);
    } catch (...) {
      if (watchdog_ != nullptr && id != 0) watchdog_->leave(id);
      throw;
    }
  }

  MpiCommunicator host_;
  Watchdog* watchdog_;
  std::shared_ptr<SharedComm> shared_;
  int device_ = 0;
  CudaStream stream_;
  CudaEvent ready_;
};

}  // namespace

bool nccl_available() { return true; }

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, int local_rank, Watchdog* watchdog) {
  return std::make_unique<NcclCommunicator>(comm, local_rank, watchdog);
}

}  // namespace hpctrial::comm
