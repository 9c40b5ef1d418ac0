#include "hpctrial/trainer/data.h"

#include <torch/torch.h>

#include <algorithm>

#include "hpctrial/core/error.h"
#include "data/stream_reader.h"

namespace hpctrial::trainer {

namespace {
// Set while a default get() reads through get_batch(): a dataset that overrides neither would
// otherwise recurse until the stack runs out.
thread_local bool in_default_get = false;
void check_batch_size(std::int64_t batch_size) {
  if (batch_size < 1) {
    throw ConfigError("DataLoader: the batch size must be positive, got " + std::to_string(batch_size) +
                      "; use context.per_slot_batch_size()");
  }
}
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

void StreamDataset::skip(std::uint64_t count) {
  for (std::uint64_t i = 0; i < count; ++i) {
    if (!next()) return;
  }
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
  // A view of the indices, not a copy: torch::tensor's conversion of a vector costs as much as
  // the rows' copy of a small batch, and index_select is done with it before this returns.
  const auto index = torch::from_blob(const_cast<std::int64_t*>(indices.data()),
                                      {static_cast<std::int64_t>(indices.size())}, torch::kInt64);
  return {data_.index_select(0, index), target_.index_select(0, index)};
}

DataLoader::DataLoader(std::shared_ptr<Dataset> dataset, std::int64_t batch_size, bool shuffle)
    : DataLoader(std::move(dataset), batch_size, DataLoaderOptions().shuffle(shuffle)) {}

DataLoader::DataLoader(std::shared_ptr<Dataset> dataset, std::int64_t batch_size, DataLoaderOptions options)
    : dataset_(std::move(dataset)), batch_size_(batch_size), options_(std::move(options)) {
  if (!dataset_) throw ConfigError("DataLoader: the dataset is null");
  check_batch_size(batch_size_);
}

DataLoader::DataLoader(std::shared_ptr<StreamDataset> stream, std::int64_t batch_size, DataLoaderOptions options)
    : stream_(std::move(stream)), batch_size_(batch_size), options_(std::move(options)) {
  if (!stream_) throw ConfigError("DataLoader: the stream is null");
  check_batch_size(batch_size_);
  options_.workers(std::min<std::size_t>(options_.workers(), 1));
}

Dataset& DataLoader::dataset() const {
  if (!dataset_) {
    throw ConfigError("the data loader reads a stream (StreamDataset), which has no indexed samples; use "
                      "loader.stream(), or iterate over the loader");
  }
  return *dataset_;
}

Batch DataLoader::collate_samples(std::vector<Batch> samples) const {
  return options_.collate() ? options_.collate()(std::move(samples)) : collate(samples);
}

Batch DataLoader::read(const std::vector<std::int64_t>& indices) const {
  if (!options_.collate()) return dataset_->get_batch(indices);
  std::vector<Batch> samples;
  samples.reserve(indices.size());
  for (const std::int64_t i : indices) samples.push_back(dataset_->get(i));
  return options_.collate()(std::move(samples));
}

DataLoader::Iterator DataLoader::begin() const {
  if (stream_) stream_->start(0);
  return Iterator(this, 0);
}

DataLoader::Iterator DataLoader::end() const {
  if (stream_) return Iterator(this, UINT64_MAX);
  const std::uint64_t size = dataset_->size();
  const auto batch = static_cast<std::uint64_t>(batch_size_);
  return Iterator(this, drop_last() ? size - size % batch : size);
}

DataLoader::Iterator::Iterator(const DataLoader* loader, std::uint64_t position)
    : loader_(loader), position_(position) {
  if (loader_->is_stream() && position_ != UINT64_MAX) read_stream_batch();
}

// The next batch of pass 0; past its end (or its short last batch, with drop_last), the end.
void DataLoader::Iterator::read_stream_batch() {
  auto samples = detail::read_samples(*loader_->stream(), static_cast<std::uint64_t>(loader_->batch_size()));
  if (samples.empty() || (loader_->drop_last() && static_cast<std::int64_t>(samples.size()) < loader_->batch_size())) {
    position_ = UINT64_MAX;
    stream_batch_ = Batch();
    return;
  }
  stream_batch_ = loader_->collate_samples(std::move(samples));
}

Batch DataLoader::Iterator::operator*() const {
  if (loader_->is_stream()) return stream_batch_;
  const std::uint64_t end =
      std::min(loader_->dataset().size(), position_ + static_cast<std::uint64_t>(loader_->batch_size()));
  std::vector<std::int64_t> indices;
  for (std::uint64_t i = position_; i < end; ++i) indices.push_back(static_cast<std::int64_t>(i));
  return loader_->read(indices);
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  if (loader_->is_stream()) {
    ++position_;
    read_stream_batch();
    return *this;
  }
  position_ = std::min(loader_->dataset().size(),
                       position_ + static_cast<std::uint64_t>(loader_->batch_size()));
  return *this;
}

}  // namespace hpctrial::trainer
