#include "observe/nvtx_marker.h"

#if HPCTRIAL_WITH_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace hpctrial::trainer::detail {

#if HPCTRIAL_WITH_NVTX

namespace {

class NvtxMarker : public PhaseMarker {
 public:
  void begin(const char* phase) override { nvtxRangePushA(phase); }
  void end() override { nvtxRangePop(); }
};

}  // namespace

std::unique_ptr<PhaseMarker> make_nvtx_marker() { return std::make_unique<NvtxMarker>(); }

#else

std::unique_ptr<PhaseMarker> make_nvtx_marker() { return nullptr; }

#endif

}  // namespace hpctrial::trainer::detail
