// checkpoint_levels.memory: each rank's state copied into node memory, where a restart inside the
// job finds it after a rank failed: two slot files a rank (checkpoint/memory_slots.h), written by
// turns, so that a copy torn by the failure never leaves a rank without a good one, in a folder
// that rank/node_memory.h places and removes. The level's thread copies the live tensors straight
// into the slot (training waits for that before its optimizer steps, and only then), then the
// rest, then commits the copy.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "hpctrial/checkpoint/memory_slots.h"
#include "hpctrial/checkpoint/store.h"
#include "hpctrial/core/experiment_config.h"
#include "hpctrial/rank/node_memory.h"
#include "state/checkpointing.h"

namespace hpctrial::trainer::detail {

class MemoryLevel {
 public:
  // `ranks_on_node`: this node's ranks, whose copies share its memory.
  MemoryLevel(const core::CheckpointLevels& levels, rank::NodeMemoryPlace place, int ranks_on_node);
  ~MemoryLevel();
  MemoryLevel(const MemoryLevel&) = delete;
  MemoryLevel& operator=(const MemoryLevel&) = delete;

  // Hands the snapshot to the level's thread (after the previous copy is written, rethrowing its
  // error). The first one's size is checked: ConfigError when two copies a rank on this node
  // would take more than max_share of its memory, or more than its memory directory has free.
  void submit(Snapshot snapshot);
  // Returns once the deferred tensors of the last snapshot are in their slot (training may step).
  void wait_for_copies();
  // Without waiting: the seconds the thread spent on the last copy, once it is committed, and only
  // once; nullopt while it is still being written.
  std::optional<double> take_write_seconds();

  // The batches of the copies this rank holds, newest first (by their headers and manifests; a
  // copy is read whole and verified when it is loaded).
  std::vector<std::int64_t> held() const;
  // This rank's copy at `batches`, read and verified; CheckpointError when it is not good.
  checkpoint::CheckpointStore::Loaded load(std::int64_t batches) const;
  const std::string& dir() const { return memory_.dir(); }
  // Waits for the thread and removes this rank's copies (the trial's run ended).
  void remove();

 private:
  void check_fits(std::uint64_t bytes) const;
  void run();
  void write(Snapshot& snapshot);
  void stop_thread();

  core::CheckpointLevels levels_;
  int ranks_on_node_;
  rank::NodeMemory memory_;
  std::unique_ptr<checkpoint::MemorySlots> slots_;
  bool checked_ = false;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::optional<Snapshot> pending_;
  bool busy_ = false;
  bool copying_ = false;  // the deferred tensors of the current snapshot are not all in their slot
  bool stopping_ = false;
  std::exception_ptr error_;
  std::optional<double> write_seconds_;
  std::thread thread_;
};

}  // namespace hpctrial::trainer::detail
