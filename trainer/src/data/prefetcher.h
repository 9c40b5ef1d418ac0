// Batches read ahead on background threads and handed over in order. Internal to the trainer.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "hpctrial/trainer/batch.h"

namespace hpctrial::trainer::detail {

// glibc's malloc serves a block larger than its mmap threshold (128 KiB at first, raised only as
// such blocks are freed) with a fresh mapping, which it returns to the system when the block is
// freed: a batch read on a loader thread and freed on the training thread then costs a page fault
// for every page of it, every batch (a fifth of an inference's time with batches of 256 KiB).
// Sets fixed thresholds instead - blocks up to 32 MiB from the heap, trimmed beyond 256 MiB
// free - unless MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ in the environment set them.
// Once per process (run_training calls it); nothing with another C library.
void keep_batch_memory();

// Where the next batches are read: ahead, on the reader threads, which hides a read's time
// behind the step; or inline, on the training thread when it asks, which saves the hand-off - a
// batch written in one core's cache and read from another's, a reader that shares the training
// thread's core (a rank bound to one) - and a reader woken every step: a system call and, on a
// virtual machine, an interrupt to another core, as long as copying a small batch's rows
// (15 us on a 2-core virtual machine). Readers of reads far shorter than a step are not woken:
// they look for a free slot by themselves once a step (Prefetcher::pace), and taking a batch
// costs the training thread a lock (0.2 us there).
//
// Measures rather than guesses, over a window read ahead, then a window read inline: the median
// step (from one next() to the next) and the typical time next() took to hand the batch over
// (ahead: taking it from the queue and, now and then, waking a reader; inline: the read itself;
// the mean of all but the slowest tenth, as the wake-ups make it bimodal). Inline is
// kept when its steps are at least `margin` faster; or when its hand-over is the shorter and
// ahead's steps are not `margin` faster - a step's time varies with the machine far more than
// the few microseconds that tell the two apart, which the hand-over's own time shows directly.
// A window ahead whose median read takes more than a tenth of the step settles ahead at once:
// inline would add the read to every step. Measures again `recheck` steps later, twice as long
// after each time the choice stayed, so what the measuring costs shrinks as a run goes on; a
// measurement against the choice in place is repeated at once, and the choice changes only when
// the second agrees.
class ReadPlacement {
 public:
  enum class Where { kAhead, kInline };
  struct Options {
    std::int64_t warmup = 16;  // steps before the first window: allocations, first-use set-up
    std::int64_t window = 32;  // steps measured each way
    std::int64_t recheck = 1024;
    std::int64_t max_recheck = 65536;
    // Steps of 32-step windows on a shared machine differ by 2 % at random. Negative: inline is
    // kept while it is less than 1 - margin times slower.
    double margin = 0.02;
  };
  ReadPlacement() : ReadPlacement(Options()) {}
  explicit ReadPlacement(Options options) : options_(options), recheck_(options.recheck) {}

  // Where the next batch is read.
  Where where() const { return where_; }
  // A step ended: `step_s` seconds since the previous one, on a batch read where `read` says,
  // whose read took `read_s` seconds (on whichever thread read it) and whose hand-over took
  // next() `fetch_s` seconds.
  void step(double step_s, Where read, double read_s, double fetch_s = 0);
  // The medians of the last windows, in seconds (0 before the first).
  double ahead_step_s() const { return ahead_step_s_; }
  double inline_step_s() const { return inline_step_s_; }
  double ahead_fetch_s() const { return ahead_fetch_s_; }
  double inline_fetch_s() const { return inline_fetch_s_; }

 private:
  enum class Phase { kWarmup, kAhead, kInline, kSettled };
  void settle(Where where);

  Options options_;
  Phase phase_ = Phase::kWarmup;
  Where where_ = Where::kAhead;
  std::int64_t steps_in_phase_ = 0;
  std::int64_t recheck_;
  std::int64_t settled_for_ = 0;  // steps before the next measurement
  bool settled_once_ = false;
  bool doubted_ = false;  // the last measurement went against the choice in place
  Where where_settled_ = Where::kAhead;
  std::vector<double> steps_, reads_, fetches_;
  double ahead_step_s_ = 0, inline_step_s_ = 0, ahead_fetch_s_ = 0, inline_fetch_s_ = 0;
};

class Prefetcher {
 public:
  using NextIndices = std::function<std::vector<std::int64_t>()>;
  using Read = std::function<Batch(const std::vector<std::int64_t>&)>;
  // Reads the batches next_indices() names with read(), keeping up to `depth` (at least
  // `workers`) read or being read on `workers` threads, or on the caller's thread in next() where
  // a ReadPlacement finds that faster (`adaptive`). next_indices is called under a lock, in
  // order; read runs on several threads at once. workers 0 reads on the caller's thread always.
  Prefetcher(Read read, NextIndices next_indices, std::size_t workers, std::size_t depth, bool adaptive = true,
             ReadPlacement::Options placement = {});
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // The next batch in order; rethrows what reading it threw.
  Batch next();
  // Where the batches are read now.
  ReadPlacement::Where where() const { return placement_.where(); }
  // How long an idle reader waits before it looks for a free slot by itself, in seconds; 0 while
  // it waits until woken.
  double reader_pace_s() const { return static_cast<double>(pace_ns_.load(std::memory_order_relaxed)) / 1e9; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Slot {
    Batch batch;
    std::exception_ptr error;
    double read_s = 0;
  };
  void run();
  Batch read_inline(std::unique_lock<std::mutex>& lock);
  void measure();
  void pace(double step_s);

  Read read_;
  NextIndices next_indices_;
  std::size_t depth_;
  bool adaptive_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::uint64_t assigned_ = 0;   // batches taken to read (by a worker or inline)
  std::uint64_t delivered_ = 0;  // batches handed to next()'s caller
  std::map<std::uint64_t, Slot> ready_;
  bool ahead_ = true;    // workers may take batches
  bool failed_ = false;  // a read threw: nothing takes batches any more
  bool stop_ = false;
  ReadPlacement placement_;  // the training thread's
  double step_mean_s_ = 0, read_mean_s_ = 0;  // the training thread's running means
  // How long a reader with nothing to do waits before it looks for a free slot by itself; 0:
  // until woken. Set by the training thread.
  std::atomic<std::int64_t> pace_ns_{0};
  Clock::time_point last_next_{};
  struct Handed {  // the batch last handed over
    ReadPlacement::Where where = ReadPlacement::Where::kAhead;
    double read_s = 0, fetch_s = 0;
  };
  Handed last_{};
  std::vector<std::thread> workers_;
};

}  // namespace hpctrial::trainer::detail
