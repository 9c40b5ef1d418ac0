// Which samples each rank trains on, batch by batch: the order of Determined's
// ReproducibleShuffle -> Skip -> Repeat -> shard chain.
//
// The training stream is the concatenation of epochs; epoch e is a permutation of the dataset
// that depends only on (seed, e). Global batch k is stream positions [k*G, (k+1)*G) for the
// global batch size G, so it holds the same samples whatever the number of ranks; rank r of W
// takes the r-th of W equal slices. A sampler can start at any stream position: a resumed
// trial continues with exactly the samples it would have seen.
//
// Plain values; not thread-safe (one per data loader). Throws ConfigError for impossible
// sizes (an empty dataset, a batch that does not split over the ranks).
#pragma once

#include <cstdint>
#include <vector>

namespace hpctrial::trainer {

// The order of one training stream: position -> dataset index.
class StreamOrder {
 public:
  // `records_per_epoch` may be below the dataset size (an epoch is then a prefix of each
  // permutation) but not above it. shuffle=false gives 0, 1, 2, ... in every epoch.
  StreamOrder(std::uint64_t dataset_size, std::uint64_t seed, bool shuffle,
              std::uint64_t records_per_epoch = 0);

  std::uint64_t dataset_size() const { return dataset_size_; }
  std::uint64_t records_per_epoch() const { return records_per_epoch_; }
  std::uint64_t epoch_of(std::uint64_t position) const { return position / records_per_epoch_; }
  // The dataset index at stream position `position`.
  std::uint64_t at(std::uint64_t position);
  // The dataset indices at positions first, first + 1, ... (count of them), appended to `out`:
  // at() of each, without its two divisions a position.
  void append(std::uint64_t first, std::uint64_t count, std::vector<std::int64_t>& out);

 private:
  void load_epoch(std::uint64_t epoch);

  std::uint64_t dataset_size_;
  std::uint64_t seed_;
  bool shuffle_;
  std::uint64_t records_per_epoch_;
  std::uint64_t loaded_epoch_ = UINT64_MAX;
  std::vector<std::uint32_t> small_;  // the permutation, when the dataset has < 2^32 samples
  std::vector<std::uint64_t> large_;
};

// One rank's share of the training stream, a batch at a time.
class TrainingSampler {
 public:
  TrainingSampler(StreamOrder order, std::uint64_t global_batch_size, int rank, int world_size,
                  std::uint64_t start_position = 0);

  // This rank's dataset indices for the next global batch, in stream order.
  std::vector<std::int64_t> next_batch();
  // The stream position of the next global batch (batches trained × global batch size).
  std::uint64_t position() const { return position_; }
  // AdaptDL's ElasticSampler.set_epoch: the next batch starts at record `index` (counted across
  // all ranks) of epoch `epoch` - index 0 for a new epoch, the saved index() after a restart.
  // ConfigError when index is past the epoch's records.
  void set_epoch(std::uint64_t epoch, std::uint64_t index = 0);
  // The epoch of the next batch, and its first record's index in that epoch.
  std::uint64_t epoch() const { return order_.epoch_of(position_); }
  std::uint64_t index() const { return position_ % order_.records_per_epoch(); }
  std::uint64_t per_rank_batch_size() const { return per_rank_; }
  // AdaptDL's ElasticSampler.__len__: the records this rank takes from the next batch to the end
  // of its epoch. A batch that runs into the next epoch counts only its records of this one, so
  // the ranks' counts can differ by up to a batch (AdaptDL pads each rank to the same count,
  // repeating a record; here every record of the epoch is taken once, and the batch goes on into
  // the next epoch).
  std::uint64_t remaining_in_epoch() const;
  const StreamOrder& order() const { return order_; }

 private:
  StreamOrder order_;
  std::uint64_t global_batch_size_;
  std::uint64_t per_rank_;
  int rank_;
  std::uint64_t position_;
};

// The records of each training epoch: all `records_per_epoch`, or with drop_last only whole
// global batches of them (the rest of each epoch's order is skipped). ConfigError when drop_last
// leaves no batch.
std::uint64_t epoch_records(std::int64_t records_per_epoch, std::int64_t global_batch, bool drop_last);

// One rank's share of a validation pass: the dataset in order, split into W contiguous parts
// (the first `size % W` ranks take one sample more), in batches of `batch_size`; the last
// batch may be short. Every sample is validated exactly once across the ranks.
std::vector<std::vector<std::int64_t>> validation_batches(std::uint64_t dataset_size,
                                                          std::uint64_t batch_size, int rank,
                                                          int world_size);

}  // namespace hpctrial::trainer
