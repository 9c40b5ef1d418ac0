// ZeRO's optimizer state in checkpoints: gathered whole on save, cut into this rank's parts on
// load, so that the file does not depend on the number of ranks, the stage or the buckets.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <string>

#include "hpctrial/core/error.h"
#include "state/state_io.h"
#include "parallel/zero.h"

namespace hpctrial::trainer::detail {
namespace {

// The tensor fields of the state of parameter `index` under `prefix` (datasets
// prefix/state/<index>/<field>, without the scalars).
std::vector<std::string> state_fields(const checkpoint::Contents& contents, const std::string& prefix, std::size_t index) {
  const std::string start = prefix + "/state/" + std::to_string(index) + "/";
  std::vector<std::string> fields;
  for (const auto& d : contents.datasets) {
    if (d.name.rfind(start, 0) != 0) continue;
    std::string field = d.name.substr(start.size());
    if (field != "scalars") fields.push_back(std::move(field));
  }
  std::sort(fields.begin(), fields.end());
  return fields;
}

std::string state_name(const std::string& prefix, std::size_t index, const std::string& field) {
  return prefix + "/state/" + std::to_string(index) + "/" + field;
}

// The optimizer's own save of this rank's parts (as optimizer "s"), its type added to `out`
// under `prefix`, and its parameter groups.
nlohmann::json save_parts(torch::optim::Optimizer& optimizer, StateSwapper* swapper, checkpoint::Contents& parts,
                          checkpoint::Contents& out, const std::string& prefix) {
  if (swapper == nullptr) {
    save_optimizer(parts, "s", optimizer);
  } else {
    // State swapped out is not read into memory: its datasets map the swap file.
    for (const auto& d : view_optimizer(parts, "s", optimizer)) {
      parts.add(d.name, checkpoint_dtype(d.tensor.scalar_type()), d.tensor.sizes().vec(), swapper->bytes_of(d.tensor));
    }
  }
  out.add_text(prefix + "/type", parts.at("s/type", "the sharded optimizer").text());
  return nlohmann::json::parse(parts.at("s/param_groups", "the sharded optimizer").text());
}

}  // namespace

std::vector<std::vector<torch::Tensor>> ShardedOptimizer::parameter_groups() const {
  std::vector<std::vector<torch::Tensor>> out;
  for (const Group& group : groups_) out.push_back(group.params);
  return out;
}

void ShardedOptimizer::save_whole(checkpoint::Contents& contents, const std::string& prefix) {
  checkpoint::Contents parts;
  auto groups = save_parts(optimizer_, swapper_.get(), parts, contents, prefix);
  const int ranks = comm_.size();
  std::size_t first = 0;  // the index of the group's first parameter over all groups
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const Group& group = groups_[g];
    nlohmann::json params = nlohmann::json::array();
    for (std::size_t i = 0; i < group.params.size(); ++i) params.push_back(first + i);
    groups[g]["params"] = params;
    for (std::size_t b = 0; b < group.layout.buckets.size(); ++b) {
      const auto& bucket = group.layout.buckets[b];
      const std::size_t index = group.first_part + b;
      // Every rank's part has state, or none has (they step together).
      const checkpoint::Dataset* scalars = parts.find(state_name("s", index, "scalars"));
      if (scalars == nullptr) continue;
      for (const std::string& field : state_fields(parts, "s", index)) {
        const torch::Tensor part = tensor_of(parts.at(state_name("s", index, field), "the shard"));
        if (part.scalar_type() != torch::kFloat32 || part.numel() != bucket.part) {
          throw InternalError("ZeRO: optimizer state field " + field + " is not a float32 part of a bucket");
        }
        auto whole = torch::empty({bucket.part * ranks}, part.options());
        comm_.allgather(part.data_ptr(), whole.data_ptr(), static_cast<std::size_t>(bucket.part), comm::DType::kFloat32);
        for (std::size_t i = bucket.first; i < bucket.end; ++i) {
          const auto piece = whole.narrow(0, group.layout.offsets[i] - bucket.begin, group.layout.numels[i]);
          add_tensor(contents, state_name(prefix, first + i, field), piece.view(group.shapes[i]));
        }
      }
      for (std::size_t i = bucket.first; i < bucket.end; ++i) {
        contents.add_text(state_name(prefix, first + i, "scalars"), scalars->text());
      }
    }
    first += group.params.size();
  }
  contents.add_text(prefix + "/param_groups", groups.dump());
}

