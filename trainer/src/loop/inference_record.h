// The records of batch inference (internal to the trainer, loop/inference.cpp): the outputs of
// predict_batch as the result file holds them, and the progress record of inference-progress.json.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "hpctrial/checkpoint/shared_write.h"
#include "hpctrial/core/dtype.h"

namespace hpctrial::trainer::detail {

// One output of predict_batch as the result file holds it: a dataset of a row per record.
struct Output {
  std::string name;
  core::DType dtype = core::DType::kFloat32;
  std::vector<std::int64_t> row_shape;
  std::size_t row_bytes() const;
  bool operator==(const Output& o) const { return name == o.name && dtype == o.dtype && row_shape == o.row_shape; }
  bool operator!=(const Output& o) const { return !(*this == o); }
};

// The dataset's shape: `records` rows.
std::vector<std::int64_t> with_rows(const Output& o, std::int64_t records);
std::string shape_text(const std::vector<std::int64_t>& sizes);  // "[3, 4]"
// "logits (float32, rows of [10]), label (int64, rows of [])"
std::string describe_all(const std::vector<Output>& outputs);
nlohmann::json outputs_json(const std::vector<Output>& outputs);
// std::exception for JSON that is not such a list.
std::vector<Output> outputs_from(const nlohmann::json& list);

// The record of inference-progress.json: the records [0, done) durable in the plan's temporary.
struct InferenceProgress {
  std::string experiment_id;
  int trial_id = 0;
  std::string source;  // the checkpoint file evaluated, as first chosen
  std::int64_t records = 0;
  std::int64_t done = 0;
  std::vector<std::uint32_t> crcs;  // each output's rows [0, done)
  std::vector<Output> outputs;      // empty until the file is laid out
  checkpoint::FilePlan plan;
  bool complete = false;
};

nlohmann::json to_json(const InferenceProgress& p);
// The record, its plan's datasets of `records` rows; std::exception for one that does not read
// whole or whose counts do not fit together.
InferenceProgress progress_from(const nlohmann::json& j, std::int64_t records);

}  // namespace hpctrial::trainer::detail
