#include "hpctrial/trainer/batch.h"

#include <torch/torch.h>

#include <algorithm>

#include "hpctrial/core/error.h"

namespace hpctrial::trainer {

Batch::Batch(torch::Tensor tensor) : kind_(Kind::kTensor), tensor_(std::move(tensor)) {}

Batch Batch::list(std::vector<Batch> items) {
  Batch b;
  b.kind_ = Kind::kList;
  b.items_ = std::move(items);
  return b;
}

Batch Batch::map(std::vector<std::pair<std::string, Batch>> fields) {
  Batch b;
  b.kind_ = Kind::kMap;
  for (auto& [key, value] : fields) {
    if (b.contains(key)) throw ConfigError("Batch::map: the key \"" + key + "\" is given twice");
    b.keys_.push_back(key);
    b.items_.push_back(std::move(value));
  }
  return b;
}

Batch::Kind Batch::kind() const {
  if (kind_ == Kind::kEmpty && (data.defined() || target.defined())) return Kind::kPair;
  return kind_;
}

const torch::Tensor& Batch::tensor() const {
  if (kind_ != Kind::kTensor) throw ConfigError("Batch::tensor(): the batch is a " + describe() + ", not one tensor");
  return tensor_;
}

std::size_t Batch::size() const {
  switch (kind()) {
    case Kind::kEmpty: return 0;
    case Kind::kPair: return 2;
    case Kind::kTensor: return 1;
    case Kind::kList:
    case Kind::kMap: return items_.size();
  }
  return 0;
}

const Batch& Batch::operator[](std::size_t index) const {
  if (kind_ != Kind::kList) {
    throw ConfigError("batch[" + std::to_string(index) + "]: the batch is a " + describe() +
                      (kind() == Kind::kPair ? "; use batch.data and batch.target" : ", not a sequence"));
  }
  if (index >= items_.size()) {
    throw ConfigError("batch[" + std::to_string(index) + "]: the batch is a " + describe());
  }
  return items_[index];
}

Batch& Batch::operator[](std::size_t index) {
  return const_cast<Batch&>(static_cast<const Batch&>(*this)[index]);
}

const Batch& Batch::operator[](const std::string& key) const {
  if (kind_ != Kind::kMap) throw ConfigError("batch[\"" + key + "\"]: the batch is a " + describe() + ", not a map");
  for (std::size_t i = 0; i < keys_.size(); ++i) {
    if (keys_[i] == key) return items_[i];
  }
  throw ConfigError("batch[\"" + key + "\"]: no such entry; the batch is a " + describe());
}

Batch& Batch::operator[](const std::string& key) {
  return const_cast<Batch&>(static_cast<const Batch&>(*this)[key]);
}

bool Batch::contains(const std::string& key) const {
  return std::find(keys_.begin(), keys_.end(), key) != keys_.end();
}

std::vector<torch::Tensor> Batch::tensors() const {
  std::vector<torch::Tensor> out;
  switch (kind()) {
    case Kind::kEmpty: break;
    case Kind::kPair:
      out.push_back(data);
      out.push_back(target);
      break;
    case Kind::kTensor: out.push_back(tensor_); break;
    case Kind::kList:
    case Kind::kMap:
      for (const auto& item : items_) {
        auto inner = item.tensors();
        out.insert(out.end(), inner.begin(), inner.end());
      }
  }
  return out;
}

Batch Batch::map_tensors(const std::function<torch::Tensor(const torch::Tensor&)>& f) const {
  const auto apply = [&](const torch::Tensor& t) { return t.defined() ? f(t) : t; };
  Batch out;
  out.kind_ = kind_;
  out.keys_ = keys_;
  out.data = apply(data);
  out.target = apply(target);
  if (kind_ == Kind::kTensor) out.tensor_ = apply(tensor_);
  out.items_.reserve(items_.size());
  for (const auto& item : items_) out.items_.push_back(item.map_tensors(f));
  return out;
}

std::int64_t Batch::num_samples() const {
  for (const auto& t : tensors()) {
    if (t.defined()) return t.dim() == 0 ? 1 : t.size(0);
  }
  return 0;
}

std::string Batch::describe() const {
  switch (kind()) {
    case Kind::kEmpty: return "empty batch";
    case Kind::kPair: return "(data, target) pair";
    case Kind::kTensor: return "tensor " + c10::str(tensor_.sizes());
    case Kind::kList: return "sequence of " + std::to_string(items_.size());
    case Kind::kMap: {
      std::string keys;
      for (const auto& k : keys_) keys += (keys.empty() ? "" : ", ") + k;
      return "map {" + keys + "}";
    }
  }
  return "batch";
}

namespace {

torch::Tensor stack_entry(const std::vector<torch::Tensor>& tensors, const std::string& where) {
  const auto defined = [](const torch::Tensor& t) { return t.defined(); };
  if (std::none_of(tensors.begin(), tensors.end(), defined)) return torch::Tensor();  // a pair without a target
  if (!std::all_of(tensors.begin(), tensors.end(), defined)) {
    throw ConfigError("collate: " + where + " is defined in some samples and not in others");
  }
  for (std::size_t i = 1; i < tensors.size(); ++i) {
    if (tensors[i].sizes() != tensors[0].sizes() || tensors[i].scalar_type() != tensors[0].scalar_type()) {
      throw ConfigError("collate: sample " + std::to_string(i) + " has " + where + " of shape " +
                        c10::str(tensors[i].sizes()) + " " + std::string(c10::toString(tensors[i].scalar_type())) +
                        " where sample 0 has " + c10::str(tensors[0].sizes()) + " " +
                        std::string(c10::toString(tensors[0].scalar_type())) +
                        "; pad the samples to one shape, or give the DataLoader a collate function");
    }
  }
  return torch::stack(tensors);
}

Batch collate_at(const std::vector<const Batch*>& samples, const std::string& where) {
  const Batch& first = *samples.front();
  for (std::size_t i = 1; i < samples.size(); ++i) {
    const Batch& s = *samples[i];
    if (s.kind() != first.kind() || s.size() != first.size() || s.keys() != first.keys()) {
      throw ConfigError("collate: sample " + std::to_string(i) + " is a " + s.describe() + " at " + where +
                        " where sample 0 is a " + first.describe() + "; a dataset's samples need one structure");
    }
  }
  const auto column = [&](const auto& pick) {
    std::vector<torch::Tensor> out;
    out.reserve(samples.size());
    for (const Batch* s : samples) out.push_back(pick(*s));
    return out;
  };
  switch (first.kind()) {
    case Batch::Kind::kEmpty: return Batch();
    case Batch::Kind::kPair:
      return Batch(stack_entry(column([](const Batch& s) { return s.data; }), where + ".data"),
                   stack_entry(column([](const Batch& s) { return s.target; }), where + ".target"));
    case Batch::Kind::kTensor:
      return Batch(stack_entry(column([](const Batch& s) { return s.tensor(); }), where));
    case Batch::Kind::kList:
    case Batch::Kind::kMap: {
      const bool is_map = first.kind() == Batch::Kind::kMap;
      std::vector<Batch> entries;
      std::vector<const Batch*> entry(samples.size());
      for (std::size_t k = 0; k < first.size(); ++k) {
        for (std::size_t i = 0; i < samples.size(); ++i) entry[i] = &samples[i]->items()[k];
        entries.push_back(collate_at(entry, is_map ? where + "[\"" + first.keys()[k] + "\"]" : where + "[" + std::to_string(k) + "]"));
      }
      if (!is_map) return Batch::list(std::move(entries));
      std::vector<std::pair<std::string, Batch>> fields;
      for (std::size_t k = 0; k < entries.size(); ++k) fields.emplace_back(first.keys()[k], std::move(entries[k]));
      return Batch::map(std::move(fields));
    }
  }
  return Batch();
}

}  // namespace

Batch collate(const std::vector<Batch>& samples) {
  if (samples.empty()) throw ConfigError("collate: no samples to stack");
  std::vector<const Batch*> pointers;
  pointers.reserve(samples.size());
  for (const auto& s : samples) pointers.push_back(&s);
  return collate_at(pointers, "batch");
}

}  // namespace hpctrial::trainer