void ShardedOptimizer::save_shards(ShardedSave& out, const std::string& prefix) {
  checkpoint::Contents parts;
  auto groups = save_parts(optimizer_, swapper_.get(), parts, out.whole, prefix);
  const std::int64_t rank = comm_.rank();
  std::size_t first = 0;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const Group& group = groups_[g];
    nlohmann::json params = nlohmann::json::array();
    for (std::size_t i = 0; i < group.params.size(); ++i) params.push_back(first + i);
    groups[g]["params"] = params;
    for (std::size_t b = 0; b < group.layout.buckets.size(); ++b) {
      const auto& bucket = group.layout.buckets[b];
      const std::size_t index = group.first_part + b;
      const checkpoint::Dataset* scalars = parts.find(state_name("s", index, "scalars"));
      if (scalars == nullptr) continue;
      // This rank's part covers these elements of the group's buffer.
      const std::int64_t mine = bucket.begin + rank * bucket.part, mine_end = mine + bucket.part;
      for (const std::string& field : state_fields(parts, "s", index)) {
        const checkpoint::Dataset& part = parts.at(state_name("s", index, field), "the shard");
        if (part.dtype != checkpoint::DType::kFloat32 || part.nbytes() != static_cast<std::size_t>(bucket.part) * 4) {
          throw InternalError("ZeRO: optimizer state field " + field + " is not a float32 part of a bucket");
        }
        for (std::size_t i = bucket.first; i < bucket.end; ++i) {
          out.datasets.push_back({state_name(prefix, first + i, field), checkpoint::DType::kFloat32,
                                  group.shapes[i]});
          const std::int64_t lo = std::max(mine, group.layout.offsets[i]);
          const std::int64_t hi = std::min(mine_end, group.layout.offsets[i] + group.layout.numels[i]);
          if (lo >= hi) continue;
          ShardPiece piece;
          piece.dataset = out.datasets.size() - 1;
          piece.offset = static_cast<std::uint64_t>(lo - group.layout.offsets[i]) * 4;
          piece.buffer = part.data;
          piece.from = static_cast<std::size_t>(lo - mine) * 4;
          piece.size = static_cast<std::size_t>(hi - lo) * 4;
          piece.crc = checkpoint::crc32c(static_cast<const char*>(part.data->data()) + piece.from, piece.size);
          out.pieces.push_back(std::move(piece));
        }
      }
      for (std::size_t i = bucket.first; i < bucket.end; ++i) {
        out.whole.add_text(state_name(prefix, first + i, "scalars"), scalars->text());
      }
    }
    first += group.params.size();
  }
  out.whole.add_text(prefix + "/param_groups", groups.dump());
}

void ShardedOptimizer::save_parameter_shards(ShardedSave& out,
                                             const std::vector<std::vector<std::string>>& names) const {
  if (options_.stage != 3) return;
  const std::int64_t rank = comm_.rank();
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const Group& group = groups_[g];
    for (std::size_t i = 0; i < group.params.size(); ++i) {
      out.datasets.push_back({names.at(g).at(i), checkpoint::DType::kFloat32, group.shapes[i]});
      const auto [lo, hi] = part_range(group.layout.numels[i], group.layout.buckets[i].part, rank);
      if (lo >= hi) continue;  // this rank's part is padding only
      const auto size = static_cast<std::size_t>(hi - lo) * 4;
      std::shared_ptr<const checkpoint::Buffer> buffer;
      if (swapper_ && StateSwapper::swapped_out(group.parts[i])) {
        buffer = swapper_->bytes_of(group.parts[i]);  // mapped from the swap file, which the next step leaves
      } else {
        // Copied now: the next step changes the part.
        auto copy = std::make_shared<checkpoint::Buffer>(size);
        torch::from_blob(copy->data(), {hi - lo}, torch::kFloat32).copy_(group.parts[i].narrow(0, 0, hi - lo));
        buffer = copy;
      }
      ShardPiece piece;
      piece.dataset = out.datasets.size() - 1;
      piece.offset = static_cast<std::uint64_t>(lo) * 4;
      piece.buffer = buffer;
      piece.size = size;
      piece.crc = checkpoint::crc32c(buffer->data(), size);
      out.pieces.push_back(std::move(piece));
    }
  }
}

