#include "hpctrial/core/scheduler.h"

namespace hpctrial::core {

void Scheduler::check_config(const SchedulerConfig&, Diagnostics&) const {}

void check_scheduler_config(const ExperimentConfig& config, const std::vector<const Scheduler*>& schedulers,
                            Diagnostics& diagnostics) {
  const SchedulerConfig& s = config.scheduler;
  std::vector<std::string> names;
  for (const Scheduler* scheduler : schedulers) {
    if (scheduler->name() == s.type) {
      scheduler->check_config(s, diagnostics);
      return;
    }
    names.push_back(scheduler->name());
  }
  std::string message = "unknown scheduler \"" + s.type + "\"; use one of ";
  for (std::size_t i = 0; i < names.size(); ++i) message += (i ? ", " : "") + names[i];
  const std::string suggestion = closest_match(s.type, names);
  if (!suggestion.empty()) message += " (did you mean '" + suggestion + "'?)";
  const auto at = s.written_at.find("type");
  diagnostics.error(at != s.written_at.end() ? at->second : SourceLocation{config.source_path}, "scheduler.type",
                    message);
}

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
