#include "prefetcher.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/Parallel.h>

namespace hpctrial::trainer::detail {

Prefetcher::Prefetcher(Dataset& dataset, NextIndices next_indices, std::size_t depth)
    : dataset_(dataset), next_indices_(std::move(next_indices)), depth_(depth) {
  if (depth_ > 0) worker_ = std::thread([this] { run(); });
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (worker_.joinable()) worker_.join();
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
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [this] { return stop_ || ready_.size() < depth_; });
      if (stop_) return;
    }
    try {
      Batch batch = dataset_.get_batch(next_indices_());
      std::lock_guard<std::mutex> lock(mutex_);
      ready_.push_back(std::move(batch));
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      error_ = std::current_exception();
      changed_.notify_all();
      return;
    }
    changed_.notify_all();
  }
}

Batch Prefetcher::next() {
  if (depth_ == 0) return dataset_.get_batch(next_indices_());
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [this] { return !ready_.empty() || error_; });
  if (ready_.empty()) std::rethrow_exception(error_);
  Batch batch = std::move(ready_.front());
  ready_.pop_front();
  lock.unlock();
  changed_.notify_all();
  return batch;
}

}  // namespace hpctrial::trainer::detail