void ShardedOptimizer::load_whole(const checkpoint::Contents& contents, const std::string& prefix,
                                  const std::string& file) {
  checkpoint::Contents parts;
  parts.add_text("s/type", contents.at(prefix + "/type", file).text());
  nlohmann::json groups;
  try {
    groups = nlohmann::json::parse(contents.at(prefix + "/param_groups", file).text());
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(file + ": " + prefix + "/param_groups is not valid JSON: " + e.what());
  }
  if (!groups.is_array() || groups.size() != groups_.size()) {
    throw ConfigError(file + ": " + prefix + " has " + std::to_string(groups.is_array() ? groups.size() : 0) +
                      " parameter groups in the checkpoint and " + std::to_string(groups_.size()) +
                      " in the trial: the trial changed since the checkpoint");
  }
  const int rank = comm_.rank();
  // Stage 3: a parameter's state at a time, read from the ranges of the datasets this rank's part
  // covers, so that neither the state whole nor this rank's shard of it is ever in memory at once.
  const bool by_parameter = options_.stage == 3;
  std::size_t first = 0;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const Group& group = groups_[g];
    if (!groups[g].contains("params") || groups[g]["params"].size() != group.params.size()) {
      throw ConfigError(file + ": " + prefix + " group " + std::to_string(g) + " has another number of parameters "
                        "in the checkpoint than in the trial (" + std::to_string(group.params.size()) + ")");
    }
    nlohmann::json indices = nlohmann::json::array();
    for (std::size_t b = 0; b < group.layout.buckets.size(); ++b) {
      const auto& bucket = group.layout.buckets[b];
      const std::size_t index = group.first_part + b;
      indices.push_back(index);
      if (by_parameter) continue;
      // The state of the bucket's parameters, laid end to end as in the buffer; this rank keeps
      // its part. Parameters without state (never stepped) contribute zeros.
      const checkpoint::Dataset* scalars = nullptr;
      std::vector<std::string> fields;
      for (std::size_t i = bucket.first; i < bucket.end && scalars == nullptr; ++i) {
        scalars = contents.find(state_name(prefix, first + i, "scalars"));
        if (scalars != nullptr) fields = state_fields(contents, prefix, first + i);
      }
      if (scalars == nullptr) continue;
      for (const std::string& field : fields) {
        auto whole = torch::zeros({bucket.part * comm_.size()}, torch::kFloat32);
        for (std::size_t i = bucket.first; i < bucket.end; ++i) {
          const std::string name = state_name(prefix, first + i, field);
          const checkpoint::Dataset* d = contents.find(name);
          if (d == nullptr) continue;
          const torch::Tensor piece = tensor_of(*d);
          if (piece.numel() != group.layout.numels[i] || piece.scalar_type() != torch::kFloat32) {
            throw ConfigError(file + ": " + name + " has " + std::to_string(piece.numel()) + " elements in the "
                              "checkpoint but the parameter has " + std::to_string(group.layout.numels[i]) +
                              ": the model changed since the checkpoint");
          }
          whole.narrow(0, group.layout.offsets[i] - bucket.begin, group.layout.numels[i]).copy_(piece.reshape({-1}));
        }
        add_tensor(parts, state_name("s", index, field), whole.narrow(0, bucket.part * rank, bucket.part));
      }
      parts.add_text(state_name("s", index, "scalars"), scalars->text());
    }
    groups[g]["params"] = indices;
    first += group.params.size();
  }
  parts.add_text("s/param_groups", groups.dump());
  load_optimizer(parts, "s", optimizer_, file);  // stage 3: the options, and no state yet
  if (by_parameter) {
    load_state_parts(contents, prefix, file);
  } else if (swapper_) {
    swapper_->write_out_all();  // the loaded state, made in memory
  }
}

