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

// The mean of the lower nine tenths: a hand-over that woke a reader costs several times one
// that did not, and the mean counts both as often as they come; a step the machine took the core
// away in does not count.
double typical_mean(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t kept = std::max<std::size_t>(1, values.size() - values.size() / 10);
  double sum = 0;
  for (std::size_t i = 0; i < kept; ++i) sum += values[i];
  return sum / static_cast<double>(kept);
}

}  // namespace

void ReadPlacement::step(double step_s, Where read, double read_s, double fetch_s) {
  ++steps_in_phase_;
  if (phase_ == Phase::kWarmup || phase_ == Phase::kSettled) {
    const std::int64_t length = phase_ == Phase::kWarmup ? options_.warmup : settled_for_;
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
  fetches_.push_back(fetch_s);
  if (static_cast<std::int64_t>(steps_.size()) < options_.window) return;
  const double step_median = median(steps_);
  const double read_median = median(reads_);
  const double fetch_mean = typical_mean(fetches_);
  steps_.clear();
  reads_.clear();
  fetches_.clear();
  steps_in_phase_ = 0;
  if (phase_ == Phase::kAhead) {
    ahead_step_s_ = step_median;
    ahead_fetch_s_ = fetch_mean;
    if (read_median > 0.1 * step_median) return settle(Where::kAhead);
    phase_ = Phase::kInline;
    where_ = Where::kInline;
    return;
  }
  inline_step_s_ = step_median;
  inline_fetch_s_ = fetch_mean;
  const double keep = 1 - options_.margin;
  const bool inline_steps_faster = inline_step_s_ < keep * ahead_step_s_;
  const bool ahead_steps_faster = ahead_step_s_ < keep * inline_step_s_;
  const bool inline_hands_over_faster = inline_fetch_s_ < ahead_fetch_s_;
  settle(inline_steps_faster || (inline_hands_over_faster && !ahead_steps_faster) ? Where::kInline : Where::kAhead);
}

void ReadPlacement::settle(Where where) {
  // A measurement against the choice in place is taken again at once before it counts: one pair
  // of windows that the machine slowed must not move the batches for a thousand steps.
  const bool changes = settled_once_ && where != where_settled_;
  if (changes && !doubted_) {
    doubted_ = true;
    where_ = where_settled_;
    phase_ = Phase::kSettled;
    settled_for_ = 1;
    steps_in_phase_ = 0;
    return;
  }
  doubted_ = false;
  if (!settled_once_ || changes) {
    const std::string inline_step =
        phase_ == Phase::kInline ? fmt::format("{:.1f} us", inline_step_s_ * 1e6) : std::string("not measured");
    const std::string inline_fetch =
        phase_ == Phase::kInline ? fmt::format("{:.1f} us", inline_fetch_s_ * 1e6) : std::string("not measured");
    core::log_debug("batches are read {}: a step took {:.1f} us reading ahead, {} reading on the training thread; "
                    "handing a batch over took {:.1f} us and {}",
                    where == Where::kInline ? "on the training thread" : "ahead on the reader threads",
                    ahead_step_s_ * 1e6, inline_step, ahead_fetch_s_ * 1e6, inline_fetch);
  }
  recheck_ = settled_once_ && where == where_settled_ ? std::min(2 * recheck_, options_.max_recheck) : options_.recheck;
  settled_for_ = recheck_;
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
      const auto can_read = [this] { return stop_ || failed_ || (ahead_ && assigned_ - delivered_ < depth_); };
      while (!can_read()) {
        // Paced: looks again by itself, so that taking a batch need not wake it.
        const auto pace = std::chrono::nanoseconds(pace_ns_.load(std::memory_order_relaxed));
        if (ahead_ && pace.count() > 0) {
          changed_.wait_for(lock, pace);
        } else {
          changed_.wait(lock);
        }
      }
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
void Prefetcher::measure() {
  const auto now = Clock::now();
  if (last_next_ != Clock::time_point{}) {
    const double step_s = std::chrono::duration<double>(now - last_next_).count();
    placement_.step(step_s, last_.where, last_.read_s, last_.fetch_s);
    pace(step_s);
  }
  last_next_ = now;
  const bool ahead = placement_.where() == ReadPlacement::Where::kAhead;
  std::lock_guard<std::mutex> lock(mutex_);
  if (ahead == ahead_) return;
  ahead_ = ahead;
  if (ahead_) changed_.notify_all();
}

// Reads ahead far shorter than a step are paced (see pace_ns_). With `depth` batches queued, the
// one a slot frees for is wanted depth - 1 steps later: readers that look for a free slot every
// nine tenths of that, and read in a fraction of a step, are in time without being woken (and a
// late one is woken as before, by the next() that finds nothing left). Reads longer than a
// quarter of a step are woken for every batch taken.
void Prefetcher::pace(double step_s) {
  // Running means that err towards waking: the step's follows a shorter step at once and a
  // longer one slowly (one long step - a validation, a checkpoint, a host that took the core
  // away - moves it by a tenth at most); the read's the other way round.
  constexpr double kWeight = 0.1;
  if (step_mean_s_ == 0 || step_s < step_mean_s_) {
    step_mean_s_ = step_mean_s_ == 0 ? step_s : (step_mean_s_ + step_s) / 2;
  } else {
    step_mean_s_ = (1 - kWeight) * step_mean_s_ + kWeight * std::min(step_s, 2 * step_mean_s_);
  }
  if (last_.where == ReadPlacement::Where::kAhead && last_.read_s > 0) {
    const double read_s = last_.read_s;
    read_mean_s_ = read_mean_s_ == 0 || read_s > read_mean_s_ ? std::max(read_s, (read_mean_s_ + read_s) / 2)
                                                             : (1 - kWeight) * read_mean_s_ + kWeight * read_s;
  }
  const bool short_reads = depth_ > 1 && read_mean_s_ > 0 && read_mean_s_ < 0.25 * step_mean_s_;
  const double look_s = std::clamp(0.9 * static_cast<double>(depth_ - 1) * step_mean_s_, 20e-6, 1.0);
  pace_ns_.store(short_reads ? static_cast<std::int64_t>(look_s * 1e9) : 0, std::memory_order_relaxed);
}

// On the training thread, with nothing read ahead left to hand over.
Batch Prefetcher::read_inline(std::unique_lock<std::mutex>& lock) {
  const std::uint64_t sequence = assigned_++;
  try {
    const std::vector<std::int64_t> indices = next_indices_();
    lock.unlock();
    const auto started = Clock::now();
    Batch batch = read_(indices);
    last_.where = ReadPlacement::Where::kInline;
    last_.read_s = std::chrono::duration<double>(Clock::now() - started).count();
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
  if (adaptive_) measure();
  const auto asked = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  if (!ahead_ && !failed_ && assigned_ == delivered_) {
    Batch batch = read_inline(lock);
    last_.fetch_s = std::chrono::duration<double>(Clock::now() - asked).count();
    return batch;
  }
  changed_.wait(lock, [this] { return ready_.count(delivered_) != 0; });
  // A failed read stays in place: the readers have stopped, and a later next() throws again.
  if (const auto error = ready_.at(delivered_).error) std::rethrow_exception(error);
  auto node = ready_.extract(delivered_);
  ++delivered_;
  // Readers awake go on reading up to the depth by themselves; a sleeping one needs waking, a
  // system call and, on a virtual machine, an interrupt to another core - as long as a short
  // read itself. Paced readers look by themselves; they are woken only when none is left.
  const std::uint64_t low = pace_ns_.load(std::memory_order_relaxed) > 0 ? 0 : depth_ - 1;
  const bool wake = assigned_ - delivered_ <= low;
  lock.unlock();
  if (wake) changed_.notify_all();
  last_ = {ReadPlacement::Where::kAhead, node.mapped().read_s, std::chrono::duration<double>(Clock::now() - asked).count()};
  return std::move(node.mapped().batch);
}

}  // namespace hpctrial::trainer::detail
