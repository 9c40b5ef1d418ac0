// Batches read ahead on a background thread, in order. Internal to the trainer.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "hpctrial/trainer/data.h"

namespace hpctrial::trainer::detail {

class Prefetcher {
 public:
  using NextIndices = std::function<std::vector<std::int64_t>()>;
  // Reads batches next_indices() names from `dataset`, keeping up to `depth` ready. depth 0
  // reads on the caller's thread in next().
  Prefetcher(Dataset& dataset, NextIndices next_indices, std::size_t depth);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // The next batch; rethrows what reading it threw.
  Batch next();

 private:
  void run();

  Dataset& dataset_;
  NextIndices next_indices_;
  std::size_t depth_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Batch> ready_;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace hpctrial::trainer::detail
