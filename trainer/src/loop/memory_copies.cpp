// checkpoint_levels.memory in the loop: each rank's copy of its state every period, and the
// restart that resumes from the newest copy every rank holds when it is newer than the shared
// filesystem's checkpoint.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <map>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "hpctrial/core/digest.h"
#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"
#include "hpctrial/core/env.h"
#include "loop/loop.h"
#include "parallel/zero.h"
#include "state/memory_level.h"
#include "state/sharded_checkpoint.h"
#include "state/state_io.h"

namespace hpctrial::trainer::detail {
namespace {

// checkpoint_levels.memory.period: auto. A copy's cost (the loop's stall, the next copy's wait
// for the level's thread included, and the optimizer's wait for the copy's tensors: the level's
// thread takes only the cycles training leaves) within 1 % of the time, a copy no more often than
// once a second (each is a pass over the whole state), and one at least every minute: the work a
// rank's failure loses.
constexpr double kMemoryOverhead = 0.01;
constexpr double kMemoryMinInterval_s = 1;
constexpr double kMemoryMaxInterval_s = 60;

// ZeRO stage 3's partitioned parameters in a rank's own copy: this rank's parts of them, in place
// of the values captured (released between steps: empty), marked as the rank's; no rank gathers
// the model whole for its copy.
void put_own_parts(Snapshot& snapshot, TrialContext& context, const std::string& part, const ShardedOptimizers& sharded,
                   int rank, int ranks) {
  bool any = false;
  const auto& models = context.models();
  for (std::size_t m = 0; m < models.size(); ++m) {
    for (const auto& item : models[m]->named_parameters()) {
      for (const auto& [index, optimizer] : sharded) {
        const auto at = optimizer->partitions_parameters() ? optimizer->locate(item.value()) : std::nullopt;
        if (!at) continue;
        const std::string name = part + "model/" + std::to_string(m) + "/" + item.key();
        auto& datasets = snapshot.contents.datasets;
        datasets.erase(std::remove_if(datasets.begin(), datasets.end(), [&](const auto& d) { return d.name == name; }),
                       datasets.end());
        auto& deferred = snapshot.deferred;
        deferred.erase(std::remove_if(deferred.begin(), deferred.end(), [&](const auto& d) { return d.name == name; }),
                       deferred.end());
        add_or_defer(snapshot.contents, &snapshot.deferred, name, optimizer->part(at->first, at->second));
        any = true;
        break;
      }
    }
  }
  if (any) mark_shard_of(snapshot.contents, part + kParameterParts, rank, ranks);
}

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
  if (faults_) faults_->set_node_memory(memory_->dir());  // the tests' `nodeloss` removes it
  if (levels.partner) open_partner_level();
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

// checkpoint_levels.partner: the ranks' nodes, gathered, give each rank its partner; the level's
// thread sends and receives on a communicator of its own. Off, and said so, on one node.
void Loop::open_partner_level() {
  std::vector<int> node_of_rank;
  for (const std::string& node : comm_.allgather(std::to_string(options_.distributed.node_index))) {
    node_of_rank.push_back(std::stoi(node));
  }
  rank::Partners partners = rank::partners_of(node_of_rank, comm_.rank());
  const std::set<int> nodes(node_of_rank.begin(), node_of_rank.end());
  if (nodes.size() < 2) {
    if (chief()) {
      core::log_warning("checkpoint_levels.partner: every rank runs on one node, so no copy goes to a partner (the "
                        "node's loss loses the copies in its memory; the shared filesystem's checkpoint remains)");
    }
    return;
  }
  memory_->set_partners(comm_.split(0, comm_.rank()), partners);
  if (chief()) {
    core::log_info("checkpoint_levels.partner: each rank's copies also go to a rank on the next of the {} nodes "
                   "(rank 0's to rank {})", nodes.size(), partners.send_to);
  }
}

bool Loop::time_to_copy() {
  if (!chief() || !memory_) return false;
  const core::CheckpointLevels& levels = config_.checkpoint_levels;
  const double since = std::chrono::duration<double>(Clock::now() - last_memory_time_).count();
  if (auto_memory_) {
    if (const auto waited = memory_->take_wait_seconds()) auto_memory_->record_cost(memory_stall_s_ + *waited);
    return since >= auto_memory_->interval_s();
  }
  return levels.memory_period.unit == core::LengthUnit::kSeconds && since >= static_cast<double>(levels.memory_period.value);
}

// At a step boundary every rank takes (the period counts batches, or the ranks agreed on the
// chief's clock): the state copied as a checkpoint captures it, written by the level's thread. A
// copy is the rank's own: of a model split over ranks, its part; of ZeRO's optimizers, its shards
// as its optimizer holds them (over its parts of the flat buffers, marked with the rank and the
// ranks, which a restore checks), and at stage 3 its parts of the parameters; its own files
// (save_files), with the count of ranks.
void Loop::save_memory_copy() {
  detail::PhaseTimings::Scope t(timings_, "memory_copy");
  const auto started = Clock::now();
  detail::LoopState state = loop_state();
  state.reducer_states = gather_reducer_states();
  state.stream_positions = gather_stream_positions();
  context_->accumulators().synchronize_all();
  const detail::ShardedOptimizers shards = sharded_optimizers(*trial_, *context_);
  detail::Snapshot snapshot = detail::capture(*context_, *trial_, callbacks_, state, identity_, /*defer=*/true);
  detail::put_own_parts(snapshot, *context_, identity_.part, shards, comm_.rank(), comm_.size());
  for (const auto& [index, sharded] : shards) {
    detail::mark_shard_of(snapshot.contents, identity_.part + "optimizer/" + std::to_string(index), comm_.rank(),
                          comm_.size());
  }
  if (std::optional<checkpoint::Contents> files = capture_rank_files(/*counted=*/true)) {
    for (auto& d : files->datasets) snapshot.contents.datasets.push_back(std::move(d));
  }
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
  nlohmann::json mine = {{"own", memory_->held()}, {"kept", nlohmann::json::object()}};
  if (memory_->has_partners()) {
    for (const auto& [owner, batches] : memory_->kept()) mine["kept"][std::to_string(owner)] = batches;
  }
  const auto held = comm_.gather(mine.dump(), 0);
  std::string plan = R"({"batches": -1})";
  if (chief()) plan = memory_resume_plan(held, level3_batches).dump();
  comm_.broadcast(plan, 0);
  const nlohmann::json decided = nlohmann::json::parse(plan);
  const std::int64_t batches = decided.at("batches").get<std::int64_t>();
  if (batches < 0) {
    if (memory_->has_partners()) memory_->drop_kept_of_others();
    return std::nullopt;
  }
  const auto moves = decided.at("moves").get<std::vector<std::pair<int, int>>>();
  std::string error, path;
  try {
    if (!moves.empty()) memory_->restore(moves, batches);
  } catch (const Error& e) {
    error = e.what();
  }
  if (memory_->has_partners()) memory_->drop_kept_of_others();
  try {
    if (!error.empty()) throw CheckpointError(error);
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
    const std::string than = level3_batches < 0 ? std::string("any checkpoint on the shared filesystem")
                                                : "the shared filesystem's of batch " + std::to_string(level3_batches);
    if (moves.empty()) {
      core::log_info("checkpoint_levels.memory: every rank holds its copy of batch {} in node memory, newer than {}",
                     batches, than);
    } else {
      std::string from;
      for (const auto& [owner, keeper] : moves) {
        from += (from.empty() ? "" : ", ") + std::string("rank ") + std::to_string(owner) + "'s from rank " +
                std::to_string(keeper);
      }
      core::log_info("checkpoint_levels.partner: the copies of batch {} of {} rank(s) came from their partners ({}); "
                     "the others held theirs in node memory; newer than {}", batches, moves.size(), from, than);
    }
  }
  memory_moves_ = moves;
  return path;
}

// The chief's choice from every rank's copies (`held`: each rank's own batches, and those it
// keeps for others): the newest batch newer than `level3_batches` of which every rank holds its
// copy, or a partner keeps it; with the moves (owner, keeper) of the copies that must travel.
nlohmann::json Loop::memory_resume_plan(const std::vector<std::string>& held, std::int64_t level3_batches) const {
  const int ranks = static_cast<int>(held.size());
  std::vector<std::set<std::int64_t>> own(held.size());
  std::map<std::pair<int, std::int64_t>, int> keeper;  // (owner, batches) -> a rank that keeps it
  std::set<std::int64_t> candidates;
  for (int r = 0; r < ranks; ++r) {
    const auto report = nlohmann::json::parse(held[static_cast<std::size_t>(r)]);
    for (const std::int64_t b : report.at("own").get<std::vector<std::int64_t>>()) {
      own[static_cast<std::size_t>(r)].insert(b);
      candidates.insert(b);
    }
    for (const auto& [owner, batches] : report.at("kept").items()) {
      const int o = std::stoi(owner);
      if (o < 0 || o >= ranks || o == r) continue;
      for (const std::int64_t b : batches.get<std::vector<std::int64_t>>()) {
        keeper.emplace(std::make_pair(o, b), r);
        candidates.insert(b);
      }
    }
  }
  for (auto b = candidates.rbegin(); b != candidates.rend() && *b > level3_batches; ++b) {
    std::vector<std::pair<int, int>> moves;
    bool whole = true;
    for (int r = 0; r < ranks && whole; ++r) {
      if (own[static_cast<std::size_t>(r)].count(*b) != 0) continue;
      const auto k = keeper.find({r, *b});
      whole = k != keeper.end();
      if (whole) moves.emplace_back(r, k->second);
    }
    if (whole) return {{"batches", *b}, {"moves", moves}};
  }
  return {{"batches", -1}};
}

// The trial's run ended (finished or stopped with its checkpoint durable): its copies go.
void Loop::close_memory_level() {
  if (!memory_) return;
  memory_->remove();
  memory_.reset();
}

}  // namespace hpctrial::trainer::detail
