// `hpctrial job update` on PBS: a waiting job's priority, queue and place among its owner's jobs.
#include <algorithm>
#include <ctime>
#include <string>
#include <vector>

#include "hpctrial/core/error.h"
#include "hpctrial/pbs/scheduler.h"

namespace hpctrial::pbs {

// PBS lets a job's owner set its Priority (qalter -p, -1024..1023), move it to another queue
// (qmove) and swap its place with another of the owner's queued jobs (qorder): a place ahead of
// or behind another is one swap, the top a swap with the owner's first queued job of the queue.
std::vector<std::string> Scheduler::update_job(const core::JobUpdate& update) const {
  using Order = core::JobUpdate::Order;
  std::vector<std::string> done;
  const auto refused = [&](const SchedulerError& e) {
    return SchedulerError("pbs refused to change job " + update.job + ": " + e.what());
  };
  try {
    if (update.priority) {
      if (*update.priority < -1024 || *update.priority > 1023) {
        throw ConfigError("--priority " + std::to_string(*update.priority) + ": PBS takes -1024 to 1023");
      }
      client_.set_priority(update.job, *update.priority);
      done.push_back("pbs job " + update.job + ": priority " + std::to_string(*update.priority));
    }
    if (!update.queue.empty()) {
      client_.move(update.job, update.queue);
      done.push_back("pbs job " + update.job + ": queue " + update.queue);
    }
  } catch (const SchedulerError& e) {
    throw refused(e);
  }
  if (update.order == Order::kNone) return done;
  const auto job = client_.job(update.job);
  if (!job) throw SchedulerError("pbs no longer knows job " + update.job);
  const std::vector<std::string> order = client_.queued_in_order(user_name(), job->queue);
  const auto place = [&](const std::string& id) {
    const auto at = std::find(order.begin(), order.end(), id);
    if (at == order.end()) {
      throw SchedulerError("pbs job " + id + " is not one of your queued jobs in queue " + job->queue +
                           " (qorder swaps the places of two queued jobs of their owner)");
    }
    return at - order.begin();
  };
  const auto mine = place(update.job);
  std::string other = update.order == Order::kTop ? order.front() : update.other;
  const auto theirs = place(other);
  const bool swap = update.order == Order::kBehindOf ? theirs > mine : theirs < mine;
  if (swap) {
    try {
      client_.swap_order(update.job, other);
    } catch (const SchedulerError& e) {
      throw refused(e);
    }
  }
  const std::string where = update.order == Order::kTop      ? "first among your queued jobs of " + job->queue
                            : update.order == Order::kAheadOf ? "ahead of " + other
                                                              : "behind " + other;
  done.push_back("pbs job " + update.job + ": " + where + (swap ? " (qorder: swapped with " + other + ")" : " already"));
  return done;
}

}  // namespace hpctrial::pbs
