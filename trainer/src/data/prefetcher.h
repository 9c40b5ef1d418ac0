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
