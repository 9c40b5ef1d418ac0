#include "api/search_rungs.h"

#include <memory>

#include "hpctrial/core/experiment_config.h"
#include "hpctrial/core/experiment_dir.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/search/event_log.h"

namespace hpctrial::trainer::detail {
namespace {

// What both functions share: the search's settings and its log.
struct Search {
  search::AshaOptions options;
  std::unique_ptr<search::EventLog> log;
  int trial = 0;
  std::string worker;
};

}  // namespace

SearchRungs search_rungs(const std::string& experiment_dir, int trial, const std::string& worker) {
  const core::ExperimentLayout layout{experiment_dir};
  // The experiment's config, not the trial's: the rank's has max_length set to the rung's end.
  const core::ExperimentConfig config = core::load_experiment_config({layout.config(), "", {}});
  auto search = std::make_shared<Search>();
  search->options = search::options_of(config);
  search->log = std::make_unique<search::EventLog>(layout.search_log(), layout.search_lock(),
                                                    core::ensure_experiment_identity(layout, config.name).id,
                                                    search::settings_of(search->options));
  search->trial = trial;
  search->worker = worker;
  SearchRungs out;
  out.target = [search] {
    auto locked = search->log->lock();
    const search::Asha asha = search::replay(search->options, locked.read(), search->log->path());
    const auto it = asha.trials().find(search->trial);
    if (it == asha.trials().end() || !it->second.training) return std::int64_t{0};
    return search::training_length(asha, search->trial, search->log->path());
  };
  out.reached = [search](double metric) {
    auto locked = search->log->lock();
    const search::RungRecorded recorded = search::record_rung(locked, search->options, search->log->path(),
                                                              search->trial, metric, true, search->worker);
    core::log_info("search: trial {} reached rung {} with {}: {}", search->trial, recorded.rung, metric,
                   recorded.after == search::AfterRung::kFinish  ? "finished"
                   : recorded.after == search::AfterRung::kStop  ? "stopped"
                   : recorded.after == search::AfterRung::kPause ? "waits for a promotion"
                                                                 : "promoted, and trains on here");
    return recorded.next_length;
  };
  return out;
}

}  // namespace hpctrial::trainer::detail
