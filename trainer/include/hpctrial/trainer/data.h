// Datasets and data loaders.
//
// A Dataset hands out samples by index: get(3) is one sample, get_batch({3, 17, 5}) those
// samples stacked into one Batch (batch.h: the (data, target) pair `batch.data`, `batch.target`,
// or named and nested tensors). A dataset implements either or both: the default get_batch
// collates get(i), the default get takes row 0 of get_batch({i}). Built in: an in-memory
// TensorDataset, an Hdf5Dataset that reads only the rows a rank needs, and from_torch_dataset(),
// which adapts any LibTorch torch::data dataset.
//
// A StreamDataset has no indices: it hands out samples in its own order (records decoded from
// files read one after another, a generator), and the harness remembers where it stands.
//
// A DataLoader says which dataset, the per-slot batch size and its options (shuffle, drop_last,
// worker threads, a collate function); the harness decides the order (a function of the trial
// seed and the epoch only, see sampler.h), shards it over the ranks and reads batches ahead on
// the loader's worker threads.
#pragma once

#include <torch/arg.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hpctrial/trainer/batch.h"

namespace hpctrial::trainer {

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual std::uint64_t size() const = 0;
  // One sample (no batch dimension). Default: row 0 of get_batch({index}).
  virtual Batch get(std::int64_t index);
  // The samples at `indices` stacked along a new first dimension. Default: collate() of get(i).
  // Thread safety: a loader with workers(n > 1) calls get / get_batch from n threads at once,
  // as LibTorch's DataLoader does; guard shared state (a file handle) in the dataset.
  virtual Batch get_batch(const std::vector<std::int64_t>& indices);
};

// A dataset read in order, sample after sample, in passes: start(pass), then next() until it
// returns nothing. PyTorch's IterableDataset, with the position kept in checkpoints.
//
// Each rank reads a stream of its own: shard it where the trial builds it, by
// context.distributed().get_rank() and get_size(). Training reads pass after pass without end
// (records_per_epoch in the experiment config says how long an epoch is, since a stream cannot be
// counted). A checkpoint keeps each rank's pass and the samples it has trained on in it; a
// resumed trial calls start(pass) and skip(count), and trains on exactly the samples it would
// have seen. A stream must therefore give the same samples for the same pass: shuffle within a
// pass with a generator seeded by the pass and context.trial_seed(). Validation reads pass 0,
// whole, every time.
//
// The harness calls a stream from one thread at a time (a loader's worker thread when
// training), never concurrently.
class StreamDataset {
 public:
  virtual ~StreamDataset() = default;
  // Begins pass `pass` (0, 1, 2, ...) from its first sample.
  virtual void start(std::int64_t pass) = 0;
  // The next sample of the pass (no batch dimension), or nothing at its end.
  virtual std::optional<Batch> next() = 0;
  // Passes over the next `count` samples of the pass. Default: next() `count` times. Override
  // when the source can seek (a file offset, a record index).
  virtual void skip(std::uint64_t count);
};

