// LibTorch's scalar types in hpctrial's DType, and its random generators' states (state_io.h).
#include <ATen/CPUGeneratorImpl.h>

#include <mutex>
#include <optional>
#include <string>

#include "hpctrial/core/error.h"
#include "state/state_io.h"

namespace hpctrial::trainer::detail {

using checkpoint::DType;

std::optional<core::DType> to_dtype(c10::ScalarType type) {
  switch (type) {
    case torch::kFloat32: return DType::kFloat32;
    case torch::kFloat64: return DType::kFloat64;
    case torch::kFloat16: return DType::kFloat16;
    case torch::kBFloat16: return DType::kBFloat16;
    case torch::kInt64: return DType::kInt64;
    case torch::kInt32: return DType::kInt32;
    case torch::kInt16: return DType::kInt16;
    case torch::kInt8: return DType::kInt8;
    case torch::kUInt8: return DType::kUInt8;
    case torch::kBool: return DType::kBool;
    default: return std::nullopt;
  }
}

c10::ScalarType to_scalar_type(core::DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return torch::kFloat32;
    case DType::kFloat64: return torch::kFloat64;
    case DType::kFloat16: return torch::kFloat16;
    case DType::kBFloat16: return torch::kBFloat16;
    case DType::kInt64: return torch::kInt64;
    case DType::kInt32: return torch::kInt32;
    case DType::kInt16: return torch::kInt16;
    case DType::kInt8: return torch::kInt8;
    case DType::kUInt8: return torch::kUInt8;
    case DType::kBool: return torch::kBool;
  }
  throw InternalError("to_scalar_type: unknown dtype");
}

checkpoint::DType checkpoint_dtype(c10::ScalarType type) {
  if (const std::optional<DType> dtype = to_dtype(type)) return *dtype;
  throw NotSupported(std::string("checkpointing tensors of type ") + c10::toString(type));
}

torch::Tensor cpu_rng_state() {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_cpu_rng_state(const torch::Tensor& state) {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

torch::Tensor device_rng_state(const torch::Device& device) {
  auto generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_device_rng_state(const torch::Device& device, const torch::Tensor& state) {
  auto generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

}  // namespace hpctrial::trainer::detail
