#include "autocast.h"

#include <ATen/autocast_mode.h>

namespace hpctrial::trainer::detail {

AutocastScope::AutocastScope(const c10::Device& device, c10::ScalarType dtype) {
  if (dtype == c10::ScalarType::Undefined) return;
  active_ = true;
  cuda_ = device.is_cuda();
  if (cuda_) {
    was_enabled_ = at::autocast::is_enabled();
    was_dtype_ = at::autocast::get_autocast_gpu_dtype();
    at::autocast::set_enabled(true);
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    was_enabled_ = at::autocast::is_cpu_enabled();
    was_dtype_ = at::autocast::get_autocast_cpu_dtype();
    at::autocast::set_cpu_enabled(true);
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  // The casts of the weights are cached for the scope; the outermost scope drops them.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  if (cuda_) {
    at::autocast::set_enabled(was_enabled_);
    at::autocast::set_autocast_gpu_dtype(was_dtype_);
  } else {
    at::autocast::set_cpu_enabled(was_enabled_);
    at::autocast::set_autocast_cpu_dtype(was_dtype_);
  }
}

AutocastPause::AutocastPause() : cpu_(at::autocast::is_cpu_enabled()), cuda_(at::autocast::is_enabled()) {
  if (cpu_) at::autocast::set_cpu_enabled(false);
  if (cuda_) at::autocast::set_enabled(false);
}

AutocastPause::~AutocastPause() {
  if (cpu_) at::autocast::set_cpu_enabled(true);
  if (cuda_) at::autocast::set_enabled(true);
}

}  // namespace hpctrial::trainer::detail