// Samples are rows of two tensors with the same first dimension.
class TensorDataset final : public Dataset {
 public:
  TensorDataset(torch::Tensor data, torch::Tensor target);
  std::uint64_t size() const override;
  Batch get(std::int64_t index) override;
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
// is a ConfigError naming the file, the dataset and the fix. Reads from several loader workers
// take turns (the HDF5 library serializes them in any case).
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

// How a DataLoader reads, in LibTorch's option style: DataLoaderOptions().workers(4).drop_last(true).
struct DataLoaderOptions {
  using Collate = std::function<Batch(std::vector<Batch>)>;
  // Training: a shuffled stream, or 0, 1, 2, ... in every epoch. A StreamDataset orders its
  // own samples: shuffle does not apply to it.
  TORCH_ARG(bool, shuffle) = true;
  // Leave out the last, short batch. Training: each epoch is then whole global batches,
  // floor(records_per_epoch / global_batch_size) of them, and no batch spans two epochs (the
  // samples left at the end of an epoch's order are skipped). Validation: each rank's last
  // batch, when short, is not validated. A StreamDataset: a pass's last, short batch is left
  // out and the next batch starts the next pass (without drop_last, it is completed from the
  // next pass).
  TORCH_ARG(bool, drop_last) = false;
  // Threads reading batches ahead of training; batches are still handed over in order. 0 reads
  // each batch on the training thread when it is needed. A StreamDataset is read by one thread
  // (a stream has one position): any number above 1 counts as 1.
  TORCH_ARG(std::size_t, workers) = 1;
  // Stacks the samples of one batch, read one by one with Dataset::get; empty: the dataset's
  // get_batch (a StreamDataset's samples: collate()). For samples of different lengths (padding), or batches of another form.
  TORCH_ARG(Collate, collate);
};

class DataLoader {
 public:
  // `batch_size` is per slot (TrialContext::per_slot_batch_size()). For training, the harness
  // takes global batches of batch_size x ranks from a shuffled (or, with shuffle=false,
  // sequential) stream; for validation, each rank reads its share of the dataset in order.
  DataLoader(std::shared_ptr<Dataset> dataset, std::int64_t batch_size, bool shuffle = true);
  DataLoader(std::shared_ptr<Dataset> dataset, std::int64_t batch_size, DataLoaderOptions options);
  // A loader of this rank's stream: batches of `batch_size` consecutive samples, stacked by the
  // collate function (default: collate()).
  DataLoader(std::shared_ptr<StreamDataset> stream, std::int64_t batch_size,
             DataLoaderOptions options = DataLoaderOptions());

  // The indexed dataset; a ConfigError for a stream loader.
  Dataset& dataset() const;
  const std::shared_ptr<Dataset>& dataset_ptr() const { return dataset_; }
  // The stream, or null for a loader of an indexed dataset.
  const std::shared_ptr<StreamDataset>& stream() const { return stream_; }
  bool is_stream() const { return stream_ != nullptr; }
  std::int64_t batch_size() const { return batch_size_; }
  const DataLoaderOptions& options() const { return options_; }
  bool shuffle() const { return options_.shuffle(); }
  bool drop_last() const { return options_.drop_last(); }

  // The batch of the samples at `indices`: the collate function over Dataset::get, or the
  // dataset's get_batch.
  Batch read(const std::vector<std::int64_t>& indices) const;
  // The batch of `samples` read from a stream: the collate function over them, or collate().
  Batch collate_samples(std::vector<Batch> samples) const;

  // Sequential batches over the whole dataset, or pass 0 of a stream (for evaluate_full_dataset):
  // `for (auto batch : loader)`. The last batch may be short, unless drop_last.
  class Iterator {
   public:
    Iterator(const DataLoader* loader, std::uint64_t position);
    Batch operator*() const;
    Iterator& operator++();
    bool operator!=(const Iterator& other) const { return position_ != other.position_; }

   private:
    void read_stream_batch();

    const DataLoader* loader_;
    std::uint64_t position_;  // samples (a stream: batches) before the current batch; UINT64_MAX: a stream's end
    Batch stream_batch_;      // a stream loader's current batch
  };
  Iterator begin() const;
  Iterator end() const;

 private:
  std::shared_ptr<Dataset> dataset_;
  std::shared_ptr<StreamDataset> stream_;
  std::int64_t batch_size_;
  DataLoaderOptions options_;
};

namespace detail {

template <typename TorchDataset>
class TorchDatasetAdapter final : public Dataset {
 public:
  explicit TorchDatasetAdapter(TorchDataset dataset) : dataset_(std::move(dataset)) {}
  std::uint64_t size() const override { return dataset_.size().value(); }
  Batch get(std::int64_t index) override { return Batch(dataset_.get(static_cast<std::size_t>(index))); }

 private:
  TorchDataset dataset_;
};

}  // namespace detail

template <typename TorchDataset>
std::shared_ptr<Dataset> from_torch_dataset(TorchDataset dataset) {
  return std::make_shared<detail::TorchDatasetAdapter<TorchDataset>>(std::move(dataset));
}

}  // namespace hpctrial::trainer
