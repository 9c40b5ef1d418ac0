// What a data loader yields and train_batch / evaluate_batch receive, in the forms PyTorch
// trials use:
//   - the (data, target) pair most datasets give: `batch.data`, `batch.target`;
//   - one tensor: `batch.tensor()`;
//   - a sequence: `batch[0]`, `batch.size()`;
//   - a map of named entries, in insertion order: `batch["input_ids"]`, `batch.contains("mask")`;
// nested to any depth (`batch["image"][1].tensor()`). context.to_device() moves every tensor
// of any form; collate() stacks samples of any form into a batch, as PyTorch's default_collate.
//
// A Batch is a plain value: copying it copies the tree, not the tensors (which share storage,
// as torch::Tensor copies do). A wrong access (a key that is not there, an index past the end,
// tensor() on a map) throws ConfigError naming what the batch holds.
#pragma once

#include <torch/data/example.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace hpctrial::trainer {

class Batch {
 public:
  enum class Kind { kEmpty, kPair, kTensor, kList, kMap };

  Batch() = default;
  // The pair.
  Batch(torch::Tensor data_tensor, torch::Tensor target_tensor)
      : data(std::move(data_tensor)), target(std::move(target_tensor)) {}
  Batch(torch::data::Example<> example) : data(std::move(example.data)), target(std::move(example.target)) {}
  // One tensor.
  Batch(torch::Tensor tensor);
  // A sequence, and a map whose entries keep the order given.
  static Batch list(std::vector<Batch> items);
  static Batch map(std::vector<std::pair<std::string, Batch>> fields);

  // The pair form (undefined tensors in the other forms).
  torch::Tensor data;
  torch::Tensor target;

  Kind kind() const;
  const torch::Tensor& tensor() const;
  // Sequences and maps: the number of entries. A pair has 2, a tensor 1.
  std::size_t size() const;
  const Batch& operator[](std::size_t index) const;
  Batch& operator[](std::size_t index);
  const Batch& operator[](const std::string& key) const;
  Batch& operator[](const std::string& key);
  bool contains(const std::string& key) const;
  const std::vector<std::string>& keys() const { return keys_; }
  const std::vector<Batch>& items() const { return items_; }

  // Every tensor, depth first, the pair as (data, target).
  std::vector<torch::Tensor> tensors() const;
  // The same structure with `f` applied to every tensor.
  Batch map_tensors(const std::function<torch::Tensor(const torch::Tensor&)>& f) const;
  // The number of samples: the first dimension of the first tensor (0 when there is none).
  std::int64_t num_samples() const;
  // "pair", "tensor [4, 3]", "map {x, y}", "list of 2", for messages.
  std::string describe() const;

 private:
  Kind kind_ = Kind::kEmpty;  // kPair is not stored: it is `data` or `target` being defined
  torch::Tensor tensor_;
  std::vector<Batch> items_;       // a list's entries, or a map's values
  std::vector<std::string> keys_;  // a map's keys, parallel to items_
};

// Stacks samples of one structure along a new first dimension, as PyTorch's default_collate:
// tensors with torch::stack, sequences and maps entry by entry, pairs as pairs. Samples that
// differ in structure, keys or tensor shape give a ConfigError naming the sample and the entry.
Batch collate(const std::vector<Batch>& samples);

}  // namespace hpctrial::trainer
