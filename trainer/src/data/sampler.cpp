#include "hpctrial/trainer/sampler.h"

#include <numeric>
#include <string>

#include "hpctrial/core/error.h"
#include "hpctrial/trainer/random.h"

namespace hpctrial::trainer {

StreamOrder::StreamOrder(std::uint64_t dataset_size, std::uint64_t seed, bool shuffle,
                         std::uint64_t records_per_epoch)
    : dataset_size_(dataset_size),
      seed_(seed),
      shuffle_(shuffle),
      records_per_epoch_(records_per_epoch == 0 ? dataset_size : records_per_epoch) {
  if (dataset_size == 0) {
    throw ConfigError("the training dataset is empty: there is nothing to train on");
  }
  if (records_per_epoch_ > dataset_size_) {
    throw ConfigError("records_per_epoch (" + std::to_string(records_per_epoch_) +
                      ") is larger than the training dataset (" + std::to_string(dataset_size_) +
                      " records); lower it or leave it unset");
  }
}

void StreamOrder::load_epoch(std::uint64_t epoch) {
  // Fisher-Yates with the harness's own generator: the same permutation everywhere.
  Rng rng(derive_seed(seed_, epoch));
  auto shuffle = [&](auto& values) {
    using T = typename std::decay_t<decltype(values)>::value_type;
    values.resize(dataset_size_);
    std::iota(values.begin(), values.end(), T{0});
    for (std::uint64_t i = dataset_size_ - 1; i > 0; --i) {
      std::swap(values[i], values[rng.bounded(i + 1)]);
    }
  };
  if (dataset_size_ < (std::uint64_t{1} << 32)) {
    shuffle(small_);
  } else {
    shuffle(large_);
  }
  loaded_epoch_ = epoch;
}

std::uint64_t StreamOrder::at(std::uint64_t position) {
  const std::uint64_t offset = position % records_per_epoch_;
  if (!shuffle_) return offset;
  const std::uint64_t epoch = epoch_of(position);
  if (epoch != loaded_epoch_) load_epoch(epoch);
  return small_.empty() ? large_[offset] : small_[offset];
}

void StreamOrder::append(std::uint64_t first, std::uint64_t count, std::vector<std::int64_t>& out) {
  std::uint64_t epoch = epoch_of(first);
  std::uint64_t offset = first % records_per_epoch_;
  for (std::uint64_t i = 0; i < count; ++i) {
    std::uint64_t index = offset;
    if (shuffle_) {
      if (epoch != loaded_epoch_) load_epoch(epoch);
      index = small_.empty() ? large_[offset] : small_[offset];
    }
    out.push_back(static_cast<std::int64_t>(index));
    if (++offset == records_per_epoch_) {
      offset = 0;
      ++epoch;
    }
  }
}

TrainingSampler::TrainingSampler(StreamOrder order, std::uint64_t global_batch_size, int rank,
                                 int world_size, std::uint64_t start_position)
    : order_(std::move(order)),
      global_batch_size_(global_batch_size),
      per_rank_(0),
      rank_(rank),
      position_(start_position) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw InternalError("TrainingSampler: rank " + std::to_string(rank) + " of " +
                        std::to_string(world_size));
  }
  const auto world = static_cast<std::uint64_t>(world_size);
  if (global_batch_size == 0 || global_batch_size % world != 0) {
    throw ConfigError("the global batch size (" + std::to_string(global_batch_size) +
                      ") must be a positive multiple of the number of ranks (" +
                      std::to_string(world_size) + ")");
  }
  per_rank_ = global_batch_size / world;
}

std::vector<std::int64_t> TrainingSampler::next_batch() {
  std::vector<std::int64_t> indices;
  indices.reserve(per_rank_);
  order_.append(position_ + static_cast<std::uint64_t>(rank_) * per_rank_, per_rank_, indices);
  position_ += global_batch_size_;
  return indices;
}

std::uint64_t TrainingSampler::remaining_in_epoch() const {
  const std::uint64_t left = order_.records_per_epoch() - index();
  const std::uint64_t mine_of_last = left % global_batch_size_;
  const std::uint64_t before_me = static_cast<std::uint64_t>(rank_) * per_rank_;
  const std::uint64_t partial = mine_of_last > before_me ? std::min(per_rank_, mine_of_last - before_me) : 0;
  return left / global_batch_size_ * per_rank_ + partial;
}

void TrainingSampler::set_epoch(std::uint64_t epoch, std::uint64_t index) {
  if (index > order_.records_per_epoch()) {
    throw ConfigError("set_epoch(" + std::to_string(epoch) + ", " + std::to_string(index) + "): an epoch has " +
                      std::to_string(order_.records_per_epoch()) + " records");
  }
  position_ = epoch * order_.records_per_epoch() + index;
}

std::vector<std::vector<std::int64_t>> validation_batches(std::uint64_t dataset_size,
                                                          std::uint64_t batch_size, int rank,
                                                          int world_size) {
  HPCTRIAL_ENFORCE(batch_size > 0 && world_size > 0 && rank >= 0 && rank < world_size,
                   "validation_batches arguments");
  const auto world = static_cast<std::uint64_t>(world_size);
  const auto r = static_cast<std::uint64_t>(rank);
  const std::uint64_t base = dataset_size / world;
  const std::uint64_t extra = dataset_size % world;
  const std::uint64_t begin = r * base + std::min(r, extra);
  const std::uint64_t end = begin + base + (r < extra ? 1 : 0);
  std::vector<std::vector<std::int64_t>> batches;
  for (std::uint64_t start = begin; start < end; start += batch_size) {
    std::vector<std::int64_t> batch;
    for (std::uint64_t i = start; i < std::min(end, start + batch_size); ++i) {
      batch.push_back(static_cast<std::int64_t>(i));
    }
    batches.push_back(std::move(batch));
  }
  return batches;
}

std::uint64_t epoch_records(std::int64_t records_per_epoch, std::int64_t global_batch, bool drop_last) {
  if (!drop_last) return static_cast<std::uint64_t>(records_per_epoch);
  if (records_per_epoch < global_batch) {
    throw ConfigError("build_training_data_loader: drop_last with an epoch of " + std::to_string(records_per_epoch) +
                      " records and a global batch of " + std::to_string(global_batch) +
                      " leaves no batch; lower global_batch_size, raise records_per_epoch, or drop_last(false)");
  }
  return static_cast<std::uint64_t>(records_per_epoch - records_per_epoch % global_batch);
}

}  // namespace hpctrial::trainer
