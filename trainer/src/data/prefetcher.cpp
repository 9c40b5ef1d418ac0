#include "data/prefetcher.h"

#include <malloc.h>

#include <cstdlib>
#include <mutex>

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <algorithm>

namespace hpctrial::trainer::detail {

void keep_batch_memory() {
#if defined(__GLIBC__)
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr) ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
    if (std::getenv("MALLOC_TRIM_THRESHOLD_") == nullptr) ::mallopt(M_TRIM_THRESHOLD, 256 << 20);
  });
#endif
}

Prefetcher::Prefetcher(Read read, NextIndices next_indices, std::size_t workers, std::size_t depth)
    : read_(std::move(read)), next_indices_(std::move(next_indices)), depth_(std::max(depth, workers)) {
  for (std::size_t i = 0; i < workers; ++i) workers_.emplace_back([this] { run(); });
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void Prefetcher::run() {
  // A new thread starts with OpenMP's default team size; take LibTorch's setting instead, as
  // LibTorch's own threads do, or reading a batch may start a second team of spinning threads.
  at::init_num_threads();
  // Reading ahead must not preempt the training threads much: a compute step split over all
  // cores waits for its slowest thread. At nice 19 the reader takes a small share of a busy
  // core, yet still issues its reads early enough to overlap I/O with training. Best effort.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
  for (;;) {
    std::uint64_t sequence;
    std::vector<std::int64_t> indices;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [this] { return stop_ || failed_ || assigned_ - delivered_ < depth_; });
      if (stop_ || failed_) return;
      sequence = assigned_++;
      try {
        indices = next_indices_();
      } catch (...) {
        ready_[sequence].error = std::current_exception();
        failed_ = true;
        changed_.notify_all();
        return;
      }
    }
    Slot slot;
    try {
      slot.batch = read_(indices);
    } catch (...) {
      slot.error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (slot.error) failed_ = true;
    ready_[sequence] = std::move(slot);
    changed_.notify_all();
  }
}

Batch Prefetcher::next() {
  if (workers_.empty()) {
    if (failed_) std::rethrow_exception(ready_.at(delivered_).error);
    try {
      return read_(next_indices_());
    } catch (...) {
      failed_ = true;
      ready_[delivered_].error = std::current_exception();
      throw;
    }
  }
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [this] { return ready_.count(delivered_) != 0; });
  // A failed read stays in place: the readers have stopped, and a later next() throws again.
  if (const auto error = ready_.at(delivered_).error) std::rethrow_exception(error);
  auto node = ready_.extract(delivered_);
  ++delivered_;
  lock.unlock();
  changed_.notify_all();
  return std::move(node.mapped().batch);
}

}  // namespace hpctrial::trainer::detail