void ShardedOptimizer::load_state_parts(const checkpoint::Contents& contents, const std::string& prefix,
                                        const std::string& file) {
  const std::int64_t rank = comm_.rank();
  std::size_t first = 0;
  for (const Group& group : groups_) {
    for (std::size_t i = 0; i < group.params.size(); ++i) {
      const checkpoint::Dataset* scalars = contents.find(state_name(prefix, first + i, "scalars"));
      if (scalars == nullptr) continue;  // never stepped
      const std::int64_t part = group.layout.buckets.at(i).part;
      const auto [lo, hi] = part_range(group.layout.numels[i], part, rank);
      checkpoint::Contents one;
      one.add_text(state_name("s", 0, "scalars"), scalars->text());
      for (const std::string& field : state_fields(contents, prefix, first + i)) {
        const std::string name = state_name(prefix, first + i, field);
        const checkpoint::Dataset& d = contents.at(name, file);
        if (d.dtype != checkpoint::DType::kFloat32 || d.nbytes() != static_cast<std::size_t>(group.layout.numels[i]) * 4) {
          throw ConfigError(file + ": " + name + " has " + std::to_string(d.nbytes() / 4) + " float32 elements in the "
                            "checkpoint but the parameter has " + std::to_string(group.layout.numels[i]) +
                            ": the model changed since the checkpoint");
        }
        auto bytes = std::make_shared<checkpoint::Buffer>(static_cast<std::size_t>(part) * 4);
        std::memset(bytes->data(), 0, bytes->size());  // the padding
        checkpoint::read_bytes(d, static_cast<std::uint64_t>(lo) * 4, static_cast<std::uint64_t>(hi - lo) * 4,
                               bytes->data());
        one.add(state_name("s", 0, field), checkpoint::DType::kFloat32, {part}, std::move(bytes));
      }
      load_parameter_state(one, "s/state/0", optimizer_, group.parts[i], file);
      if (swapper_) swapper_->write_out_parameter(group.parts[i]);
    }
    first += group.params.size();
  }
}

void ShardedOptimizer::load_part(std::size_t g, std::size_t i, const checkpoint::Dataset& whole,
                                 const std::string& file) {
  const Group& group = groups_.at(g);
  if (whole.shape != group.shapes.at(i) || whole.dtype != checkpoint::DType::kFloat32) {
    throw ConfigError(file + ": " + whole.name + " is " + checkpoint::to_string(whole.dtype) + " " +
                      c10::str(c10::IntArrayRef(whole.shape)) + " in the checkpoint but float32 " +
                      c10::str(c10::IntArrayRef(group.shapes[i])) +
                      " in the model: the config changed the model since the checkpoint");
  }
  parts_changed();
  drop(groups_[g], i);  // its whole value is the old one
  const torch::Tensor& part = group.parts[i];
  const auto [lo, hi] = part_range(group.layout.numels[i], group.layout.buckets.at(i).part, comm_.rank());
  torch::NoGradGuard no_grad;
  const auto range = torch::empty({hi - lo}, torch::kFloat32);  // on the host, for a part on a device
  checkpoint::read_bytes(whole, static_cast<std::uint64_t>(lo) * 4, static_cast<std::uint64_t>(hi - lo) * 4,
                         range.data_ptr());
  if (swapper_) swapper_->bring_in({part});
  part.zero_();  // the padding
  part.narrow(0, 0, hi - lo).copy_(range);
  if (swapper_) swapper_->let_go({part}, /*changed=*/true);
  if (group.persistent[i]) {  // whole on every rank: small, read whole, no collective
    const auto value = torch::empty(group.shapes[i], torch::kFloat32);
    checkpoint::read_bytes(whole, 0, whole.nbytes(), value.data_ptr());
    groups_[g].params[i].set_data(value.to(group.flat.options()));
    groups_[g].gathered[i] = true;
  }
}

void ShardedOptimizer::load_own_part(std::size_t g, std::size_t i, const checkpoint::Dataset& saved,
                                     const std::string& file) {
  const torch::Tensor& part = groups_.at(g).parts.at(i);
  if (saved.dtype != checkpoint::DType::kFloat32 || saved.shape != part.sizes().vec()) {
    throw CheckpointError(file + ": " + saved.name + " is " + checkpoint::to_string(saved.dtype) + " " +
                          c10::str(c10::IntArrayRef(saved.shape)) + " but this rank's part of the parameter is float32 " +
                          c10::str(part.sizes()) + ": the copy is of another model");
  }
  parts_changed();
  drop(groups_[g], i);  // its whole value is the old one
  torch::NoGradGuard no_grad;
  if (swapper_) swapper_->bring_in({part});
  part.copy_(tensor_of(saved));
  if (swapper_) swapper_->let_go({part}, /*changed=*/true);
}

}  // namespace hpctrial::trainer::detail
