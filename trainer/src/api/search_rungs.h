// An adaptive search's rungs from the trial's chief (LoopOptions::search_in_place): the
// experiment's search log, read and appended under its lock as the worker does. No LibTorch.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace hpctrial::trainer::detail {

struct SearchRungs {
  // The end of the rung the log says the trial trains toward, in the unit of max_length; 0 when
  // the log has the trial's rung already (an attempt before this one recorded it).
  std::function<std::int64_t()> target;
  // The rung reached with the searcher metric, recorded with what follows from it; the next
  // rung's end when the search promotes the trial at once (trained in place), else 0.
  std::function<std::int64_t(double metric)> reached;
};

// For trial `trial` of the experiment in `experiment_dir`, its events signed `worker`.
SearchRungs search_rungs(const std::string& experiment_dir, int trial, const std::string& worker);

}  // namespace hpctrial::trainer::detail
