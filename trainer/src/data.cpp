#include "hpctrial/trainer/data.h"

#include <torch/torch.h>

#include <algorithm>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer {

namespace {
// Set while a default get() reads through get_batch(): a dataset that overrides neither would
// otherwise recurse until the stack runs out.
thread_local bool in_default_get = false;
}  // namespace

Batch Dataset::get(std::int64_t index) {
  if (in_default_get) {
    throw ConfigError("the dataset overrides neither get(index) nor get_batch(indices); a Dataset implements "
                      "at least one of them");
  }
  in_default_get = true;
  Batch batch;
  try {
    batch = get_batch({index});
  } catch (...) {
    in_default_get = false;
    throw;
  }
  in_default_get = false;
  return batch.map_tensors([](const torch::Tensor& t) { return t.select(0, 0); });
}

Batch Dataset::get_batch(const std::vector<std::int64_t>& indices) {
  std::vector<Batch> samples;
  samples.reserve(indices.size());
  for (const std::int64_t i : indices) samples.push_back(get(i));
  return collate(samples);
}

TensorDataset::TensorDataset(torch::Tensor data, torch::Tensor target)
    : data_(std::move(data)), target_(std::move(target)) {
  if (data_.dim() == 0 || target_.dim() == 0 || data_.size(0) != target_.size(0)) {
    throw ConfigError("TensorDataset: data and target need the same number of rows, got shapes " +
                      c10::str(data_.sizes()) + " and " + c10::str(target_.sizes()));
  }
}

std::uint64_t TensorDataset::size() const { return static_cast<std::uint64_t>(data_.size(0)); }

Batch TensorDataset::get(std::int64_t index) { return {data_[index], target_[index]}; }

Batch TensorDataset::get_batch(const std::vector<std::int64_t>& indices) {
  const auto index = torch::tensor(indices, torch::kInt64);
  return {data_.index_select(0, index), target_.index_select(0, index)};
}

DataLoader::DataLoader(std::shared_ptr<Dataset> dataset, std::int64_t batch_size, bool shuffle)
    : DataLoader(std::move(dataset), batch_size, DataLoaderOptions().shuffle(shuffle)) {}

DataLoader::DataLoader(std::shared_ptr<Dataset> dataset, std::int64_t batch_size, DataLoaderOptions options)
    : dataset_(std::move(dataset)), batch_size_(batch_size), options_(std::move(options)) {
  if (!dataset_) throw ConfigError("DataLoader: the dataset is null");
  if (batch_size_ < 1) {
    throw ConfigError("DataLoader: the batch size must be positive, got " + std::to_string(batch_size_) +
                      "; use context.per_slot_batch_size()");
  }
}

Batch DataLoader::read(const std::vector<std::int64_t>& indices) const {
  if (!options_.collate()) return dataset_->get_batch(indices);
  std::vector<Batch> samples;
  samples.reserve(indices.size());
  for (const std::int64_t i : indices) samples.push_back(dataset_->get(i));
  return options_.collate()(std::move(samples));
}

DataLoader::Iterator DataLoader::end() const {
  const std::uint64_t size = dataset_->size();
  const auto batch = static_cast<std::uint64_t>(batch_size_);
  return Iterator(this, drop_last() ? size - size % batch : size);
}

Batch DataLoader::Iterator::operator*() const {
  const std::uint64_t end =
      std::min(loader_->dataset().size(), position_ + static_cast<std::uint64_t>(loader_->batch_size()));
  std::vector<std::int64_t> indices;
  for (std::uint64_t i = position_; i < end; ++i) indices.push_back(static_cast<std::int64_t>(i));
  return loader_->read(indices);
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  position_ = std::min(loader_->dataset().size(),
                       position_ + static_cast<std::uint64_t>(loader_->batch_size()));
  return *this;
}

}  // namespace hpctrial::trainer
