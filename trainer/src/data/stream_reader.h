// Reading a StreamDataset: batches of consecutive samples, and where the stream stands after
// each. Internal to the trainer.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "hpctrial/trainer/data.h"

namespace hpctrial::trainer::detail {

// Where a rank's stream stands: its pass, and the samples read in it.
struct StreamPosition {
  std::int64_t pass = 0;
  std::uint64_t offset = 0;
  bool operator==(const StreamPosition& other) const { return pass == other.pass && offset == other.offset; }
};

// Up to `count` samples of the stream's current pass; fewer at its end.
std::vector<Batch> read_samples(StreamDataset& stream, std::uint64_t count);

// One rank's training batches from a stream loader, pass after pass: each batch is batch_size
// samples; where a pass ends part way through a batch, the batch goes on with the next pass
// (with drop_last, the part is left out and the batch starts the next pass). A pass without a
// sample is a ConfigError: training would wait for samples forever.
//
// next() runs on the prefetcher's one worker thread (or on the training thread), batch after
// batch; take_position() on the training thread, once for each batch it trains on.
class StreamReader {
 public:
  // Starts the stream at `at`: start(at.pass), then skip(at.offset).
  StreamReader(const DataLoader& loader, StreamPosition at, int rank);

  Batch next();
  // Where the stream stood after the oldest batch read and not yet taken.
  StreamPosition take_position();

 private:
  const DataLoader& loader_;
  int rank_;
  StreamPosition at_;  // the stream's position (the reading thread's)
  std::mutex mutex_;
  std::deque<StreamPosition> after_;  // per batch read and not yet taken
};

}  // namespace hpctrial::trainer::detail
