// checkpoint_levels.memory in the loop: each rank's copy of its state every period, and the
// restart that resumes from the newest copy every rank holds when it is newer than the shared
// filesystem's checkpoint.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <set>

#include <nlohmann/json.hpp>

#include "hpctrial/core/digest.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/env.h"
#include "loop/loop.h"
#include "parallel/zero.h"
#include "state/memory_level.h"
#include "state/sharded_checkpoint.h"

namespace hpctrial::trainer::detail {
namespace {

// checkpoint_levels.memory.period: auto. A copy's cost (the loop's stall, and the level's thread's
// time counted whole, as if it had taken the CPU from training) within 1 % of the time, a copy no
// more often than once a second (each is a pass over the whole state), and one at least every
// minute: the work a rank's failure loses.
constexpr double kMemoryOverhead = 0.01;
constexpr double kMemoryMinInterval_s = 1;
constexpr double kMemoryMaxInterval_s = 60;

}  // namespace

// Every rank opens its folder in node memory, or every rank fails with the first one's reason.
void Loop::open_memory_level() {
  const core::CheckpointLevels& levels = config_.checkpoint_levels;
  if (!levels.memory() || config_.inference) return;
  std::string session = options_.session;
  if (session.empty()) {  // a run of its own: named by the chief, so that its ranks share it
    if (chief()) session = "alone-" + core::host_name() + "-" + std::to_string(::getpid()) + "-" + std::to_string(std::time(nullptr));
    comm_.broadcast(session, 0);
  }
  std::string experiment = identity_.experiment_id;
  if (experiment.empty()) {  // a trial run alone: known by its directory
    core::Sha256 digest;
    digest.update(options_.trial_dir);
    experiment = "dir-" + digest.hex().substr(0, 16);
  }
  std::string error;
  try {
    memory_ = std::make_unique<MemoryLevel>(
        levels, rank::NodeMemoryPlace{levels.memory_dir, experiment, options_.trial_id, session, comm_.rank()},
        options_.distributed.local_size);
  } catch (const Error& e) {
    error = e.what();
  }
  const std::string agreed = detail::agree(comm_, error);
  if (!agreed.empty()) throw IoError("checkpoint_levels.memory: " + agreed);
  last_memory_time_ = Clock::now();  // a period in seconds runs from here
  if (!chief()) return;
  if (levels.memory_auto) {
    auto_memory_ = std::make_unique<AutoCheckpointPeriod>(kMemoryOverhead, kMemoryMaxInterval_s, kMemoryMinInterval_s);
    core::log_info("checkpoint_levels.memory: each rank copies its state into {} as often as the copies cost at most "
                   "{}% of the time (every {} to {} s)", levels.memory_dir, kMemoryOverhead * 100, kMemoryMinInterval_s,
                   kMemoryMaxInterval_s);
  } else {
    core::log_info("checkpoint_levels.memory: each rank copies its state every {} {} into {}", levels.memory_period.value,
                   core::to_string(levels.memory_period.unit), levels.memory_dir);
  }
}

bool Loop::time_to_copy() {
  if (!chief() || !memory_) return false;
  const core::CheckpointLevels& levels = config_.checkpoint_levels;
  const double since = std::chrono::duration<double>(Clock::now() - last_memory_time_).count();
  if (auto_memory_) {
    if (const auto written = memory_->take_write_seconds()) auto_memory_->record_cost(memory_stall_s_ + *written);
    return since >= auto_memory_->interval_s();
  }
  return levels.memory_period.unit == core::LengthUnit::kSeconds && since >= static_cast<double>(levels.memory_period.value);
}

// At a step boundary every rank takes (the period counts batches, or the ranks agreed on the
// chief's clock): the state copied as a checkpoint captures it, written by the level's thread.
void Loop::save_memory_copy() {
  detail::PhaseTimings::Scope t(timings_, "memory_copy");
  const auto started = Clock::now();
  detail::LoopState state = loop_state();
  state.reducer_states = gather_reducer_states();
  state.stream_positions = gather_stream_positions();
  context_->accumulators().synchronize_all();
  if (!memory_checked_ &&
      (!sharded_optimizers(*trial_, *context_).empty() || identity_.parts > 1 || capture_rank_files())) {
    throw ConfigError("checkpoint_levels.memory holds a rank's whole state, and this trial's is spread over its "
                      "ranks (ZeRO's shards, a model split over ranks, or files each rank saves): leave "
                      "checkpoint_levels.memory out for it");
  }
  memory_checked_ = true;
  detail::Snapshot snapshot = detail::capture(*context_, *trial_, callbacks_, state, identity_, /*defer=*/true);
  snapshot.before_publish = writer_fault_hook();  // the tests' "checkpoint:writer" fault: a copy cut short
  memory_->submit(std::move(snapshot));
  last_memory_batches_ = batches_trained_;
  last_memory_time_ = started;  // auto's interval runs from one copy's start to the next's
  memory_stall_s_ = std::chrono::duration<double>(Clock::now() - started).count();
  memory_pending_ = false;
}

// The newest batch whose copy every rank holds, when it is newer than `level3_batches`; every
// rank then loads its own copy (read whole and verified), and all of them must: one that cannot
// sends every rank back to the shared filesystem's checkpoint.
std::optional<std::string> Loop::resume_from_memory(std::int64_t level3_batches, checkpoint::Contents& contents) {
  if (!memory_) return std::nullopt;
  const auto held = comm_.gather(nlohmann::json(memory_->held()).dump(), 0);
  std::string step = "-1";
  if (chief()) {
    std::set<std::int64_t> common;
    for (std::size_t r = 0; r < held.size(); ++r) {
      const auto mine = nlohmann::json::parse(held[r]).get<std::vector<std::int64_t>>();
      const std::set<std::int64_t> these(mine.begin(), mine.end());
      if (r == 0) {
        common = these;
      } else {
        std::set<std::int64_t> both;
        std::set_intersection(common.begin(), common.end(), these.begin(), these.end(), std::inserter(both, both.end()));
        common = std::move(both);
      }
    }
    if (!common.empty() && *common.rbegin() > level3_batches) step = std::to_string(*common.rbegin());
  }
  comm_.broadcast(step, 0);
  const std::int64_t batches = std::stoll(step);
  if (batches < 0) return std::nullopt;
  std::string error, path;
  try {
    checkpoint::CheckpointStore::Loaded loaded = memory_->load(batches);
    detail::check_resumable(loaded.contents, loaded.path, identity_, options_.allow_config_change);
    path = loaded.path;
    contents = std::move(loaded.contents);
  } catch (const Error& e) {
    error = e.what();
  }
  const std::string agreed = detail::agree(comm_, error);
  if (!agreed.empty()) {
    if (chief()) {
      core::log_warning("the copies in node memory at batch {} are not usable ({}); resuming from the shared "
                        "filesystem's checkpoint", batches, agreed);
    }
    contents = {};
    return std::nullopt;
  }
  if (chief()) {
    core::log_info("checkpoint_levels.memory: every rank holds its copy of batch {} in node memory, newer than {}",
                   batches, level3_batches < 0 ? std::string("any checkpoint on the shared filesystem")
                                               : "the shared filesystem's of batch " + std::to_string(level3_batches));
  }
  return path;
}

// The trial's run ended (finished or stopped with its checkpoint durable): its copies go.
void Loop::close_memory_level() {
  if (!memory_) return;
  memory_->remove();
  memory_.reset();
}

}  // namespace hpctrial::trainer::detail
