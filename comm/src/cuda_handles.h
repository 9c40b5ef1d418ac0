// Owned CUDA streams and events and the NCCL communicator, for nccl_communicator.cpp: each is
// destroyed once when its handle goes, so a throw half way through setting up a communicator
// leaks nothing. Move-only; the destructors never throw.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>
#include <utility>

#include "hpctrial/core/error.h"

namespace hpctrial::comm {

inline void check_cuda(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw CommError(std::string(what) + " failed: " + cudaGetErrorString(rc));
}

inline void check_nccl(ncclResult_t rc, const char* what) {
  if (rc != ncclSuccess && rc != ncclInProgress) {
    throw CommError(std::string(what) + " failed: " + ncclGetErrorString(rc));
  }
}

// A handle whose Traits say how to destroy a T (a pointer type, empty when nullptr).
template <typename T, typename Traits>
class CudaHandle {
 public:
  CudaHandle() = default;
  explicit CudaHandle(T raw) : raw_(raw) {}
  ~CudaHandle() { reset(); }
  CudaHandle(CudaHandle&& other) noexcept : raw_(std::exchange(other.raw_, nullptr)) {}
  CudaHandle& operator=(CudaHandle&& other) noexcept {
    if (this != &other) {
      reset();
      raw_ = std::exchange(other.raw_, nullptr);
    }
    return *this;
  }
  CudaHandle(const CudaHandle&) = delete;
  CudaHandle& operator=(const CudaHandle&) = delete;

  T get() const { return raw_; }
  explicit operator bool() const { return raw_ != nullptr; }
  // Gives the raw handle up without destroying it.
  T release() { return std::exchange(raw_, nullptr); }
  void reset() noexcept {
    if (raw_ != nullptr) Traits::destroy(raw_);
    raw_ = nullptr;
  }

 private:
  T raw_ = nullptr;
};

struct StreamTraits {
  static void destroy(cudaStream_t s) { cudaStreamDestroy(s); }
};
struct EventTraits {
  static void destroy(cudaEvent_t e) { cudaEventDestroy(e); }
};
// Destroying a communicator that may have failed or hang: abort, never ncclCommDestroy, which
// waits for outstanding work. The orderly end (synchronise, then destroy) is the owner's.
struct NcclCommTraits {
  static void destroy(ncclComm_t c) { ncclCommAbort(c); }
};

using CudaStream = CudaHandle<cudaStream_t, StreamTraits>;
using CudaEvent = CudaHandle<cudaEvent_t, EventTraits>;
using NcclComm = CudaHandle<ncclComm_t, NcclCommTraits>;

inline CudaStream make_stream(unsigned int flags) {
  cudaStream_t s = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&s, flags), "cudaStreamCreate");
  return CudaStream(s);
}

inline CudaEvent make_event(unsigned int flags) {
  cudaEvent_t e = nullptr;
  check_cuda(cudaEventCreateWithFlags(&e, flags), "cudaEventCreate");
  return CudaEvent(e);
}

}  // namespace hpctrial::comm
