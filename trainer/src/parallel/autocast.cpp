#include "parallel/autocast.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

// LibTorch 2.4 made autocast's state per device type (is_autocast_enabled(type) and friends)
// and deprecated the per-device functions that LibTorch 1.x has; each call below goes to the
// one its LibTorch has.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define HPCTRIAL_AUTOCAST_BY_DEVICE_TYPE 1
#else
#define HPCTRIAL_AUTOCAST_BY_DEVICE_TYPE 0
#endif

namespace hpctrial::trainer::detail {
namespace {

void set_autocast(c10::DeviceType type, bool enabled) {
#if HPCTRIAL_AUTOCAST_BY_DEVICE_TYPE
  at::autocast::set_autocast_enabled(type, enabled);
#else
  if (type == c10::DeviceType::CUDA) {
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_cpu_enabled(enabled);
  }
#endif
}

c10::ScalarType autocast_dtype(c10::DeviceType type) {
#if HPCTRIAL_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::get_autocast_dtype(type);
#else
  return type == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype()
                                       : at::autocast::get_autocast_cpu_dtype();
#endif
}

void set_autocast_dtype(c10::DeviceType type, c10::ScalarType dtype) {
#if HPCTRIAL_AUTOCAST_BY_DEVICE_TYPE
  at::autocast::set_autocast_dtype(type, dtype);
#else
  if (type == c10::DeviceType::CUDA) {
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
#endif
}

}  // namespace

bool autocast_enabled(c10::DeviceType type) {
#if HPCTRIAL_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::is_autocast_enabled(type);
#else
  return type == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

AutocastScope::AutocastScope(const c10::Device& device, c10::ScalarType dtype) {
  if (dtype == c10::ScalarType::Undefined) return;
  active_ = true;
  type_ = device.is_cuda() ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  was_enabled_ = autocast_enabled(type_);
  was_dtype_ = autocast_dtype(type_);
  set_autocast(type_, true);
  set_autocast_dtype(type_, dtype);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  // The casts of the weights are cached for the scope; the outermost scope drops them.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_autocast(type_, was_enabled_);
  set_autocast_dtype(type_, was_dtype_);
}

AutocastPause::AutocastPause()
    : cpu_(autocast_enabled(c10::DeviceType::CPU)), cuda_(autocast_enabled(c10::DeviceType::CUDA)) {
  if (cpu_) set_autocast(c10::DeviceType::CPU, false);
  if (cuda_) set_autocast(c10::DeviceType::CUDA, false);
}

AutocastPause::~AutocastPause() {
  if (cpu_) set_autocast(c10::DeviceType::CPU, true);
  if (cuda_) set_autocast(c10::DeviceType::CUDA, true);
}

}  // namespace hpctrial::trainer::detail
