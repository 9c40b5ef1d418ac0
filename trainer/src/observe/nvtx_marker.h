// NVTX ranges around the loop's phases, for Nsight Systems (`launcher.prefix: [nsys, profile]`):
// in CUDA builds only; elsewhere make_nvtx_marker() gives none.
#pragma once

#include <memory>

#include "observe/metrics_log.h"

namespace hpctrial::trainer::detail {

// A marker that pushes an NVTX range at each phase's start and pops it at its end; null in
// builds without CUDA. NVTX costs a check of a function pointer when no tool listens.
std::unique_ptr<PhaseMarker> make_nvtx_marker();

}  // namespace hpctrial::trainer::detail
