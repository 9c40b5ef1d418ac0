#include "hpctrial/trainer/data.h"

#include <algorithm>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer {

TensorDataset::TensorDataset(torch::Tensor data, torch::Tensor target)
    : data_(std::move(data)), target_(std::move(target)) {
  if (data_.dim() == 0 || target_.dim() == 0 || data_.size(0) != target_.size(0)) {
    throw ConfigError("TensorDataset: data and target need the same number of rows, got shapes " +
                      c10::str(data_.sizes()) + " and " + c10::str(target_.sizes()));
  }
}

std::uint64_t TensorDataset::size() const { return static_cast<std::uint64_t>(data_.size(0)); }

Batch TensorDataset::get_batch(const std::vector<std::int64_t>& indices) {
  const auto index = torch::tensor(indices, torch::kInt64);
  return {data_.index_select(0, index), target_.index_select(0, index)};
}

DataLoader::DataLoader(std::shared_ptr<Dataset> dataset, std::int64_t batch_size, bool shuffle)
    : dataset_(std::move(dataset)), batch_size_(batch_size), shuffle_(shuffle) {
  if (!dataset_) throw ConfigError("DataLoader: the dataset is null");
  if (batch_size_ < 1) {
    throw ConfigError("DataLoader: the batch size must be positive, got " + std::to_string(batch_size_) +
                      "; use context.per_slot_batch_size()");
  }
}

Batch DataLoader::Iterator::operator*() const {
  const std::uint64_t end =
      std::min(loader_->dataset().size(), position_ + static_cast<std::uint64_t>(loader_->batch_size()));
  std::vector<std::int64_t> indices;
  for (std::uint64_t i = position_; i < end; ++i) indices.push_back(static_cast<std::int64_t>(i));
  return loader_->dataset().get_batch(indices);
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  position_ = std::min(loader_->dataset().size(),
                       position_ + static_cast<std::uint64_t>(loader_->batch_size()));
  return *this;
}

}  // namespace hpctrial::trainer
