#include "loop/inference_record.h"

#include <stdexcept>

namespace hpctrial::trainer::detail {

using json = nlohmann::json;

std::size_t Output::row_bytes() const {
  std::size_t n = core::dtype_size(dtype);
  for (std::int64_t size : row_shape) n *= static_cast<std::size_t>(size);
  return n;
}

// The dataset's shape: `records` rows.
std::vector<std::int64_t> with_rows(const Output& o, std::int64_t records) {
  std::vector<std::int64_t> shape{records};
  shape.insert(shape.end(), o.row_shape.begin(), o.row_shape.end());
  return shape;
}

std::string shape_text(const std::vector<std::int64_t>& sizes) {
  std::string text;
  for (std::int64_t size : sizes) text += (text.empty() ? "" : ", ") + std::to_string(size);
  return "[" + text + "]";
}

namespace {
std::string describe(const Output& o) {
  return o.name + " (" + std::string(core::to_string(o.dtype)) + ", rows of " + shape_text(o.row_shape) + ")";
}
}  // namespace

json outputs_json(const std::vector<Output>& outputs) {
  json list = json::array();
  for (const auto& o : outputs) {
    list.push_back({{"name", o.name}, {"dtype", std::string(core::to_string(o.dtype))}, {"row_shape", o.row_shape}});
  }
  return list;
}

std::vector<Output> outputs_from(const json& list) {
  std::vector<Output> outputs;
  for (const auto& o : list) {
    const auto dtype = core::dtype_from_string(o.at("dtype").get<std::string>());
    if (!dtype) throw std::runtime_error("unknown dtype " + o.at("dtype").dump());
    outputs.push_back({o.at("name").get<std::string>(), *dtype, o.at("row_shape").get<std::vector<std::int64_t>>()});
  }
  return outputs;
}

std::string describe_all(const std::vector<Output>& outputs) {
  std::string text;
  for (const auto& o : outputs) text += (text.empty() ? "" : ", ") + describe(o);
  return text;
}

json to_json(const InferenceProgress& p) {
  return {{"experiment_id", p.experiment_id}, {"trial_id", p.trial_id}, {"source_checkpoint", p.source},
          {"records", p.records}, {"done", p.done}, {"crc32c", p.crcs}, {"outputs", outputs_json(p.outputs)},
          {"file", p.plan.path}, {"temporary", p.plan.temp}, {"offsets", p.plan.offsets},
          {"attributes", p.plan.attributes}, {"manifest_offset", p.plan.manifest_offset},
          {"manifest_capacity", p.plan.manifest_capacity}, {"complete", p.complete}};
}

InferenceProgress progress_from(const json& j, std::int64_t records) {
  InferenceProgress p;
  p.experiment_id = j.at("experiment_id").get<std::string>();
  p.trial_id = j.at("trial_id").get<int>();
  p.source = j.at("source_checkpoint").get<std::string>();
  p.records = j.at("records").get<std::int64_t>();
  p.done = j.at("done").get<std::int64_t>();
  p.crcs = j.at("crc32c").get<std::vector<std::uint32_t>>();
  p.outputs = outputs_from(j.at("outputs"));
  p.plan.path = j.at("file").get<std::string>();
  p.plan.temp = j.at("temporary").get<std::string>();
  p.plan.offsets = j.at("offsets").get<std::vector<std::uint64_t>>();
  p.plan.attributes = j.at("attributes").get<std::map<std::string, std::string>>();
  p.plan.manifest_offset = j.at("manifest_offset").get<std::uint64_t>();
  p.plan.manifest_capacity = j.at("manifest_capacity").get<std::size_t>();
  p.complete = j.at("complete").get<bool>();
  for (const auto& o : p.outputs) p.plan.datasets.push_back({o.name, o.dtype, with_rows(o, records)});
  if (p.done < 0 || p.done > p.records || p.crcs.size() != p.outputs.size() ||
      p.plan.offsets.size() != p.outputs.size()) {
    throw std::runtime_error("its counts do not fit together");
  }
  return p;
}

}  // namespace hpctrial::trainer::detail
