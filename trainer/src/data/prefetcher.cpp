#include "data/prefetcher.h"

#include <malloc.h>

#include <cstdlib>
#include <mutex>

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/Parallel.h>
#include <fmt/format.h>

#include "hpctrial/core/logging.h"

#include <algorithm>
#include <string>

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

namespace {

double median(std::vector<double> values) {
  const auto middle = values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2);
  std::nth_element(values.begin(), middle, values.end());
  return *middle;
}

}  // namespace

void ReadPlacement::step(double step_s, Where read, double read_s) {
  ++steps_in_phase_;
  if (phase_ == Phase::kWarmup || phase_ == Phase::kSettled) {
    const std::int64_t length = phase_ == Phase::kWarmup ? options_.warmup : recheck_;
    if (steps_in_phase_ < length) return;
    phase_ = Phase::kAhead;
    where_ = Where::kAhead;
    steps_in_phase_ = 0;
    return;
  }
  // A batch read before the switch, or one of the first two after it (the first read ahead
  // waits for a reader woken just then), belongs to neither window.
  if (read != where_ || steps_in_phase_ <= 2) return;
  steps_.push_back(step_s);
  reads_.push_back(read_s);
  if (static_cast<std::int64_t>(steps_.size()) < options_.window) return;
  const double step_median = median(steps_);
  const double read_median = median(reads_);
  steps_.clear();
  reads_.clear();
  steps_in_phase_ = 0;
  if (phase_ == Phase::kAhead) {
    ahead_step_s_ = step_median;
    if (read_median > 0.1 * step_median) return settle(Where::kAhead);
    phase_ = Phase::kInline;
    where_ = Where::kInline;
    return;
  }
  inline_step_s_ = step_median;
  settle(inline_step_s_ < (1 - options_.margin) * ahead_step_s_ ? Where::kInline : Where::kAhead);
}

void ReadPlacement::settle(Where where) {
  if (!settled_once_ || where != where_settled_) {
    const std::string inline_step =
        phase_ == Phase::kInline ? fmt::format("{:.1f} us", inline_step_s_ * 1e6) : std::string("not measured");
    core::log_debug("batches are read {}: a step took {:.1f} us reading ahead, {} reading on the training thread",
                    where == Where::kInline ? "on the training thread" : "ahead on the reader threads",
                    ahead_step_s_ * 1e6, inline_step);
  }
  recheck_ = settled_once_ && where == where_settled_ ? std::min(2 * recheck_, options_.max_recheck) : options_.recheck;
  settled_once_ = true;
  where_settled_ = where;
  where_ = where;
  phase_ = Phase::kSettled;
  steps_in_phase_ = 0;
}

Prefetcher::Prefetcher(Read read, NextIndices next_indices, std::size_t workers, std::size_t depth, bool adaptive,
                       ReadPlacement::Options placement)
    : read_(std::move(read)),
      next_indices_(std::move(next_indices)),
      depth_(std::max(depth, workers)),
      adaptive_(adaptive),
      placement_(placement) {
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
      changed_.wait(lock, [this] { return stop_ || failed_ || (ahead_ && assigned_ - delivered_ < depth_); });
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
    const auto started = Clock::now();
    try {
      slot.batch = read_(indices);
    } catch (...) {
      slot.error = std::current_exception();
    }
    slot.read_s = std::chrono::duration<double>(Clock::now() - started).count();
    std::lock_guard<std::mutex> lock(mutex_);
    if (slot.error) failed_ = true;
    ready_[sequence] = std::move(slot);
    changed_.notify_all();
  }
}

// The step that ends now (since the previous next()) to the placement, and its choice applied.
void Prefetcher::measure(ReadPlacement::Where read, double read_s) {
  const auto now = Clock::now();
  if (last_next_ != Clock::time_point{}) {
    placement_.step(std::chrono::duration<double>(now - last_next_).count(), read, read_s);
  }
  last_next_ = now;
  const bool ahead = placement_.where() == ReadPlacement::Where::kAhead;
  std::lock_guard<std::mutex> lock(mutex_);
  if (ahead == ahead_) return;
  ahead_ = ahead;
  if (ahead_) changed_.notify_all();
}

// On the training thread, with nothing read ahead left to hand over.
Batch Prefetcher::read_inline(std::unique_lock<std::mutex>& lock) {
  const std::uint64_t sequence = assigned_++;
  try {
    const std::vector<std::int64_t> indices = next_indices_();
    lock.unlock();
    const auto started = Clock::now();
    Batch batch = read_(indices);
    last_read_ = {ReadPlacement::Where::kInline, std::chrono::duration<double>(Clock::now() - started).count()};
    lock.lock();
    ++delivered_;
    return batch;
  } catch (...) {
    if (!lock.owns_lock()) lock.lock();
    ready_[sequence].error = std::current_exception();
    failed_ = true;
    changed_.notify_all();
    throw;
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
  if (adaptive_) measure(last_read_.first, last_read_.second);
  std::unique_lock<std::mutex> lock(mutex_);
  if (!ahead_ && !failed_ && assigned_ == delivered_) return read_inline(lock);
  changed_.wait(lock, [this] { return ready_.count(delivered_) != 0; });
  // A failed read stays in place: the readers have stopped, and a later next() throws again.
  if (const auto error = ready_.at(delivered_).error) std::rethrow_exception(error);
  auto node = ready_.extract(delivered_);
  ++delivered_;
  last_read_ = {ReadPlacement::Where::kAhead, node.mapped().read_s};
  lock.unlock();
  changed_.notify_all();
  return std::move(node.mapped().batch);
}

}  // namespace hpctrial::trainer::detail
