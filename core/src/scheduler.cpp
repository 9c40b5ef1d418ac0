#include "hpctrial/core/scheduler.h"

namespace hpctrial::core {

const char* to_string(JobState state) {
  switch (state) {
    case JobState::kQueued: return "queued";
    case JobState::kHeld: return "held";
    case JobState::kRunning: return "running";
    case JobState::kEnding: return "ending";
    case JobState::kSuspended: return "suspended";
    case JobState::kEnded: return "ended";
  }
  return "unknown";
}

}  // namespace hpctrial::core
