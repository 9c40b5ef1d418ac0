// Autocast (mixed precision) around a trial's batch functions, as torch.autocast does it:
// internal to the trainer. Autocast is thread-local: it applies to the ops the calling thread
// dispatches.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace hpctrial::trainer::detail {

// Whether autocast is on for `type` (the CPU, or CUDA) on the calling thread, with any LibTorch.
bool autocast_enabled(c10::DeviceType type);

// Autocast on for `device`'s kind (the CPU, or CUDA) with `dtype` for the scope's life, then
// as it was; ScalarType::Undefined leaves everything as it is.
class AutocastScope {
 public:
  AutocastScope(const c10::Device& device, c10::ScalarType dtype);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_ = false;
  c10::DeviceType type_ = c10::DeviceType::CPU;
  bool was_enabled_ = false;
  c10::ScalarType was_dtype_ = c10::ScalarType::Undefined;
};

// Autocast off for the scope's life (backward: its ops run in the types forward chose), then as
// it was.
class AutocastPause {
 public:
  AutocastPause();
  ~AutocastPause();
  AutocastPause(const AutocastPause&) = delete;
  AutocastPause& operator=(const AutocastPause&) = delete;

 private:
  bool cpu_ = false;
  bool cuda_ = false;
};

}  // namespace hpctrial::trainer::detail
