// The element types hpctrial moves and stores - in collectives (comm/) and in checkpoints
// (checkpoint/) - one enum for both, with the names the checkpoint format writes.
// kFloat16 is IEEE binary16, kBFloat16 the upper half of a float32.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace hpctrial::core {

enum class DType { kFloat32, kFloat64, kFloat16, kBFloat16, kInt64, kInt32, kInt16, kInt8, kUInt8, kBool };
std::size_t dtype_size(DType dtype);
const char* to_string(DType dtype);  // "float32", "bfloat16", "bool", ...
std::optional<DType> dtype_from_string(std::string_view name);

}  // namespace hpctrial::core
