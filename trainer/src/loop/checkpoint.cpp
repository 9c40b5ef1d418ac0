// The loop's checkpoints: the chief's whole ones, and those every rank writes part of
// (sharded_checkpoint.h).
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "state/checkpointing.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/error.h"
#include "api/engine_access.h"
#include "hpctrial/core/logging.h"
#include "loop/loop.h"
#include "state/pipeline_checkpoint.h"
#include "state/rank_files.h"
#include "state/replica_check.h"
#include "state/sharded_checkpoint.h"
#include "state/state_io.h"
#include "parallel/zero.h"

namespace hpctrial::trainer::detail {

// Captures the state (the only stall) and hands it to the writer thread; with `wait`, returns
// once the checkpoint is durable on every rank's view. With the memory level, a periodic
// checkpoint of the state whole on the chief is written from the chief's copy of this batch in
// node memory (taken now, if the period did not take it).
void Loop::save_checkpoint(bool wait) {
  const rank::PhaseRecord phase(core::RankPhase::kCheckpoint);
  faults_->at(rank::FaultPhase::kCheckpoint, batches_trained_);
  check_replicas("before the checkpoint at batch " + std::to_string(batches_trained_));
  detail::PhaseTimings::Scope t(timings_, wait ? "checkpoint_durable" : "checkpoint");
  last_checkpoint_batches_ = batches_trained_;
  last_checkpoint_time_ = Clock::now();
  checkpoint_pending_ = false;
  detail::LoopState state = loop_state();
  state.reducer_states = gather_reducer_states();
  state.stream_positions = gather_stream_positions();
  context_->accumulators().synchronize_all();
  record_elastic_preference();
  settle_sharded_checkpoint();  // the previous one, if some rank is still writing it
  const detail::ShardedOptimizers shards = sharded_optimizers(*trial_, *context_);
  const std::optional<checkpoint::Contents> files = capture_rank_files();
  if (!shards.empty() || identity_.parts > 1 || files) {
    const checkpoint::Contents* mine = files ? &*files : nullptr;
    wait ? save_sharded_checkpoint(state, shards, mine) : start_sharded_checkpoint(state, shards, mine);
    return;
  }
  if (memory_ && !wait) {  // written from this batch's copy in node memory: the state is not copied twice
    // The previous checkpoint first: its copy's slot is free again before this copy is taken.
    if (chief()) finish_checkpoint();
    if (last_memory_batches_ != batches_trained_) save_memory_copy();
    if (chief()) {
      if (!std::exchange(said_checkpoints_from_copies_, true)) {
        core::log_info("checkpoint_levels.memory: the checkpoints on the shared filesystem are written from the "
                       "chief's copies in node memory, taken at their batch (the state is not copied twice)");
      }
      detail::Snapshot snapshot;
      snapshot.source = memory_->pinned_copy(batches_trained_);
      snapshot.before_publish = writer_fault_hook();
      writer_->submit(std::move(snapshot));
    }
    return;
  }
  checkpoint::Contents whole_optimizers;  // ZeRO's shards, gathered by every rank
  for (const auto& [index, sharded] : shards) {
    sharded->save_whole(whole_optimizers, "optimizer/" + std::to_string(index));
  }
  if (chief()) {
    finish_checkpoint();  // the previous one, if still being written: its on_checkpoint_end first
    // Periodic checkpoints leave copying parameters and optimizer state to the writer thread,
    // which the next optimizer step waits for; a stop or the end copies them here.
    detail::Snapshot snapshot =
        detail::capture(*context_, *trial_, callbacks_, state, identity_, /*defer=*/!wait, &whole_optimizers);
    snapshot.before_publish = writer_fault_hook();
    writer_->submit(std::move(snapshot));
    if (wait) finish_checkpoint();
  }
  if (wait) comm_.barrier();  // nobody leaves before the chief's checkpoint is durable
}

void Loop::finish_checkpoint() {
  if (!writer_) return;
  if (auto path = writer_->wait()) {
    result_.checkpoint_path = *path;
    core::log_debug("checkpoint {} is durable", *path);
    call([&](Callback& c) { c.on_checkpoint_end(*path); });
  }
}

// This rank's pieces of a checkpoint every rank writes part of: its shards of the ZeRO optimizers;
// with a model split over ranks, on the first replica's rank of each part but the chief's, that
// part whole (the chief writes its own with the rest), and then the datasets of every part.
ShardedSave Loop::save_shards(const ShardedOptimizers& sharded, const checkpoint::Contents* files) {
  ShardedSave mine;
  for (const auto& [index, optimizer] : sharded) {
    const std::string prefix = identity_.part + "optimizer/" + std::to_string(index);
    optimizer->save_shards(mine, prefix);
    if (optimizer->partitions_parameters()) optimizer->save_parameter_shards(mine, model_dataset_names(*optimizer));
    if (identity_.parts > 1) {  // by the names of the model's parameters, as capture names a part's
      const auto names = parameter_names(*context_, parameter_groups(*context_->optimizers()[index], optimizer));
      mine.whole.add_text(prefix + "/param_names", names.dump());
    }
  }
  if (identity_.parts > 1 && !chief() && replica() == 0) {
    add_whole_pieces(mine, capture_part(*context_, identity_.part, &mine.whole));
  }
  if (files != nullptr) add_whole_pieces(mine, *files);  // every rank's own, the chief's too
  if (identity_.parts > 1 || files != nullptr) unite_datasets(comm_, mine);  // the same on every rank
  return mine;
}

// The datasets a sharded optimizer's parameters are saved as ([group][parameter]): those of the
// wrapped model that holds each, as capture names them.
std::vector<std::vector<std::string>> Loop::model_dataset_names(const detail::ShardedOptimizer& sharded) const {
  std::map<const void*, std::string> names;
  const auto& models = context_->models();
  for (std::size_t i = 0; i < models.size(); ++i) {
    for (const auto& item : models[i]->named_parameters()) {
      names.emplace(item.value().unsafeGetTensorImpl(), identity_.part + "model/" + std::to_string(i) + "/" + item.key());
    }
  }
  std::vector<std::vector<std::string>> out;
  for (const auto& group : sharded.parameter_groups()) {
    auto& listed = out.emplace_back();
    for (const auto& p : group) {
      const auto it = names.find(p.unsafeGetTensorImpl());
      if (it == names.end()) {
        throw ConfigError("ZeRO-3: the optimizer of an engine steps a parameter that is not its model's; build the "
                          "optimizer over the engine's model's parameters");
      }
      listed.push_back(it->second);
    }
  }
  return out;
}

namespace {

// The datasets every rank writes pieces of (ZeRO-3's parameters) are not the chief's to capture:
// its own parameters are empty between steps.
void drop_pieced_datasets(detail::Snapshot& snapshot, const ShardedSave& mine) {
  std::set<std::string> pieced;
  for (const auto& d : mine.datasets) pieced.insert(d.name);
  auto& datasets = snapshot.contents.datasets;
  datasets.erase(std::remove_if(datasets.begin(), datasets.end(), [&](const auto& d) { return pieced.count(d.name) != 0; }),
                 datasets.end());
  auto& deferred = snapshot.deferred;
  deferred.erase(std::remove_if(deferred.begin(), deferred.end(), [&](const auto& d) { return pieced.count(d.name) != 0; }),
                 deferred.end());
}

}  // namespace

std::optional<checkpoint::Contents> Loop::capture_rank_files(bool counted) {
  if (!saves_files_) return std::nullopt;
  PrivateDirectory directory("own-files");
  try {
    trial_->save_files(directory.path());
  } catch (const NotOverridden&) {
    saves_files_ = false;  // the same class on every rank: all learn it here
    return std::nullopt;
  }
  return detail::capture_rank_files(directory.path(), comm_.rank(), comm_.size(), counted);
}

void Loop::restore_rank_files(const checkpoint::Contents& contents, const std::string& path) {
  const std::optional<int> ranks = rank_files_ranks(contents, path);
  if (!ranks) return;
  if (*ranks != comm_.size()) {
    throw ConfigError(path + " holds files each of its " + std::to_string(*ranks) + " ranks saved for itself "
                      "(save_files, an engine trial's save) and this run has " + std::to_string(comm_.size()) +
                      " ranks: each rank's files are its own, so it resumes on " + std::to_string(*ranks) +
                      " ranks (resources.slots_per_trial)");
  }
  PrivateDirectory directory("own-files");
  extract_rank_files(contents, comm_.rank(), directory.path(), path);
  try {
    trial_->load_files(directory.path());
  } catch (const NotOverridden&) {
    if (chief()) core::log_warning("{} holds files the trial's ranks saved, and the trial loads none (load_files)", path);
  }
}

// Within each data-parallel group: the replicas of one part of the model. Replicas that differ
// end the run on every rank, but only once the checkpoint still being written is durable: it was
// taken from replicas that agreed, and a rank's abort would otherwise end the chief's writer.
void Loop::check_replicas(const std::string& when) {
  if (replicas() == 1) return;
  detail::PhaseTimings::Scope t(timings_, "replica_check");
  const detail::ShardedOptimizers shards = sharded_optimizers(*trial_, *context_);
  std::string differ;
  try {
    detail::check_replicas(context_->data_parallel_communicator(), detail::replica_checksums(*context_, shards), when,
                           comm_.rank());
  } catch (const DivergenceError& e) {
    differ = e.what();
  }
  if (identity_.parts > 1) {  // each group's verdict reaches every rank
    for (const std::string& verdict : comm_.gather(differ, 0)) {
      if (differ.empty()) differ = verdict;
    }
    comm_.broadcast(differ, 0);
  }
  if (differ.empty()) return;
  finish_checkpoints_before_failing();
  throw DivergenceError(differ);
}

// Collective: the checkpoints in flight made durable (or given up, logged) before every rank
// fails together; nobody leaves before the chief's writer is done.
void Loop::finish_checkpoints_before_failing() {
  const auto finish = [&](const auto& step) {
    try {
      step();
    } catch (const Error& e) {
      core::log_warning("the checkpoint being written when the run failed is not kept: {}", e.what());
    }
  };
  finish([&] { settle_sharded_checkpoint(); });
  if (chief()) finish([&] { finish_checkpoint(); });
  comm_.barrier();
}

// The tests' fault hook on the thread that writes this rank's part (HPCTRIAL_FAULT's `writer`).
std::function<void()> Loop::writer_fault_hook() const {
  if (faults_->empty()) return {};
  return [faults = faults_.get(), step = batches_trained_] { faults->at(rank::FaultPhase::kCheckpoint, step, /*writer=*/true); };
}

// Every rank's parts of the sharded optimizers' state go straight from it into the file, in
// parallel: no rank gathers the whole state, and the chief writes the rest. Synchronous: the
// loop waits for it anyway (a stop, the end, `checkpoint_storage.async: false`).
void Loop::save_sharded_checkpoint(const detail::LoopState& state, const detail::ShardedOptimizers& sharded,
                                   const checkpoint::Contents* files) {
  const ShardedSave mine = save_shards(sharded, files);
  detail::Snapshot snapshot;
  if (chief()) {
    finish_checkpoint();  // the previous one, if still being written
    snapshot = detail::capture(*context_, *trial_, callbacks_, state, identity_, /*defer=*/false, &mine.whole);
    drop_pieced_datasets(snapshot, mine);
  }
  const std::string path =
      detail::write_sharded_checkpoint(comm_, store_.get(), snapshot.contents, mine,
                                       store_ ? store_->write_options() : checkpoint::WriteOptions{}, writer_fault_hook());
  if (chief()) {
    result_.checkpoint_path = path;
    core::log_debug("checkpoint {} is durable (written by every rank)", path);
    call([&](Callback& c) { c.on_checkpoint_end(path); });
  }
}

// A periodic checkpoint: this rank's parts are copied now (the optimizer may step at once) and
// laid out with the chief; a thread on each rank writes them, the chief's writer its datasets.
// Each later step boundary asks whether every rank is done (the flags' all-reduce), and
// settle_sharded_checkpoint publishes it then; the next checkpoint or the end waits for it.
void Loop::start_sharded_checkpoint(const detail::LoopState& state, const detail::ShardedOptimizers& sharded,
                                    const checkpoint::Contents* files) {
  ShardedSave mine = save_shards(sharded, files);
  detail::Snapshot snapshot;
  std::vector<checkpoint::DatasetSpec> own;
  if (chief()) {
    finish_checkpoint();
    snapshot = detail::capture(*context_, *trial_, callbacks_, state, identity_, /*defer=*/true, &mine.whole);
    drop_pieced_datasets(snapshot, mine);
    // In the order the writer holds them once it has copied the deferred tensors.
    for (const auto& d : snapshot.contents.datasets) own.push_back({d.name, d.dtype, d.shape});
    for (const auto& d : snapshot.deferred) {
      own.push_back({d.name, checkpoint_dtype(d.tensor.scalar_type()), d.tensor.sizes().vec()});
    }
  }
  PieceLayout layout = lay_out_pieces(comm_, store_.get(), std::move(own), snapshot.contents.attributes, mine);
  sharded_in_flight_ = std::make_unique<ShardedWriteInFlight>(
      std::move(layout), std::move(mine), store_ ? store_->write_options() : checkpoint::WriteOptions{},
      writer_fault_hook(), chief());
  if (chief()) {
    snapshot.planned = sharded_in_flight_->planned();
    const auto written = snapshot.planned->written;
    try {
      writer_->submit(std::move(snapshot));
    } catch (const std::exception& e) {
      written(e.what());  // every rank learns it when the checkpoint settles
    }
  }
}

// Collective, on every rank at the same step boundary: waits for this rank's parts, learns
// whether every rank's are durable, and has the chief publish the file; a failure anywhere is
// thrown on every rank.
void Loop::settle_sharded_checkpoint() {
  if (!sharded_in_flight_) return;
  detail::PhaseTimings::Scope t(timings_, "checkpoint_settle");
  const auto in_flight = std::move(sharded_in_flight_);
  const std::string written = detail::agree(comm_, in_flight->wait());
  std::string published;
  if (chief()) {
    if (written.empty()) {
      try {
        in_flight->publish(combine_piece_crcs(in_flight->mine().datasets, in_flight->layout().gathered));
      } catch (const Error& e) {
        in_flight->abandon(e.what());
      }
    } else {
      in_flight->abandon(written);
    }
    try {
      finish_checkpoint();
    } catch (const Error& e) {
      published = e.what();
    }
  }
  comm_.broadcast(published, 0);
  if (!written.empty()) throw CheckpointError("a sharded checkpoint was not written: " + written);
  if (!published.empty()) throw CheckpointError("a sharded checkpoint was not published: rank 0: " + published);
}

}  // namespace hpctrial::trainer::detail
