// Batches read ahead on background threads and handed over in order. Internal to the trainer.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
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

class Prefetcher {
 public:
  using NextIndices = std::function<std::vector<std::int64_t>()>;
  using Read = std::function<Batch(const std::vector<std::int64_t>&)>;
  // Reads the batches next_indices() names with read(), on `workers` threads, keeping up to
  // `depth` (at least `workers`) read or being read. next_indices is called under a lock, in
  // order; read runs on several threads at once. workers 0 reads on the caller's thread in next().
  Prefetcher(Read read, NextIndices next_indices, std::size_t workers, std::size_t depth);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // The next batch in order; rethrows what reading it threw.
  Batch next();

 private:
  struct Slot {
    Batch batch;
    std::exception_ptr error;
  };
  void run();

  Read read_;
  NextIndices next_indices_;
  std::size_t depth_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::uint64_t assigned_ = 0;   // batches handed to a worker
  std::uint64_t delivered_ = 0;  // batches handed to next()'s caller
  std::map<std::uint64_t, Slot> ready_;
  bool failed_ = false;  // a worker's read threw: the others stop taking batches
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace hpctrial::trainer::detail
