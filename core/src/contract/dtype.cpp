#include "hpctrial/core/dtype.h"

namespace hpctrial::core {
namespace {

struct DTypeName {
  DType dtype;
  const char* name;
  std::size_t size;
};
constexpr DTypeName kDTypes[] = {
    {DType::kFloat32, "float32", 4}, {DType::kFloat64, "float64", 8}, {DType::kFloat16, "float16", 2},
    {DType::kBFloat16, "bfloat16", 2}, {DType::kInt64, "int64", 8},   {DType::kInt32, "int32", 4},
    {DType::kInt16, "int16", 2},     {DType::kInt8, "int8", 1},       {DType::kUInt8, "uint8", 1},
    {DType::kBool, "bool", 1}};

}  // namespace

std::size_t dtype_size(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.size;
  }
  return 0;
}

const char* to_string(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "unknown";
}

std::optional<DType> dtype_from_string(std::string_view name) {
  for (const auto& d : kDTypes) {
    if (name == d.name) return d.dtype;
  }
  return std::nullopt;
}

}  // namespace hpctrial::core
