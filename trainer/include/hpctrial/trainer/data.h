// Datasets and data loaders.
//
// A Dataset hands out batches by index: get_batch({3, 17, 5}) stacks those samples into one
// Batch (LibTorch's torch::data::Example: `batch.data`, `batch.target`). Built in: an
// in-memory TensorDataset, an Hdf5Dataset that reads only the rows a rank needs, and
// from_torch_dataset(), which adapts any LibTorch torch::data dataset.
//
// A DataLoader says which dataset, the per-slot batch size and whether to shuffle; the
// harness decides the order (a function of the trial seed and the epoch only, see
// sampler.h), shards it over the ranks and prefetches batches on a background thread.
#pragma once

#include <torch/data/example.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace hpctrial::trainer {

using Batch = torch::data::Example<>;

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual std::uint64_t size() const = 0;
  // The samples at `indices` stacked along a new first dimension. Thread safety: called from
  // one prefetch thread at a time.
  virtual Batch get_batch(const std::vector<std::int64_t>& indices) = 0;
};

// Samples are rows of two tensors with the same first dimension.
class TensorDataset final : public Dataset {
 public:
  TensorDataset(torch::Tensor data, torch::Tensor target);
  std::uint64_t size() const override;
  Batch get_batch(const std::vector<std::int64_t>& indices) override;

 private:
  torch::Tensor data_;
  torch::Tensor target_;
};

// Adapts a LibTorch dataset (anything with get(index) -> Example<> and size()), so existing
// C++ datasets work unchanged: `from_torch_dataset(torch::data::datasets::MNIST(root))`.
template <typename TorchDataset>
std::shared_ptr<Dataset> from_torch_dataset(TorchDataset dataset);

// Reads two datasets of one HDF5 file: `data_name` (N x ...) and `target_name` (N or N x ...),
// of any numeric type. Only the rows a batch needs are read. Construction checks that the
// file opens, both datasets exist, are numeric, and have the same number of rows: a problem
// is a ConfigError naming the file, the dataset and the fix.
class Hdf5Dataset final : public Dataset {
 public:
  Hdf5Dataset(const std::string& path, const std::string& data_name = "x",
              const std::string& target_name = "y");
  ~Hdf5Dataset() override;
  Hdf5Dataset(const Hdf5Dataset&) = delete;
  Hdf5Dataset& operator=(const Hdf5Dataset&) = delete;

  std::uint64_t size() const override;
  Batch get_batch(const std::vector<std::int64_t>& indices) override;
  // The shape of one sample of `data_name` (without the row dimension).
  std::vector<std::int64_t> sample_shape() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class DataLoader {
 public:
  // `batch_size` is per slot (TrialContext::per_slot_batch_size()). For training, the harness
  // takes global batches of batch_size x ranks from a shuffled (or, with shuffle=false,
  // sequential) stream; for validation, each rank reads its share of the dataset in order.
  DataLoader(std::shared_ptr<Dataset> dataset, std::int64_t batch_size, bool shuffle = true);

  Dataset& dataset() const { return *dataset_; }
  const std::shared_ptr<Dataset>& dataset_ptr() const { return dataset_; }
  std::int64_t batch_size() const { return batch_size_; }
  bool shuffle() const { return shuffle_; }

  // Sequential batches over the whole dataset (for evaluate_full_dataset): `for (auto& batch :
  // loader)`. The last batch may be short.
  class Iterator {
   public:
    Iterator(const DataLoader* loader, std::uint64_t position) : loader_(loader), position_(position) {}
    Batch operator*() const;
    Iterator& operator++();
    bool operator!=(const Iterator& other) const { return position_ != other.position_; }

   private:
    const DataLoader* loader_;
    std::uint64_t position_;
  };
  Iterator begin() const { return Iterator(this, 0); }
  Iterator end() const { return Iterator(this, dataset_->size()); }

 private:
  std::shared_ptr<Dataset> dataset_;
  std::int64_t batch_size_;
  bool shuffle_;
};

namespace detail {

template <typename TorchDataset>
class TorchDatasetAdapter final : public Dataset {
 public:
  explicit TorchDatasetAdapter(TorchDataset dataset) : dataset_(std::move(dataset)) {}
  std::uint64_t size() const override { return dataset_.size().value(); }
  Batch get_batch(const std::vector<std::int64_t>& indices) override {
    std::vector<torch::Tensor> data, target;
    data.reserve(indices.size());
    target.reserve(indices.size());
    for (const std::int64_t i : indices) {
      auto example = dataset_.get(static_cast<std::size_t>(i));
      data.push_back(std::move(example.data));
      target.push_back(std::move(example.target));
    }
    return {torch::stack(data), torch::stack(target)};
  }

 private:
  TorchDataset dataset_;
};

}  // namespace detail

template <typename TorchDataset>
std::shared_ptr<Dataset> from_torch_dataset(TorchDataset dataset) {
  return std::make_shared<detail::TorchDatasetAdapter<TorchDataset>>(std::move(dataset));
}

}  // namespace hpctrial::trainer
